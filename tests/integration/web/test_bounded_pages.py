"""The job page with a long history (Postgres and SQLite): it lists only the newest failures, plans and
checkpoints, says how many more there are, and shows what the database counted for them (the plans'
tiers, the checkpoints' shards and bytes, the failures' numbers); the failure page finds its own plan."""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import UTC, datetime, timedelta

import httpx
from fastapi import FastAPI
from sqlalchemy import event, insert

from services.root.db.models import FailureEvent, Machine, PersistedCheckpoint, PersistedShard, RecoveryPlan
from services.root.web.contexts.common import TIMELINE_LIMIT
from services.root.web.contexts.job import CHECKPOINT_LIMIT, PLAN_LIMIT
from tests.integration.conftest import create_job

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def test_job_page_lists_the_newest_and_counts_the_rest(
    signed_in: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await create_job(signed_in, machines=2, procs_per_machine=1)
    job_id = uuid.UUID(str(job["id"]))
    failures, plans, checkpoints = TIMELINE_LIMIT + 3, PLAN_LIMIT + 2, CHECKPOINT_LIMIT + 2
    async with root_app.state.castor.database.session() as session:
        # Plan 1 exists; plans 2.. each restore two ranks: the newest from local memory and a peer.
        for generation in range(2, plans + 1):
            sources = [
                {"rank": 0, "tier": "local"},
                {"rank": 1, "tier": "peer" if generation == plans else "local"},
            ]
            session.add(
                RecoveryPlan(job_id=job_id, generation=generation, iteration=generation, sources=sources)
            )
        for n in range(failures):
            session.add(
                FailureEvent(
                    job_id=job_id,
                    rank=0,
                    kind="software",
                    state="recovered",
                    cause=f"failure {n + 1}",
                    detected_at=T0 + timedelta(minutes=n),
                    classified_at=T0 + timedelta(minutes=n, seconds=1),
                    resumed_at=T0 + timedelta(minutes=n, seconds=5),
                    details={},
                )
            )
        for iteration in range(checkpoints):
            checkpoint = PersistedCheckpoint(
                job_id=job_id, iteration=iteration, location=f"file:///c/{iteration}"
            )
            session.add(checkpoint)
            await session.flush()
            for rank in range(2 if iteration else 1):  # the oldest one is partial
                session.add(
                    PersistedShard(
                        checkpoint_id=checkpoint.id, rank=rank, key=f"k{rank}", digest="d" * 64, nbytes=1000
                    )
                )
    response = await signed_in.get(f"/jobs/{job_id}")
    assert response.status_code == 200, response.text
    html = response.text
    assert "3 older failures not shown" in html
    assert "2 older plans not shown" in html
    assert "2 older checkpoints not shown" in html
    causes = [int(n) for n in re.findall(r'<p class="cause">failure (\d+)</p>', html)]
    timeline = causes[-TIMELINE_LIMIT:]  # after the last failure's own panel
    assert timeline == list(range(failures, 3, -1)), "the newest failures, newest first"
    assert min(causes) == 4, "the older ones are not drawn"
    assert f"#{failures}" in html, "the newest failure keeps its number within the job"
    assert "local x1, peer x1" in html and "local x2" in html, "tiers counted by the database"
    assert len(re.findall(r'data-label="Generation">', html)) == PLAN_LIMIT
    assert "2/2" in html and "1/2" not in html, "shards counted by the database; the partial one is older"
    assert len(re.findall(r'data-label="Iteration">', html)) == CHECKPOINT_LIMIT

    # The failure page of a recovered failure recovered by a plan reads that plan, and its number.
    async with root_app.state.castor.database.session() as session:
        plan = RecoveryPlan(
            job_id=job_id,
            generation=plans + 1,
            iteration=7,
            status="ready",
            sources=[{"rank": 1, "tier": "peer"}],
        )
        session.add(plan)
        await session.flush()
        event = FailureEvent(
            job_id=job_id,
            rank=1,
            kind="software",
            state="recovered",
            cause="the one",
            plan_id=plan.id,
            details={},
        )
        session.add(event)
        await session.flush()
        event_id = event.id
    page = await signed_in.get(f"/jobs/{job_id}/failures/{event_id}")
    assert page.status_code == 200, page.text
    assert f"#{failures + 1}" in page.text and "peer" in page.text


async def test_job_page_of_a_thousand_machines_pages_them_and_draws_the_unhealthy_first(
    signed_in: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """1,000 machines: the page draws one page of ranks and every machine that is not healthy, counts them
    all by state, and reads the full rows of only the machines it draws, in a bounded number of queries."""
    job = await create_job(signed_in, machines=1000, procs_per_machine=8, replicas=2)
    job_id = uuid.UUID(str(job["id"]))
    suspect, failed, unregistered = 517, 702, 999
    now = datetime.now(UTC)
    rows = [
        {
            "job_id": job_id,
            "rank": rank,
            "instance_id": f"i-{rank}",
            "address": "10.0.0.1",
            "data_port": 7000,
            "state": "suspect" if rank == suspect else "failed" if rank == failed else "healthy",
            "last_heartbeat_at": now,
            # The grace before a suspect machine is declared lost counts from here: ahead, so that the
            # test app's leader leaves it suspect while the test reads the page.
            "suspected_at": now + timedelta(days=1) if rank == suspect else None,
            "summary": {"local": {str(8 * rank + p): 40 + rank for p in range(8)}, "replicas_skipped": 1},
        }
        for rank in range(1000)
        if rank != unregistered
    ]
    async with root_app.state.castor.database.session() as session:
        await session.execute(insert(Machine), rows)

    loaded: list[int] = []
    statements: list[str] = []

    mine = asyncio.current_task()  # the in-process transport runs the request in this task

    # The page's own reads only: on Postgres the in-process leader's transactions run meanwhile (every tick).
    def on_load(machine: Machine, _: object) -> None:
        if asyncio.current_task() is mine:
            loaded.append(machine.rank)

    def on_execute(*args: object) -> None:
        if asyncio.current_task() is mine:
            statements.append(str(args[2]))

    engine = root_app.state.castor.database.engine.sync_engine
    event.listen(Machine, "load", on_load)
    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        response = await signed_in.get(f"/jobs/{job_id}")
    finally:
        event.remove(Machine, "load", on_load)
        event.remove(engine, "before_cursor_execute", on_execute)
    assert response.status_code == 200, response.text
    page = response.text
    text = " ".join(re.sub(r"<[^>]+>", " ", page).split())
    assert "1,000 machines: 997 healthy · 1 suspect · 1 failed · 1 unregistered" in text
    assert "999 replicas skipped" in text, "counted over every machine, not only those drawn"
    drawn = [int(r) for r in re.findall(r'<article class="machine [^"]*" aria-label="machine (\d+)"', page)]
    # The unhealthy ones first (each linking to its page of ranks), then ranks 0-63 in their groups.
    assert drawn == [suspect, failed, unregistered, *range(64)]
    assert 'aria-label="machine 517"' in page and "?machines=9#placement" in page
    assert 'class="machine state-suspect" aria-label="machine 517"' in page
    assert "machines 0 to 63 of 1,000 (page 1 of 16)" in text
    assert "Group 0 2/2 healthy" in text and "Group 31 2/2 healthy" in text and "Group 32" not in text
    # Bounded reads: full rows of the drawn machines only, and no query per machine.
    assert sorted(loaded) == sorted({suspect, failed, *range(64)}), "only the drawn machines' rows"
    assert len(statements) < 40, statements

    # The suspect machine's own page of ranks: its group says one of two is healthy.
    response = await signed_in.get(f"/jobs/{job_id}?machines=9")
    text = " ".join(re.sub(r"<[^>]+>", " ", response.text).split())
    drawn = [int(r) for r in re.findall(r'aria-label="machine (\d+)"', response.text)]
    assert drawn == [suspect, failed, unregistered, *range(512, 576)]
    assert "Group 258 1/2 healthy" in text and "machines 512 to 575 of 1,000 (page 9 of 16)" in text
    # Past the last page: the last one (ranks 960-999, the unregistered one in its group).
    response = await signed_in.get(f"/jobs/{job_id}?machines=99")
    assert "machines 960 to 999 of 1,000 (page 16 of 16)" in " ".join(
        re.sub(r"<[^>]+>", " ", response.text).split()
    )
    assert "Group 499 1/2 healthy" in " ".join(re.sub(r"<[^>]+>", " ", response.text).split())


async def test_a_ready_plans_tiers_are_counted_once(signed_in: httpx.AsyncClient, root_app: FastAPI) -> None:
    """A ready plan's sources never change: the database counts its tiers for the first page drawn, not
    for every refresh; a plan not ready yet is counted again each time."""
    job = await create_job(signed_in, machines=2, procs_per_machine=1)
    job_id = uuid.UUID(str(job["id"]))
    sources = [{"rank": 0, "tier": "local"}, {"rank": 1, "tier": "peer"}]
    async with root_app.state.castor.database.session() as session:
        ready = RecoveryPlan(
            job_id=job_id, generation=2, iteration=5, status="ready", ready_at=T0, sources=sources
        )
        collecting = RecoveryPlan(job_id=job_id, generation=3, status="collecting", sources=sources)
        session.add_all([ready, collecting])
        await session.flush()
        ids = {"ready": ready.id, "collecting": collecting.id}
    statements: list[str] = []

    def on_execute(*args: object) -> None:
        statement = str(args[2])
        if "json_array_elements" in statement or "json_each" in statement:
            statements.append(statement)

    def counted(plan_id: int) -> int:
        return sum(1 for s in statements if re.search(rf"IN \([^)]*\b{plan_id}\b", s))

    engine = root_app.state.castor.database.engine.sync_engine
    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        pages = [(await signed_in.get(f"/jobs/{job_id}")).text for _ in range(3)]
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
    assert counted(ids["ready"]) == 1, statements
    assert counted(ids["collecting"]) == 3, statements
    assert all(page.count("local x1, peer x1") == 2 for page in pages)
