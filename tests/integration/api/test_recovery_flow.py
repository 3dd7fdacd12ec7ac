"""The recovery state machine's unhappy paths, on Postgres and SQLite, driven the way agents drive it: a
crash while ranks restore starts a new generation, a crash loop ends with the job failed, and a
replacement that arrives late still gets its own time to report what it holds.

The root here has tight timeouts and its own database, so that its leader is the only one acting on
these jobs."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.root.app import create_app
from services.root.db import repository as repo
from services.root.db.models import PersistedCheckpoint, PersistedShard
from services.root.domain import recovery_states
from services.root.domain.recovery_states import RecoveryState
from services.root.flows.failures import machine_lost
from services.root.schemas import INT32_MAX
from services.root.settings import Settings
from tests.integration.conftest import ADMIN_TOKEN, create_job, fresh_client
from tests.integration.web.scenario import Scenario, eventually
from worker_lib.persistent_keys import shard_key

MAX_FAILED_RECOVERIES = 2
INVENTORY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
async def tight_app(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FastAPI]:
    if request.param == "postgres":
        database = request.getfixturevalue("postgres_server").create_database(f"flow_{uuid.uuid4().hex[:8]}")
    else:
        database = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('flow') / 'castor.db'}"
    state: Path = tmp_path_factory.mktemp("flow-state")
    settings = Settings(
        database_url=database,
        admin_token=ADMIN_TOKEN,
        state_dir=state,
        heartbeat_timeout_s=3600,
        inventory_timeout_s=INVENTORY_TIMEOUT_S,
        max_failed_recoveries=MAX_FAILED_RECOVERIES,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(tight_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with fresh_client(tight_app) as http:
        yield http


async def two_machines(client: httpx.AsyncClient) -> Scenario:
    scenario = Scenario(client, await create_job(client, machines=2, replicas=2))
    await scenario.register(["i-0", "i-1"])
    await scenario.heartbeat(5)
    return scenario


async def report_inventories(scenario: Scenario, generation: int, ranks: list[int]) -> None:
    await scenario.plan(generation, "collecting")
    for rank in ranks:
        await scenario.post(f"/machines/{rank}/inventory", inventory_of(scenario, rank, generation), 204)


def inventory_of(scenario: Scenario, rank: int, generation: int) -> dict[str, Any]:
    holdings = [
        {
            "rank": r,
            "iteration": 5,
            "tier": tier,
            "digest": f"{r:02d}" * 8,
            "data_bytes": 64,
            "verified": True,
        }
        for r, tier in ((rank, "local"), (1 - rank, "replica"))
    ]
    return {"instance_id": scenario.instances[rank], "generation": generation, "holdings": holdings}


async def restore_without_resuming(scenario: Scenario, generation: int) -> None:
    await report_inventories(scenario, generation, [0, 1])
    await scenario.plan(generation, "ready")
    for rank, instance in enumerate(scenario.instances):
        body = {"instance_id": instance, "generation": generation, "event": "restored"}
        await scenario.post(f"/machines/{rank}/progress", body, 204)


async def test_a_crash_while_ranks_restore_starts_a_new_generation_and_a_crash_loop_fails_the_job(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="services.root.flows.recovery")
    scenario = await two_machines(client)
    await scenario.kill_process(1)
    await restore_without_resuming(scenario, generation=2)

    await scenario.kill_process(1)  # the restarted process dies before its first iteration
    await scenario.plan(3, "collecting")  # not folded into the finished plan: a recovery of its own
    await restore_without_resuming(scenario, generation=3)

    await scenario.kill_process(1)  # and again: a crash loop
    job = await eventually(
        lambda: _job_in_state(scenario, "failed"), f"the job to fail after {MAX_FAILED_RECOVERIES} tries"
    )
    assert job["finished_at"]
    failures = await scenario.api("/failures")
    assert {f["state"] for f in failures} == {"unrecoverable"}, "every attempt's failures, given up"
    assert "recoveries in a row failed" in failures[0]["details"]["unrecoverable"]
    directive = await client.get(f"/api/v1/worker/jobs/{scenario.id}/directive", headers=scenario.worker)
    assert (directive.json()["status"], directive.json()["job_state"]) == ("finished", "failed")
    newest = (await scenario.api("/recovery-plans"))[0]
    assert newest["generation"] == 3, "no attempt after the last one allowed"

    # Each step checked the state it found and the state it left the recovery in against the protocol's
    # table (domain.recovery_states): the crash loop went through these transitions, all of them allowed
    # (between two steps the crash moved the recovery back to detected, and the agents' reports may have
    # moved a plan from planned to resuming).
    mine = [r.getMessage() for r in caplog.records if f"job {scenario.job['name']}:" in r.getMessage()]
    assert not [m for m in mine if "no such transition" in m], mine
    moves = {
        (RecoveryState(found[1]), RecoveryState(found[2]))
        for found in (re.search(r"recovery (\w+) -> (\w+)$", m) for m in mine)
        if found
    }
    assert moves >= {
        (RecoveryState.DETECTED, RecoveryState.COLLECTING),
        (RecoveryState.COLLECTING, RecoveryState.PLANNED),
        (RecoveryState.DETECTED, RecoveryState.FAILED),
    }, mine
    assert moves & {
        (RecoveryState.PLANNED, RecoveryState.DETECTED),
        (RecoveryState.RESUMING, RecoveryState.DETECTED),
    }
    assert all(recovery_states.allowed(*move) for move in moves)


async def test_a_recovery_that_resumes_resets_the_count(client: httpx.AsyncClient) -> None:
    scenario = await two_machines(client)
    for generation in (2, 3, 4):  # more recoveries than the limit, each one resuming training
        await scenario.kill_process(1)
        await restore_without_resuming(scenario, generation)
        for rank, instance in enumerate(scenario.instances):
            body = {"instance_id": instance, "generation": generation, "event": "resumed"}
            await scenario.post(f"/machines/{rank}/progress", body, 204)
        await eventually(lambda: _job_in_state(scenario, "running"), "the job to run again")


async def test_a_late_replacement_gets_its_own_time_to_report(
    client: httpx.AsyncClient, tight_app: FastAPI
) -> None:
    scenario = await two_machines(client)
    database = tight_app.state.castor.database
    async with database.session() as session:
        job = await repo.get_job(session, uuid.UUID(scenario.id), for_update=True)
        assert job is not None
        machine = next(m for m in await repo.live_machines(session, job.id) if m.rank == 1)
        await machine_lost(session, job, machine, "stopped heartbeating (test)")
    await report_inventories(scenario, 2, [0])

    # The new machine arrives long after the recovery started (EC2 takes minutes)...
    await asyncio.sleep(INVENTORY_TIMEOUT_S * 1.5)
    body = {"instance_id": "i-1b", "address": "127.0.0.1", "data_port": 7101}
    await scenario.post("/machines", body, 200)
    scenario.instances = ["i-0", "i-1b"]
    # ...and still reports what it holds (nothing: fresh memory) in time.
    await scenario.post(
        "/machines/1/inventory", {"instance_id": "i-1b", "generation": 2, "holdings": []}, 204
    )
    plan = await scenario.plan(2, "ready")
    assert {s["rank"]: s["tier"] for s in plan["sources"]} == {0: "local", 1: "peer"}
    machines = await scenario.api("/machines")
    assert [(m["rank"], m["instance_id"], m["state"]) for m in machines][1] == (1, "i-1b", "healthy")


async def test_a_machine_that_never_reports_its_inventory_is_declared_lost_after_the_timeout(
    client: httpx.AsyncClient, tight_app: FastAPI
) -> None:
    """While inventories are missing the leader only counts them (repo.recovery_progress); one missing
    past the timeout is a lost machine all the same."""
    scenario = await two_machines(client)
    await scenario.kill_process(1)
    await report_inventories(scenario, 2, [0])  # machine 1 says nothing
    database = tight_app.state.castor.database
    async with database.session() as session:
        progress = await repo.recovery_progress(session, uuid.UUID(scenario.id), 2)
        silent = next(m for m in await repo.live_machines(session, uuid.UUID(scenario.id)) if m.rank == 1)
    assert progress == repo.RecoveryProgress(1, silent.registered_at, 2, 2, False, False)

    async def lost() -> list[dict[str, Any]] | None:
        failures: list[dict[str, Any]] = await scenario.api("/failures")
        found = [f for f in failures if "did not report its inventory in time" in f["cause"]]
        return found or None

    (failure,) = await eventually(lost, "machine 1 to be declared lost for its missing inventory")
    assert failure["rank"] == 1
    machines = await scenario.api("/machines")
    assert machines[1]["state"] == "failed" and machines[0]["state"] != "failed"
    async with database.session() as session:
        progress = await repo.recovery_progress(session, uuid.UUID(scenario.id), 2)
    assert progress.any_failed


async def test_a_machine_that_restores_but_never_resumes_is_declared_lost_after_the_timeout(
    client: httpx.AsyncClient, tight_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While ranks restore and resume the leader only counts their reports; a machine that never resumes
    is lost once the restore timeout passes."""
    monkeypatch.setattr(tight_app.state.castor.settings, "restore_timeout_s", 1.5)
    scenario = await two_machines(client)
    await scenario.kill_process(1)
    await restore_without_resuming(scenario, generation=2)
    body = {"instance_id": scenario.instances[0], "generation": 2, "event": "resumed"}
    await scenario.post("/machines/0/progress", body, 204)  # machine 1 restored, and stays silent
    async with tight_app.state.castor.database.session() as session:
        progress = await repo.recovery_progress(session, uuid.UUID(scenario.id), 2)
    assert progress == repo.RecoveryProgress(0, None, 0, 1, False, False)

    async def lost() -> list[dict[str, Any]] | None:
        failures: list[dict[str, Any]] = await scenario.api("/failures")
        return [f for f in failures if "did not resume training in time" in f["cause"]] or None

    (failure,) = await eventually(lost, "machine 1 to be declared lost for not resuming")
    assert failure["rank"] == 1
    assert [m["state"] for m in await scenario.api("/machines")] == ["healthy", "failed"]


async def _job_in_state(scenario: Scenario, state: str) -> dict[str, Any] | None:
    job: dict[str, Any] = await scenario.api("")
    return job if job["state"] == state else None


async def test_a_plan_points_at_the_key_the_root_computes_never_a_stored_one(
    client: httpx.AsyncClient, tight_app: FastAPI
) -> None:
    """A persisted shard recorded before the root computed keys may name anything (another job's
    objects): the plan's restore location is computed again from (prefix, job, iteration, rank,
    generation)."""
    scenario = await two_machines(client)
    async with tight_app.state.castor.database.session() as session:
        legacy = PersistedCheckpoint(job_id=uuid.UUID(scenario.id), iteration=3, location="castor")
        session.add(legacy)
        await session.flush()
        for rank in (0, 1):
            session.add(
                PersistedShard(
                    checkpoint_id=legacy.id, rank=rank, key="castor/another-job", digest=f"d{rank}", nbytes=1
                )
            )
    await scenario.kill_process(1)
    await scenario.plan(2, "collecting")
    for rank, instance in enumerate(scenario.instances):  # memory lost: only the persistent tier is left
        body = {"instance_id": instance, "generation": 2, "holdings": []}
        await scenario.post(f"/machines/{rank}/inventory", body, 204)
    plan = await scenario.plan(2, "ready")
    assert plan["iteration"] == 3
    assert {s["rank"]: (s["tier"], s["location"]) for s in plan["sources"]} == {
        rank: ("persistent", shard_key("castor", scenario.id, 3, rank, 1)) for rank in (0, 1)
    }


async def test_an_inventory_report_that_waits_is_answered_with_the_machines_next_directive(
    client: httpx.AsyncClient,
) -> None:
    """An agent's inventory report is also its next directive long poll (`after`, `wait`): recorded at
    once, answered with its own machine's directive once the plan that the last report completed is
    ready."""
    scenario = await two_machines(client)
    await scenario.kill_process(1)
    await scenario.plan(2, "collecting")
    collecting = await client.get(
        f"/api/v1/worker/jobs/{scenario.id}/directive", params={"machine": 0}, headers=scenario.worker
    )
    assert collecting.json()["status"] == "collecting"
    url = f"/api/v1/worker/jobs/{scenario.id}/machines/0/inventory"
    params = {"after": collecting.json()["revision"], "wait": 30}
    report = asyncio.create_task(
        client.post(url, params=params, json=inventory_of(scenario, 0, 2), headers=scenario.worker)
    )
    await asyncio.sleep(0.3)
    assert not report.done(), "machine 1 has not reported: the report waits as a long poll"
    await scenario.post("/machines/1/inventory", inventory_of(scenario, 1, 2), 204)  # the last one
    answer = await asyncio.wait_for(report, 30)
    assert answer.status_code == 200, answer.text
    directive = answer.json()
    assert (directive["status"], directive["generation"], directive["machine"]) == ("ready", 2, 0)
    assert directive["revision"] > params["after"] and directive["iteration"] == 5
    assert {s["rank"] for s in directive["sources"]} == {0}, "machine 0's own ranks' sources only"
    # Recorded before it waited: the plan that answered it needed machine 0's report too.


async def test_iterations_lost_ignore_machines_replaced_in_an_earlier_recovery(
    client: httpx.AsyncClient, tight_app: FastAPI
) -> None:
    """Machine 1 got to iteration 150 and was lost; the job went back to 5 on a replacement. When the next
    failure hits at iteration 10, 5 iterations are lost: before, the lost machine's last summary (150, a
    history the job rolled back from) made it 145."""
    scenario = await two_machines(client)
    summary = {"local": {"1": 150}, "committed": 151, "skipped": 0}
    await scenario.post("/machines/1/heartbeat", {"instance_id": "i-1", "summary": summary}, 200)
    async with tight_app.state.castor.database.session() as session:
        job = await repo.get_job(session, uuid.UUID(scenario.id), for_update=True)
        assert job is not None
        machine = next(m for m in await repo.live_machines(session, job.id) if m.rank == 1)
        await machine_lost(session, job, machine, "stopped heartbeating (test)")
    await report_inventories(scenario, 2, [0])
    await scenario.post("/machines", {"instance_id": "i-1b", "address": "127.0.0.1", "data_port": 7101}, 200)
    scenario.instances = ["i-0", "i-1b"]
    await scenario.post(
        "/machines/1/inventory", {"instance_id": "i-1b", "generation": 2, "holdings": []}, 204
    )
    await scenario.plan(2, "ready")
    for event in ("restored", "resumed"):
        for rank, instance in enumerate(scenario.instances):
            body = {"instance_id": instance, "generation": 2, "event": event}
            await scenario.post(f"/machines/{rank}/progress", body, 204)
    await eventually(lambda: _job_in_state(scenario, "running"), "the job to run again")
    first = (await scenario.api("/failures"))[0]
    assert first["iterations_lost"] == 145, first  # this one did lose them

    await scenario.heartbeat(10)
    failure_id = await scenario.kill_process(0)
    await report_inventories(scenario, 3, [0, 1])
    await scenario.plan(3, "ready")
    failure = await scenario.api(f"/failures/{failure_id}")
    assert failure["iterations_lost"] == 5, failure


async def test_a_restart_from_scratch_after_the_last_countable_iteration_is_planned(
    client: httpx.AsyncClient,
) -> None:
    """Nothing to restore after iteration 2**31 - 1: 2**31 iterations lost, one more than the column
    holds (on Postgres the leader's step failed at every pass and the recovery never got a plan)."""
    scenario = await two_machines(client)
    for rank, instance in enumerate(scenario.instances):
        summary = {"local": {str(rank): INT32_MAX}, "committed": INT32_MAX, "skipped": 0}
        await scenario.post(f"/machines/{rank}/heartbeat", {"instance_id": instance, "summary": summary}, 200)
    failure_id = await scenario.kill_process(1)
    await scenario.plan(2, "collecting")
    for rank, instance in enumerate(scenario.instances):
        body = {"instance_id": instance, "generation": 2, "holdings": []}
        await scenario.post(f"/machines/{rank}/inventory", body, 204)
    plan = await scenario.plan(2, "ready")
    assert plan["iteration"] is None, plan
    assert (await scenario.api(f"/failures/{failure_id}"))["iterations_lost"] == INT32_MAX
