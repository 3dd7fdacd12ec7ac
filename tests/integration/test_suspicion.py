"""Suspicion before replacement, on Postgres and SQLite, through the worker API the agents use: a machine
whose heartbeats lapse is only suspect; a peer's training process failing declares it lost; a suspect or a
failed machine whose heartbeats resume is reinstated (and its replacement request cancelled); the grace
alone declares a silent suspect lost. And job isolation: one job whose orchestration step raises does not
stop the recovery of another.

The root here has a short heartbeat timeout and a grace no test waits for (set lower where a test needs
it), and its own database, so that its leader is the only one acting on these jobs."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from services.root.app import create_app
from services.root.clients.etcd import machine_key
from services.root.db import repository as repo
from services.root.db.models import LeaderEpoch
from services.root.flows import recovery
from services.root.settings import Settings
from tests import harness
from tests.integration.conftest import ADMIN_TOKEN, create_job, fresh_client
from tests.integration.web.scenario import Scenario, eventually
from worker_lib.agent.heartbeat import etcd_heartbeats

HEARTBEAT_TIMEOUT_S = 1.5
LONG_GRACE_S = 3600.0
# What a gloo rank raises when the peer it was reading from is gone (torch 2.13, measured).
GLOO_RESET = {
    "type": "RuntimeError",
    "message": "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[10.0.0.2]:62647: Connection reset by peer.",
}


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
async def suspicious_app(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FastAPI]:
    if request.param == "postgres":
        database = request.getfixturevalue("postgres_server").create_database(f"susp_{uuid.uuid4().hex[:8]}")
    else:
        database = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('susp') / 'castor.db'}"
    state: Path = tmp_path_factory.mktemp("susp-state")
    settings = Settings(
        database_url=database,
        admin_token=ADMIN_TOKEN,
        state_dir=state,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        suspect_grace_s=LONG_GRACE_S,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(suspicious_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    suspicious_app.state.castor.settings.suspect_grace_s = LONG_GRACE_S
    async with fresh_client(suspicious_app) as http:
        yield http


@contextlib.asynccontextmanager
async def heartbeating(scenario: Scenario, ranks: list[int]) -> AsyncIterator[None]:
    """The agents of `ranks` heartbeat (every 0.2 s, well inside the timeout) while the block runs."""

    async def beat() -> None:
        while True:
            for rank in ranks:
                body = {"instance_id": scenario.instances[rank], "summary": {"local": {str(rank): 5}}}
                await scenario.post(f"/machines/{rank}/heartbeat", body, 200)
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def two_machines(client: httpx.AsyncClient) -> Scenario:
    scenario = Scenario(client, await create_job(client, machines=2, replicas=2))
    await scenario.register(["i-0", "i-1"])
    await scenario.heartbeat(5)
    return scenario


async def machine_state(scenario: Scenario, rank: int) -> str:
    machines = await scenario.api("/machines")
    return str(next(m["state"] for m in machines if m["rank"] == rank))


async def in_state(scenario: Scenario, rank: int, state: str) -> bool:
    return await machine_state(scenario, rank) == state


async def test_a_silent_machine_is_suspect_and_lost_when_its_peer_fails_then_reinstated(
    client: httpx.AsyncClient,
) -> None:
    scenario = await two_machines(client)
    async with heartbeating(scenario, [0]):
        await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect")
        assert await scenario.api("/failures") == [], "a lapse of heartbeats alone declares nothing"
        assert (await scenario.api(""))["state"] == "running"

        # Machine 0's training process fails in a collective: the second signal.
        await scenario.kill_process(0, 1, GLOO_RESET)
        assert await machine_state(scenario, 1) == "failed"
        (event,) = await scenario.api("/failures")
        assert (event["kind"], event["rank"]) == ("hardware", 1)
        assert "peers' training processes failed" in event["cause"]
        assert [c["machine_rank"] for c in event["details"]["cascade"]] == [0], "the exit is its symptom"

        # No launch spec: the local operator cannot replace it; the request is recorded and retried.
        await eventually(
            lambda: _replacement_status(scenario, "error"), "the replacement request to be recorded"
        )
        # Machine 1 was alive after all: its heartbeats resume before any replacement registered.
        body = {"instance_id": "i-1", "summary": {"local": {"1": 5}}}
        await scenario.post("/machines/1/heartbeat", body, 200)
        await eventually(lambda: in_state(scenario, 1, "healthy"), "machine 1 to be reinstated")
        (event,) = await scenario.api("/failures")
        assert event["details"]["replacement"]["status"] == "cancelled"
        assert "heartbeats resumed" in event["details"]["reinstated"]["why"]
        # The recovery its loss opened goes on with it: it reports what it holds like the survivor.
        await scenario.plan(2, "collecting")


async def test_a_lost_machine_whose_termination_was_requested_is_not_reinstated(
    client: httpx.AsyncClient, suspicious_app: FastAPI
) -> None:
    """A partitioned machine declared lost, its instance's termination requested (the AWS path records it
    just before the call), whose heartbeats then resume while it shuts down: reinstated, it took part in the
    recovery and died in it, and the instance launched in its place was left unused."""
    scenario = await two_machines(client)
    async with heartbeating(scenario, [0]):
        await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect")
        await scenario.kill_process(0, 1, GLOO_RESET)
        assert await machine_state(scenario, 1) == "failed"
        await eventually(
            lambda: _replacement_status(scenario, "error"), "the replacement request to be recorded"
        )
        database = suspicious_app.state.castor.database
        async with database.session() as session:
            job = await repo.get_job(session, uuid.UUID(str(scenario.job["id"])), for_update=True)
            assert job is not None
            (event,) = await repo.open_failures(session, job.id)
            request = event.details["replacement"]
            intent = {"replacing": "i-1", "terminate_at": "2026-11-30T00:00:00+00:00"}
            event.details = {**event.details, "replacement": {**request, "intent": intent}}
        body = {"instance_id": "i-1", "summary": {"local": {"1": 5}}}
        for _ in range(8):  # the leader judges every 0.2 s or so: many passes see the resumed heartbeats
            await scenario.post("/machines/1/heartbeat", body, 200)
            await asyncio.sleep(0.25)
        assert await machine_state(scenario, 1) == "failed"
        (event,) = await scenario.api("/failures")
        assert "reinstated" not in event["details"]
        assert event["details"]["replacement"]["status"] != "cancelled"


async def test_a_peer_failure_of_its_own_leaves_a_slow_suspect_suspect(client: httpx.AsyncClient) -> None:
    """A process that fails for a reason of its own (its ValueError, the OOM killer's SIGKILL) was not
    waiting on the silent machine: the silent machine stays suspect (on AWS it is not terminated), and the
    exit opens its own software failure. A collective failure after it is the second signal."""
    scenario = await two_machines(client)
    async with heartbeating(scenario, [0]):
        await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect")
        await scenario.kill_process(0, 1, {"type": "ValueError", "message": "ValueError: bad batch"})
        await scenario.kill_process(0, -9)
        assert await machine_state(scenario, 1) == "suspect"
        (event,) = await scenario.api("/failures")
        assert (event["kind"], event["rank"]) == ("software", 0)
        assert "ValueError: bad batch" in event["cause"]
        # The leader's pass judges the suspect against the open exits too: they stay its own.
        await asyncio.sleep(3 * HEARTBEAT_TIMEOUT_S)
        assert await machine_state(scenario, 1) == "suspect"

        await scenario.kill_process(0, 1, GLOO_RESET)
        assert await machine_state(scenario, 1) == "failed"
        causes = sorted((e["kind"], e["rank"]) for e in await scenario.api("/failures"))
        assert causes == [("hardware", 1), ("software", 0)], "the ValueError stays a failure of its own"


async def _replacement_status(scenario: Scenario, status: str) -> bool:
    failures = await scenario.api("/failures")
    return bool(failures) and failures[0]["details"].get("replacement", {}).get("status") == status


async def test_a_suspect_whose_heartbeats_resume_is_healthy_again_and_nothing_is_recovered(
    client: httpx.AsyncClient, suspicious_app: FastAPI
) -> None:
    scenario = await two_machines(client)
    orchestrator = suspicious_app.state.castor.orchestrator
    reinstated = orchestrator.reinstated
    async with heartbeating(scenario, [0]):
        await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect")
        async with heartbeating(scenario, [1]):
            await eventually(lambda: in_state(scenario, 1, "healthy"), "machine 1 to be reinstated")
        assert orchestrator.reinstated > reinstated
        assert await scenario.api("/failures") == []
        assert (await scenario.api(""))["state"] == "running"


async def test_a_suspect_without_a_second_signal_is_lost_after_the_grace(
    client: httpx.AsyncClient, suspicious_app: FastAPI
) -> None:
    scenario = await two_machines(client)
    async with heartbeating(scenario, [0]):
        await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect")
        assert await scenario.api("/failures") == []
        suspicious_app.state.castor.settings.suspect_grace_s = 0.5
        await eventually(lambda: in_state(scenario, 1, "failed"), "machine 1 to be declared lost")
        (event,) = await scenario.api("/failures")
        assert event["kind"] == "hardware" and "without a sign of life" in event["cause"]
        await scenario.plan(2, "collecting")


async def test_machines_silent_en_masse_are_not_declared_lost_on_the_grace_alone(
    client: httpx.AsyncClient, suspicious_app: FastAPI
) -> None:
    """3 of 4 machines silent at once (the default share, 25 %, and at least 3): the root suspects itself
    or etcd rather than the machines and declares none lost on silence, says so on /metrics, and still
    takes a second signal; once fewer are silent, the grace applies again."""
    scenario = Scenario(client, await create_job(client, machines=4, replicas=2))
    await scenario.register(["i-0", "i-1", "i-2", "i-3"])
    await scenario.heartbeat(5)
    async with heartbeating(scenario, [0]):
        for rank in (1, 2, 3):
            await eventually(lambda r=rank: in_state(scenario, r, "suspect"), f"machine {rank} to be suspect")
        # The short grace only once all three are suspect: machine 1 can lapse a pass before machine 3 (the
        # scenario's heartbeats went one after another), and alone past a short grace it is declared lost.
        suspicious_app.state.castor.settings.suspect_grace_s = 0.5
        await asyncio.sleep(3 * HEARTBEAT_TIMEOUT_S)  # well past the grace, several leader passes
        assert [await machine_state(scenario, rank) for rank in (1, 2, 3)] == ["suspect"] * 3
        assert await scenario.api("/failures") == []
        assert "castor_jobs_silent_en_masse 1.0" in (await client.get("/metrics")).text

        # A second signal still declares one lost: a collective failure on machine 0 explains the longest
        # silent (machine 1: the scenario's heartbeats went in rank order).
        await scenario.kill_process(0, 1, GLOO_RESET)
        assert [await machine_state(scenario, rank) for rank in (1, 2, 3)] == ["failed", "suspect", "suspect"]

        # Machine 2 comes back: one silent machine is believable again, and the grace declares it lost.
        async with heartbeating(scenario, [2]):
            await eventually(lambda: in_state(scenario, 3, "failed"), "the grace to apply again")
            assert await _metric_is(client, "castor_jobs_silent_en_masse", 0.0)


async def _metric_is(client: httpx.AsyncClient, name: str, value: float) -> bool:
    return f"{name} {value}" in (await client.get("/metrics")).text


async def test_a_reinstated_machine_that_goes_silent_again_is_lost_again_and_stays_lost(
    client: httpx.AsyncClient, suspicious_app: FastAPI
) -> None:
    """Lost, reinstated by a late heartbeat (its failure stays open, the recovery goes on), then really
    gone: the second loss must hold. The reinstatement check once looked at the machine's oldest open
    failure, whose classification precedes that late heartbeat, and reinstated every later loss within a
    second (found by benchmarks/scale.py: a lost machine cycling suspect, lost, reinstated for minutes)."""
    scenario = await two_machines(client)
    orchestrator = suspicious_app.state.castor.orchestrator
    async with heartbeating(scenario, [0]):
        await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect")
        suspicious_app.state.castor.settings.suspect_grace_s = 0.5
        await eventually(lambda: in_state(scenario, 1, "failed"), "machine 1 to be declared lost")
        body = {"instance_id": "i-1", "summary": {"local": {"1": 5}}}
        await scenario.post("/machines/1/heartbeat", body, 200)  # late: it was alive after all
        await eventually(lambda: in_state(scenario, 1, "healthy"), "machine 1 to be reinstated")
        reinstated = orchestrator.reinstated

        # Now it is gone for good: silent past the timeout, then past the grace.
        await eventually(lambda: in_state(scenario, 1, "failed"), "machine 1 to be declared lost again")
        lost_again = [
            e for e in await scenario.api("/failures") if e["rank"] == 1 and e["kind"] == "hardware"
        ]
        assert len(lost_again) == 2, "a failure of its own for the second loss"
        # The leader judges every 0.2 s or so: ten passes later, nothing reinstated it.
        await asyncio.sleep(2.0)
        assert await machine_state(scenario, 1) == "failed"
        assert orchestrator.reinstated == reinstated
        newest = max(lost_again, key=lambda e: e["detected_at"])
        assert "reinstated" not in newest["details"]


async def test_one_job_whose_step_raises_does_not_stop_the_recovery_of_another(
    client: httpx.AsyncClient, suspicious_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = await two_machines(client)  # created first: the leader reaches it first
    healthy = await two_machines(client)
    original = recovery.advance

    async def advance(
        session: Any, job: Any, settings: Settings, **seen: Any
    ) -> list[recovery.ReplaceMachine]:
        if str(job.id) == broken.id:
            raise RuntimeError("a bug that only this job's data triggers")
        return await original(session, job, settings, **seen)

    monkeypatch.setattr(recovery, "advance", advance)
    orchestrator = suspicious_app.state.castor.orchestrator
    failures = orchestrator.step_failures
    async with heartbeating(broken, [0, 1]), heartbeating(healthy, [0, 1]):
        await broken.kill_process(1)
        await healthy.kill_process(1)
        await healthy.plan(2, "collecting")  # the other job's recovery opened all the same
    assert orchestrator.step_failures > failures, "the broken job's failures are counted"
    metrics = (await client.get("/metrics")).text
    counted = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if not sample.labels
    }
    assert counted["castor_orchestration_step_failures_total"] > 0, "and exported"
    assert (await broken.api(""))["state"] == "running", "its step never got through"


@pytest.fixture(scope="module")
async def etcd_app(
    postgres_server: harness.Postgres, etcd_server: harness.Etcd, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[FastAPI]:
    settings = Settings(
        database_url=postgres_server.create_database(f"susp_etcd_{uuid.uuid4().hex[:8]}"),
        admin_token=ADMIN_TOKEN,
        state_dir=tmp_path_factory.mktemp("susp-etcd-state"),
        etcd_endpoints=[etcd_server.endpoint],
        etcd_prefix=f"/susp-{uuid.uuid4().hex[:8]}",
        lease_ttl_s=1,
        suspect_grace_s=LONG_GRACE_S,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


async def test_etcd_a_machine_whose_lease_expires_is_suspect_and_reinstated_when_its_key_returns(
    etcd_app: FastAPI, etcd_server: harness.Etcd
) -> None:
    settings = etcd_app.state.castor.settings
    async with fresh_client(etcd_app) as client:
        scenario = await two_machines(client)
        job = uuid.UUID(scenario.id)

        def heartbeats(rank: int) -> asyncio.Task[None]:
            key = machine_key(settings.etcd_prefix, job, rank, scenario.instances[rank])
            return asyncio.create_task(
                etcd_heartbeats([etcd_server.endpoint], key, 1, 0.3, lambda: {"local": {str(rank): 5}})
            )

        alive = [heartbeats(0), heartbeats(1)]
        try:
            await eventually(lambda: _is_leader(etcd_app), "the root to lead")
            alive[1].cancel()  # machine 1's lease is no longer refreshed: it expires
            await eventually(lambda: in_state(scenario, 1, "suspect"), "machine 1 to be suspect", within=30)
            assert await scenario.api("/failures") == [], "a lease expiry alone declares nothing"
            alive[1] = heartbeats(1)  # its agent reaches etcd again: a new lease, the key is back
            await eventually(
                lambda: in_state(scenario, 1, "healthy"), "machine 1 to be reinstated", within=30
            )
            assert await scenario.api("/failures") == []
        finally:
            for task in alive:
                task.cancel()
            await asyncio.gather(*alive, return_exceptions=True)


async def _is_leader(app: FastAPI) -> bool:
    """Leading with the epoch the database holds (emptying the tables deposed the previous one)."""
    orchestrator = app.state.castor.orchestrator
    async with app.state.castor.database.session() as session:
        epoch = (await session.execute(select(LeaderEpoch.epoch))).scalar_one_or_none()
    return bool(orchestrator.is_leader and epoch is not None and orchestrator.epoch == epoch)
