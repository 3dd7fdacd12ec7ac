"""The heartbeat's hot path at scale: it locks nothing shared (a heartbeat goes through while another
transaction holds the job row), runs no statement that loads every machine or a plan's per-rank sources,
and a large job's counters still follow the heartbeats (refreshed off the request)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event, select

from services.root.db.models import Job
from services.root.flows import machines as machine_flows
from tests.integration.api.test_worker import register
from tests.integration.conftest import admin, bearer, create_job
from tests.integration.test_etcd_summaries import statements_of_this_task

BIG = machine_flows.COUNTERS_INLINE_MAX_MACHINES + 8


async def heartbeat(
    client: httpx.AsyncClient, job: dict[str, Any], rank: int, iteration: int
) -> httpx.Response:
    summary = {"local": {str(rank): iteration}, "committed": iteration, "skipped": 0, "per_minute": 60.0}
    return await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/heartbeat",
        json={"instance_id": f"i-{rank}", "summary": summary},
        headers=bearer(str(job["worker_token"])),
    )


@contextmanager
def this_tasks_statements(root_app: FastAPI) -> Iterator[list[str]]:
    """The SQL statements this task runs inside the block (lowercase, whitespace folded): the in-process
    transport runs a request in this task; the in-process leader's transactions meanwhile are left out."""
    statements: list[str] = []
    with statements_of_this_task(root_app) as seen:
        yield statements
    statements.extend(statement for statement, _ in seen)


async def registered_job(client: httpx.AsyncClient, machines: int) -> dict[str, Any]:
    job = await create_job(client, machines=machines, replicas=2)
    for rank in range(machines):
        assert (await register(client, job, f"i-{rank}")).status_code == 200
    return job


async def test_a_heartbeat_goes_through_while_the_job_row_is_locked(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    job = await registered_job(client, BIG)
    assert (await heartbeat(client, job, 3, 1)).status_code == 200  # the placement is read once per job
    async with database.session() as session:
        await session.execute(select(Job).where(Job.id == job["id"]).with_for_update())
        # Before: every worker request took this lock first, and waited here until the holder committed.
        response = await asyncio.wait_for(heartbeat(client, job, 3, 2), timeout=60)
    assert response.status_code == 200, response.text
    assert [peer["rank"] for peer in response.json()["peers"]] == [2]


async def test_a_heartbeat_reads_neither_every_machine_nor_the_plan(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await registered_job(client, BIG)
    assert (await heartbeat(client, job, 5, 1)).status_code == 200
    with this_tasks_statements(root_app) as statements:
        response = await heartbeat(client, job, 5, 2)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["state"] == "healthy" and body["plan_generation"] == 1
    assert [peer["rank"] for peer in body["peers"]] == [4]
    assert not [s for s in statements if "for update" in s or "for no key update" in s], statements
    assert not [s for s in statements if "sources" in s], "the plan's per-rank sources stay unread"
    machine_reads = [s for s in statements if s.startswith("select") and "from machines" in s]
    assert machine_reads and all(" in (" in s or "rank in" in s for s in machine_reads), machine_reads
    updates = [s for s in statements if s.startswith("update")]
    assert len(updates) == 1 and updates[0].startswith("update machines"), updates


@pytest.mark.parametrize("persist_every", [0, 10])
async def test_a_small_jobs_heartbeat_reads_the_job_row_once(
    client: httpx.AsyncClient, root_app: FastAPI, persist_every: int
) -> None:
    """A running job's heartbeat reads the job again only while a recovery's release may have raced it
    (flows.machines._released_generation): not for a job without a persistent tier, whose persist target
    never has a generation, nor once the target is of the newest generation."""
    machines = 2
    job = await create_job(client, machines=machines, replicas=2, persist_every=persist_every)
    for rank in range(machines):
        assert (await register(client, job, f"i-{rank}")).status_code == 200
    assert (await heartbeat(client, job, 1, 1)).status_code == 200  # the first announces the target
    with this_tasks_statements(root_app) as statements:
        response = await heartbeat(client, job, 1, 2)
    assert response.status_code == 200, response.text
    assert (response.json()["persist"] or {}).get("generation") == (1 if persist_every else None)
    job_reads = [s for s in statements if s.startswith("select") and " from jobs" in s]
    assert len(job_reads) == 1, job_reads


async def test_a_large_jobs_counters_follow_its_heartbeats(client: httpx.AsyncClient) -> None:
    job = await registered_job(client, BIG)
    for rank in range(BIG):
        assert (await heartbeat(client, job, rank, 100 + rank)).status_code == 200
    for _ in range(200):  # refreshed off the request, within COUNTERS_EVERY_S of the last heartbeat
        fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
        if fetched["newest_iteration"] is not None:
            break
        await asyncio.sleep(0.1)
    assert fetched["newest_iteration"] == 100, "the iteration every rank has committed"
    assert fetched["checkpoints_committed"] == sum(100 + rank for rank in range(BIG))
    # A later heartbeat moves them again.
    assert (await heartbeat(client, job, 0, 500)).status_code == 200
    for _ in range(200):
        fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
        if fetched["newest_iteration"] == 101:
            break
        await asyncio.sleep(0.1)
    assert fetched["newest_iteration"] == 101


async def test_concurrent_directive_requests_share_one_read(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await registered_job(client, 4)
    reads: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "from recovery_plans" in statement.lower():
            reads.append(statement)

    engine = root_app.state.castor.database.engine.sync_engine
    url = f"/api/v1/worker/jobs/{job['id']}/directive"
    # The leader reads plans too: count only while the requests run, and allow for its few.
    await client.get(url, params={"wait": 0}, headers=bearer(str(job["worker_token"])))
    event.listen(engine, "before_cursor_execute", record)
    try:
        answers = await asyncio.gather(
            *(
                client.get(url, params={"wait": 0}, headers=bearer(str(job["worker_token"])))
                for _ in range(40)
            )
        )
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert {a.status_code for a in answers} == {200}
    assert len({a.json()["revision"] for a in answers}) == 1 and len(answers[0].json()["machines"]) == 4
    assert len(reads) < 10, f"{len(reads)} reads of the plan for 40 requests"


async def test_a_locked_job_row_holds_back_one_counters_refresh_not_a_connection_each(
    client: httpx.AsyncClient, root_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    monkeypatch.setattr(machine_flows, "COUNTERS_EVERY_S", 0.05)
    job = await registered_job(client, BIG)
    async with database.session() as session:
        await session.execute(select(Job).where(Job.id == job["id"]).with_for_update())
        for iteration in range(1, 21):  # heartbeats for a dozen refresh periods while the row stays locked
            for rank in range(BIG):
                assert (await heartbeat(client, job, rank, iteration)).status_code == 200
            await asyncio.sleep(0.05)
        # Before: a refresh task per period, each waiting for the row with a pooled connection.
        refreshes = [
            t for t in asyncio.all_tasks() if t.get_name() == f"counters-{job['id']}" and not t.done()
        ]
        assert len(refreshes) == 1, "one refresh per job at a time"
        waiting = await database.engine.connect()
        try:
            blocked = (
                await waiting.exec_driver_sql(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND "
                    "query ILIKE 'UPDATE jobs SET checkpoints_committed%' AND datname = current_database()"
                )
            ).scalar_one()
        finally:
            await waiting.close()
        assert blocked == 0, "a counters refresh waits for the job row, holding a connection"
        fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
        assert fetched["newest_iteration"] is None, "nothing refreshed while the row was locked"
    for _ in range(200):  # the lock released, the waiting refresh goes through
        fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
        if fetched["newest_iteration"] == 20:
            break
        await asyncio.sleep(0.05)
    assert fetched["newest_iteration"] == 20
    assert fetched["checkpoints_committed"] == 20 * BIG


async def test_the_leaders_step_on_a_running_job_without_failures_reads_no_plan_and_no_machine(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    from services.root.db import repository as repo
    from services.root.flows import recovery

    job = await registered_job(client, BIG)
    castor = root_app.state.castor
    async with castor.database.session() as session:
        job_row = await repo.get_job(session, uuid.UUID(job["id"]))
        assert job_row is not None and job_row.state == "running"
        with this_tasks_statements(root_app) as statements:
            # The leader does this every tick for every active job.
            actions = await recovery.advance(session, job_row, castor.settings)
    assert actions == []
    assert statements and not [s for s in statements if "from recovery_plans" in s or "from machines" in s], (
        statements
    )


async def test_the_suspicion_pass_loads_only_the_machines_it_has_to_judge(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    from datetime import timedelta

    from services.root.db import repository as repo
    from services.root.db.models import Machine, MachineState, utcnow

    job = await registered_job(client, BIG)
    job_id = uuid.UUID(job["id"])
    database = root_app.state.castor.database
    now = utcnow()
    async with database.session() as session:
        machines = {
            m.rank: m
            for m in (await session.execute(select(Machine).where(Machine.job_id == job_id))).scalars()
        }
        machines[3].state, machines[3].suspected_at = MachineState.SUSPECT, now
        machines[5].state = MachineState.FAILED
        machines[7].last_heartbeat_at = now - timedelta(hours=1)  # silent: lapsed under REST heartbeats
        # Registered long ago and never heard from since: lapsed too.
        machines[11].last_heartbeat_at, machines[11].registered_at = None, now - timedelta(hours=1)
        await session.commit()
    async with database.session() as session:
        etcd = await repo.machines_to_judge(session, job_id, lapsed_before=None)
        rest = await repo.machines_to_judge(session, job_id, lapsed_before=now - timedelta(minutes=5))
    assert [m.rank for m in etcd] == [3, 5], "etcd: only the suspect and the failed machine"
    assert [m.rank for m in rest] == [3, 5, 7, 11], "REST: and those silent past the timeout"


async def recovery_step_selects(root_app: FastAPI, job_id: str, **advance: Any) -> list[str]:
    """The SELECT statements one step of the job's recovery makes (flows.recovery.advance with `advance`),
    this task's only, not the in-process leader's."""
    from services.root.db import repository as repo
    from services.root.flows import recovery

    castor = root_app.state.castor
    async with castor.database.session() as session:
        job_row = await repo.get_job(session, uuid.UUID(job_id), for_update=True)
        assert job_row is not None and job_row.state == "recovering"
        with this_tasks_statements(root_app) as statements:
            await recovery.advance(session, job_row, castor.settings, **advance)
    return [s for s in statements if s.startswith("select")]


async def test_a_recovering_jobs_step_reads_neither_the_plans_sources_nor_the_machines_documents(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """The leader steps a recovering job 5 times a second; at 1,000 machines decoding every machine's
    summary and inventory and the plan's 8,000 sources took 18 % of the root's event loop, and loading
    every machine's row to find who had not reported was its largest cost after that. Only the plan's
    decision reads the inventories (once), which the plans the other tests check depend on; while the
    agents' reports are awaited the step counts them (repo.recovery_progress) and reads no machine's row."""
    from tests.integration.api.test_recovery_flow import report_inventories
    from tests.integration.web.scenario import Scenario

    scenario = Scenario(client, await create_job(client, machines=2, replicas=2))
    await scenario.register(["i-0", "i-1"])
    await scenario.heartbeat(5)

    async def step_reads() -> list[str]:
        reads = await recovery_step_selects(root_app, scenario.id)
        return [s.split(" from ")[0].removeprefix("select ") for s in reads]

    await scenario.kill_process(1)
    await scenario.plan(2, "collecting")
    collecting = await step_reads()
    assert any("sum(" in s and "machines.inventory_generation" in s for s in collecting), collecting
    assert not [s for s in collecting if "machines.rank" in s], "no machine's row while reports are awaited"
    documents = {"recovery_plans.sources", "machines.inventory", "machines.summary"}
    assert not [s for s in collecting if documents & set(s.split(", "))], collecting

    await report_inventories(scenario, 2, [0, 1])
    await scenario.plan(2, "ready")
    resuming = await step_reads()
    assert any("sum(" in s and "machines.resumed_generation" in s for s in resuming), resuming
    assert not [s for s in resuming if "machines.rank" in s], "no machine's row while reports are awaited"
    assert not [s for s in resuming if documents & set(s.split(", "))], resuming


async def test_a_plan_waiting_for_uploads_reads_no_inventory_until_one_arrives(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """A plan that waits for uploads in flight (flows.recovery._decide) decided once: every later step
    until the awaited shards have all arrived looks for those shards only. Before, each of the 5 steps a
    second decided again, reading every machine's inventory and every persisted shard (0.2-0.4 s at 1,000
    machines)."""
    from services.root.flows import recovery
    from tests.integration.api.test_persist_recovery import (
        memory_lost_with_an_upload_in_flight,
        report_persisted,
    )

    scenario, _, newer = await memory_lost_with_an_upload_in_flight(client, uploading=(0, 1))
    waits: dict[uuid.UUID, recovery.UploadWait] = {}

    async def step_reads() -> list[str]:
        return await recovery_step_selects(root_app, scenario.id, upload_waits=waits)

    def decides(reads: list[str]) -> bool:
        columns = [set(s.split(" from ")[0].removeprefix("select ").split(", ")) for s in reads]
        return any("machines.inventory" in c for c in columns)

    assert decides(await step_reads())
    (wait,) = waits.values()
    assert wait.awaiting == {(newer, 0, 1), (newer, 1, 1)}, wait
    for arrived in (None, 1):  # nothing yet; then one of the two (nothing restorable changed)
        if arrived is not None:
            await report_persisted(scenario, arrived, newer, 1)
        for _ in range(3):
            reads = await step_reads()
            assert not decides(reads) and not [s for s in reads if "persisted_shards.digest" in s], reads
    # Once both arrived, the plan decides (here or in the in-process leader, whichever steps first).
    await report_persisted(scenario, 0, newer, 1)
    assert (await scenario.plan(2, "ready"))["iteration"] == newer
