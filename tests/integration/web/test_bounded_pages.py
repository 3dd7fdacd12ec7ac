"""The job page with a long history (Postgres and SQLite): it lists only the newest failures, plans and
checkpoints, says how many more there are, and shows what the database counted for them (the plans'
tiers, the checkpoints' shards and bytes, the failures' numbers); the failure page finds its own plan."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import httpx
from fastapi import FastAPI

from services.root.db.models import FailureEvent, PersistedCheckpoint, PersistedShard, RecoveryPlan
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
