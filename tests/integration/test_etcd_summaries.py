"""etcd mode's summaries, on Postgres and SQLite: the leader writes the summaries its watch took from the
agents' keys in batches (flows.machines.record_summaries), one transaction per job with the machines' rows
in one statement and no read of them for a large job, a replaced machine's summary dropped; and which of
them it writes (orchestration.detection): a returned machine's at once, another within SUMMARY_WRITE_S of
its last not at all, a key whose expiry was noted meanwhile not at all (its summary is stale)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event, select, update

from services.root.clients.etcd import MachineKey
from services.root.db.models import Job, Machine, MachineState
from services.root.flows import machines as machine_flows
from services.root.orchestration import detection
from services.root.orchestration.detection import Detectors
from tests.integration.api.test_worker import register
from tests.integration.conftest import admin, create_job
from tests.integration.web.scenario import eventually

BIG = machine_flows.COUNTERS_INLINE_MAX_MACHINES + 8


def summary(rank: int, iteration: int) -> dict[str, Any]:
    return {"local": {str(rank): iteration}, "committed": iteration, "skipped": 0, "per_minute": 60.0}


def keyed(job_id: uuid.UUID, batch: dict[str, dict[str, Any]]) -> dict[MachineKey, dict[str, Any]]:
    """The batch under the etcd keys its agents write (`registered`'s instance ids end in their rank)."""
    return {
        MachineKey(job_id, int(i.rsplit("-", 1)[1]) if i[-1].isdigit() else 0, i): s for i, s in batch.items()
    }


async def registered(client: httpx.AsyncClient, machines: int) -> tuple[dict[str, Any], list[str]]:
    """A job with every rank registered; its instance ids (unique: the leader's throttle is per instance)."""
    job = await create_job(client, machines=machines, replicas=2)
    instances = [f"i-{uuid.uuid4().hex[:8]}-{rank}" for rank in range(machines)]
    for instance in instances:
        assert (await register(client, job, instance)).status_code == 200
    return job, instances


@contextmanager
def statements_of_this_task(app: FastAPI) -> Iterator[list[tuple[str, bool]]]:
    """(statement, executemany) of each statement this task runs (not the leader's meanwhile)."""
    seen: list[tuple[str, bool]] = []
    mine = asyncio.current_task()

    def record(_conn: Any, _cursor: Any, statement: str, _params: Any, _ctx: Any, many: bool) -> None:
        if asyncio.current_task() is mine:
            seen.append((" ".join(statement.split()).lower(), many))

    engine = app.state.castor.database.engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


async def rows(app: FastAPI, job_id: uuid.UUID) -> dict[str, Machine]:
    async with app.state.castor.database.session() as session:
        machines = (await session.execute(select(Machine).where(Machine.job_id == job_id))).scalars()
        return {m.instance_id: m for m in machines}


async def test_a_batch_is_one_statement_for_every_machine_and_skips_a_replaced_one(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job, instances = await registered(client, BIG)
    job_id = uuid.UUID(job["id"])
    database = root_app.state.castor.database
    replaced = instances[3]
    async with database.session() as session:
        await session.execute(
            update(Machine)
            .where(Machine.job_id == job_id, Machine.instance_id == replaced)
            .values(state=MachineState.REPLACED, summary={})
        )
    before = await rows(root_app, job_id)
    batch = {instance: summary(rank, 100 + rank) for rank, instance in enumerate(instances)}
    batch["i-unknown"] = summary(0, 1)  # an instance the job does not know: nothing to write
    with statements_of_this_task(root_app) as statements:
        async with database.session() as session:
            await machine_flows.record_summaries(session, job_id, keyed(job_id, batch))
    writes = [(s, many) for s, many in statements if s.startswith(("update", "insert", "delete"))]
    assert writes == [(writes[0][0], True)] and writes[0][0].startswith("update machines"), writes
    machine_reads = [s for s, _ in statements if s.startswith("select") and "from machines" in s]
    assert machine_reads == [], "a large job's machines are written, not read"
    (job_read,) = [s for s, _ in statements if "from jobs" in s]  # once per batch
    assert "for update" not in job_read and "for no key update" not in job_read, "read, not locked"

    after = await rows(root_app, job_id)
    for rank, instance in enumerate(instances):
        if instance == replaced:
            assert after[instance].summary == {} and after[instance].state == MachineState.REPLACED
            assert after[instance].last_heartbeat_at == before[instance].last_heartbeat_at
        else:
            assert after[instance].summary == summary(rank, 100 + rank)
            assert after[instance].last_heartbeat_at > before[instance].last_heartbeat_at  # type: ignore[operator]
    assert "i-unknown" not in after

    async def counted() -> dict[str, Any] | None:  # refreshed after the commit, off the batch
        fetched: dict[str, Any] = (await client.get(f"/api/v1/jobs/{job_id}", headers=admin())).json()
        return fetched if fetched["checkpoints_committed"] else None

    fetched = await eventually(counted, "the job's counters to follow the batch")
    assert fetched["checkpoints_committed"] == sum(100 + r for r, i in enumerate(instances) if i != replaced)


async def test_a_small_jobs_batch_refreshes_its_counters_in_its_transaction_job_row_first(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job, instances = await registered(client, 4)
    job_id = uuid.UUID(job["id"])
    database = root_app.state.castor.database
    batch = {instance: summary(rank, 7 + rank) for rank, instance in enumerate(instances[:3])}
    with statements_of_this_task(root_app) as statements:
        async with database.session() as session:
            await machine_flows.record_summaries(session, job_id, keyed(job_id, batch))
            # Read in the same transaction: the counters are the batch's, not a later refresh's.
            counted = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
            assert counted.checkpoints_committed == 7 + 8 + 9
            assert counted.newest_iteration is None, "rank 3 has reported nothing yet"
    writes = [s for s, _ in statements if s.startswith("update")]
    # The orchestrator's lock order, job then machines: no deadlock with the leader's judgement.
    assert [s.split()[1] for s in writes] == ["jobs", "machines"], writes

    async with database.session() as session:
        await machine_flows.record_summaries(session, job_id, keyed(job_id, {instances[3]: summary(3, 8)}))
        counted = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
        assert counted.newest_iteration == 7, "every rank has reported: the oldest newest iteration"


@pytest.mark.parametrize(
    "bad",
    [
        {"local": {"0": "x"}},
        {"local": {"a": 1}},
        {"committed": "5"},
        {"per_minute": float("nan")},
        {"local": {str(rank): 1 for rank in range(70_000)}},
    ],
    ids=["iteration-not-a-number", "rank-not-a-number", "count-as-text", "nan-rate", "70000-ranks"],
)
async def test_a_summary_that_fails_the_heartbeat_schema_is_recorded_empty_and_the_batch_goes_through(
    client: httpx.AsyncClient, root_app: FastAPI, bad: dict[str, Any]
) -> None:
    """An etcd key holds whatever its agent wrote. Before, one such summary raised in the batch at every pass
    (every machine of the job lost its summary, a returning suspect its sign of life), or was stored for the
    recovery planner to trip on."""
    job, instances = await registered(client, 3)
    job_id = uuid.UUID(job["id"])
    before = await rows(root_app, job_id)
    batch = {instances[0]: summary(0, 7), instances[1]: bad, instances[2]: summary(2, 9)}
    async with root_app.state.castor.database.session() as session:
        await machine_flows.record_summaries(session, job_id, keyed(job_id, batch))
        counted = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
        assert counted.checkpoints_committed == 7 + 9
    after = await rows(root_app, job_id)
    assert after[instances[1]].summary == {}
    assert after[instances[0]].summary == summary(0, 7)
    for instance in instances:  # every machine's sign of life recorded
        assert after[instance].last_heartbeat_at > before[instance].last_heartbeat_at  # type: ignore[operator]


async def test_a_summary_is_confined_to_its_machines_ranks_and_written_only_at_its_keys_rank(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """An etcd summary naming ranks its machine does not run moves no counter (flows.machines.own_summary),
    and one under a key of a rank its instance does not hold is neither written nor counted."""
    job, instances = await registered(client, 3)
    job_id = uuid.UUID(job["id"])
    before = await rows(root_app, job_id)
    claims = {"local": {"0": 7, "2": 10_000}, "committed": 7, "skipped": 0, "per_minute": 60.0}
    batch = {
        MachineKey(job_id, 0, instances[0]): claims,
        MachineKey(job_id, 1, instances[1]): summary(1, 8),
        MachineKey(job_id, 0, instances[2]): summary(0, 10_000),  # machine 2's instance under rank 0's key
    }
    async with root_app.state.castor.database.session() as session:
        await machine_flows.record_summaries(session, job_id, batch)
        counted = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
        # Nor does the summary under another rank's key move a counter, or the persist schedule.
        assert counted.checkpoints_committed == 7 + 8
        assert counted.persist_iteration is None or counted.persist_iteration < 10_000
    after = await rows(root_app, job_id)
    assert after[instances[0]].summary == {**claims, "local": {"0": 7}}
    assert after[instances[2]].summary == before[instances[2]].summary
    assert after[instances[2]].last_heartbeat_at == before[instances[2]].last_heartbeat_at
    async with root_app.state.castor.database.session() as session:
        await machine_flows.record_summaries(session, job_id, keyed(job_id, {instances[2]: summary(2, 9)}))
        counted = (await session.execute(select(Job).where(Job.id == job_id))).scalar_one()
        assert counted.newest_iteration == 7, "rank 2's newest is machine 2's own: 9"


async def detectors_leading(app: FastAPI) -> Detectors:
    orchestrator = app.state.castor.orchestrator
    await eventually(lambda: _true(orchestrator.is_leader), "the root to lead")
    detectors: Detectors = orchestrator.detectors
    return detectors


async def _true(value: bool) -> bool:
    return value


async def test_a_returned_machines_summary_is_written_at_once_others_at_most_every_interval(
    client: httpx.AsyncClient, root_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(detection, "SUMMARY_WRITE_S", 3600.0)  # the test's writes are all within it
    job, instances = await registered(client, 2)
    job_id = uuid.UUID(job["id"])
    detectors = await detectors_leading(root_app)
    keys = [MachineKey(job_id, rank, instance) for rank, instance in enumerate(instances)]

    await detectors._store_summaries({key: summary(key.rank, 1) for key in keys})
    first = await rows(root_app, job_id)
    assert [first[i].summary for i in instances] == [summary(0, 1), summary(1, 1)]

    detectors._silent_keys.add(keys[1])  # its lease expired, and now it is back
    await detectors._store_summaries({key: summary(key.rank, 2) for key in keys})
    second = await rows(root_app, job_id)
    assert second[instances[0]].summary == summary(0, 1), "within SUMMARY_WRITE_S of its last: not written"
    assert second[instances[1]].summary == summary(1, 2), "a returned machine's: at once"
    assert second[instances[1]].last_heartbeat_at > first[instances[1]].last_heartbeat_at  # type: ignore[operator]
    assert keys[1] not in detectors._silent_keys

    await detectors._store_summaries({keys[1]: summary(1, 3)})
    third = await rows(root_app, job_id)
    assert third[instances[1]].summary == summary(1, 2), "back to the interval once written"


async def test_an_expiry_noted_before_a_batch_is_written_drops_that_keys_summary(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job, instances = await registered(client, 2)
    job_id = uuid.UUID(job["id"])
    detectors = await detectors_leading(root_app)
    keys = [MachineKey(job_id, rank, instance) for rank, instance in enumerate(instances)]
    taken = {key: summary(key.rank, 4) for key in keys}  # the batch, taken from the watch's notes
    detectors._lease_events.expired(keys[0])  # then machine 0's lease expired, before the batch's write
    await detectors._store_summaries(taken)
    written = await rows(root_app, job_id)
    assert written[instances[0]].state == MachineState.SUSPECT, "the expiry went first"
    assert written[instances[0]].summary != summary(0, 4), "its stale summary is not written"
    assert written[instances[1]].summary == summary(1, 4)
    assert keys[0] in detectors._silent_keys, "its next summary (it came back) is written at once"
    assert detectors._lease_events.take_expired() == set()
