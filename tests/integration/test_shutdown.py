"""The root's shutdown stops every task it started before it closes the etcd client and disposes of the
database: a replica stopped while it campaigns, a leader with its workers (etcd's lease watch among them),
and the follow-ups that heartbeats' commits start. Before, a campaign cancelled with its loop kept running
(campaigning, and refreshing a lease it then won, on a reconnected etcd client, or polling Postgres for the
advisory lock), and a commit's follow-up used the disposed engine after the app stopped.

Each scenario runs in a process of its own, as a root does: the suite's tests share one event loop per
worker, where other tests' apps start tasks of their own at any time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.root.app import create_app
from services.root.flows.machines import COUNTERS_INLINE_MAX_MACHINES
from services.root.settings import Settings
from tests import harness
from tests.integration.conftest import ADMIN_TOKEN, create_job
from tests.integration.web.scenario import Scenario, eventually

REPO = Path(__file__).resolve().parents[2]


def in_own_process(scenario: str, *arguments: str) -> dict[str, list[str]]:
    """`scenario` (a coroutine function of this module) run by asyncio.run in a new process; its result."""
    code = (
        "import asyncio, json, sys\n"
        "from tests.integration import test_shutdown\n"
        f"print(json.dumps(asyncio.run(test_shutdown.{scenario}(*sys.argv[1:]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *arguments], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


PROJECT_CODE = (str(REPO / "services"), str(REPO / "worker_lib"))


def unfinished_since(before: set[asyncio.Task[Any]]) -> list[str]:
    """The tasks running the project's code (not a library's, as grpc's calls in flight) that started since
    `before` was taken and have not finished."""
    started = asyncio.all_tasks() - before - {asyncio.current_task()}
    return sorted(task.get_name() for task in started if not task.done() and _of_project(task))


def _of_project(task: asyncio.Task[Any]) -> bool:
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and code.co_filename.startswith(PROJECT_CODE)


async def started(before: set[asyncio.Task[Any]], prefix: str) -> bool:
    """Whether a task whose name starts with `prefix` started since `before` and runs."""
    return any(name.startswith(prefix) for name in unfinished_since(before))


async def leads(app: FastAPI) -> bool:
    return bool(app.state.castor.orchestrator.is_leader)


@contextlib.asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[FastAPI]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


def settings_for(state: Path, database_url: str, **fields: Any) -> Settings:
    return Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        state_dir=state / f"state-{uuid.uuid4().hex[:8]}",
        heartbeat_timeout_s=3600,
        **fields,
    )


async def candidate_then_leader(state: str, database_url: str, etcd_endpoint: str) -> dict[str, list[str]]:
    """Two replicas on one database: the first leads, the second campaigns (for etcd's leader key where
    `etcd_endpoint` is given, else for Postgres's advisory lock) until it is stopped; then the leader stops,
    its workers running. What each left running."""
    fields: dict[str, Any] = {}
    if etcd_endpoint:
        fields = {"etcd_endpoints": [etcd_endpoint], "etcd_prefix": f"/shutdown-{uuid.uuid4().hex[:8]}"}
    before_leader = asyncio.all_tasks()
    async with running(settings_for(Path(state), database_url, **fields)) as leader:
        await eventually(lambda: leads(leader), "the first replica to lead")
        await eventually(lambda: started(before_leader, "drive"), "the leader's workers")
        if etcd_endpoint:
            await eventually(lambda: started(before_leader, "sweep"), "the lease watch's sweep")
        before_candidate = asyncio.all_tasks()
        async with running(settings_for(Path(state), database_url, **fields)) as candidate:
            await eventually(lambda: started(before_candidate, "campaign"), "the second replica's campaign")
            await asyncio.sleep(0.5)  # campaigning: a lost election (etcd), a lock poll or two (Postgres)
            assert not await leads(candidate)
        left_by_candidate = unfinished_since(before_candidate)
        assert await leads(leader), "the leader leads on"
    return {"candidate": left_by_candidate, "leader": unfinished_since(before_leader)}


async def heartbeat_then_stop(state: str) -> dict[str, list[str]]:
    """The embedded default (SQLite): a heartbeat of a job too large for inline counters starts their
    refresh after its commit (a task that first waits a second), and the app stops right after it."""
    database_url = f"sqlite+aiosqlite:///{Path(state) / 'castor.db'}"
    before = asyncio.all_tasks()
    async with running(settings_for(Path(state), database_url)) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://castor.test") as client:
            job = await create_job(client, machines=COUNTERS_INLINE_MAX_MACHINES + 1)
            scenario = Scenario(client, job)
            await scenario.register(["i-0"])
            await scenario.heartbeat(3)
            refreshing = [name for name in unfinished_since(before) if name == f"counters-{job['id']}"]
    return {"refreshing": refreshing, "left": unfinished_since(before)}


@pytest.mark.parametrize("coordination", ["etcd", "postgres"])
def test_a_replica_stopped_while_it_campaigns_and_then_the_leader_leave_no_task_running(
    coordination: str, tmp_path: Path, postgres_server: harness.Postgres, request: pytest.FixtureRequest
) -> None:
    database_url = postgres_server.create_database(f"shutdown_{uuid.uuid4().hex[:8]}")
    endpoint = request.getfixturevalue("etcd_server").endpoint if coordination == "etcd" else ""
    left = in_own_process("candidate_then_leader", str(tmp_path), database_url, endpoint)
    assert left == {"candidate": [], "leader": []}


def test_the_follow_ups_of_heartbeats_stop_with_the_app(tmp_path: Path) -> None:
    left = in_own_process("heartbeat_then_stop", str(tmp_path))
    assert len(left["refreshing"]) == 1, "the heartbeat started the counters' refresh"
    assert left["left"] == []
