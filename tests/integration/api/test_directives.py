"""The directive on Postgres and SQLite: one machine's share of it (`machine=`), and long polls woken by the
commit that changes it (in this process: after_commit; from another replica: Postgres NOTIFY), not by a
timer (services.root.flows.directives)."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from services.root.db.database import CHANGES_CHANNEL
from services.root.flows import directives
from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register
from tests.integration.conftest import bearer, create_job

# Bounds of the waits below: far under the long poll's own `wait`, far over a wake-up's latency.
WOKEN_WITHIN_S = 30.0
POLL_WAIT_S = 60


@pytest.fixture
def no_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """No re-read on a timer: a long poll that answers with a change was woken by it."""
    monkeypatch.setattr(directives, "RECHECK_S", 600.0)
    monkeypatch.setattr(directives, "RECHECK_UNHEARD_S", 600.0)


async def waiting(job: dict[str, object], polls: int) -> None:
    """Until `polls` long polls of the job wait for its next change (a change before would be read, not
    heard of)."""
    job_id = uuid.UUID(str(job["id"]))
    for _ in range(300):
        if len(directives._waiting.get(job_id, ())) >= polls:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{polls} long polls never waited")


async def test_a_machine_s_directive_names_itself_and_its_replicas_holders(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=4, replicas=2, procs_per_machine=2)
    token = bearer(str(job["worker_token"]))
    url = f"/api/v1/worker/jobs/{job['id']}/directive"
    for rank in range(4):
        assert (await register(client, job, f"i-{rank}", address=f"10.0.0.{rank}")).status_code == 200
    whole = (await client.get(url, headers=token)).json()
    assert whole["machine"] is None and [m["rank"] for m in whole["machines"]] == [0, 1, 2, 3]
    mine = (await client.get(url, params={"machine": 2}, headers=token)).json()
    assert mine["machine"] == 2
    assert [(m["rank"], m["address"]) for m in mine["machines"]] == [(2, "10.0.0.2"), (3, "10.0.0.3")]
    assert all(source["rank"] in (4, 5) for source in mine["sources"])
    same = {"revision", "status", "generation", "iteration", "world_size", "rendezvous", "persist"}
    assert {key: mine[key] for key in same} == {key: whole[key] for key in same}
    assert_error(await client.get(url, params={"machine": 4}, headers=token), 422, "rank_out_of_range")


async def test_a_long_poll_wakes_on_the_commit_that_changes_the_directive(
    client: httpx.AsyncClient, no_recheck: None
) -> None:
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    url = f"/api/v1/worker/jobs/{job['id']}/directive"
    await register(client, job, "i-0", rendezvous_port=29500)
    first = (await client.get(url, params={"machine": 0}, headers=token)).json()
    polls = [
        asyncio.create_task(
            client.get(
                url, params={"after": first["revision"], "wait": POLL_WAIT_S, "machine": m}, headers=token
            )
        )
        for m in (0, 1)
    ]
    await waiting(job, 2)
    await register(client, job, "i-1", address="10.0.0.2")  # the last machine: the start is released
    answers = [(await asyncio.wait_for(poll, WOKEN_WITHIN_S)).json() for poll in polls]
    assert [(a["machine"], a["status"]) for a in answers] == [(0, "ready"), (1, "ready")]
    assert all(a["revision"] > first["revision"] for a in answers)


async def test_another_replica_s_change_wakes_the_long_poll_through_notify(
    client: httpx.AsyncClient, root_app: FastAPI, no_recheck: None
) -> None:
    """Another replica's commit is not this process's: its NOTIFY is what wakes the long poll."""
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("one process on SQLite: no other replica")
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    url = f"/api/v1/worker/jobs/{job['id']}/directive"
    await register(client, job, "i-0")
    first = (await client.get(url, params={"machine": 0}, headers=token)).json()  # starts the listener
    for _ in range(200):
        if database.listening:
            break
        await asyncio.sleep(0.1)
    assert database.listening, "the root LISTENs for other replicas' changes"
    poll = asyncio.create_task(
        client.get(url, params={"after": first["revision"], "wait": POLL_WAIT_S, "machine": 0}, headers=token)
    )
    await waiting(job, 1)
    _, options = database.engine.dialect.create_connect_args(database.engine.url)
    options.pop("prepared_statement_cache_size", None)
    other = await asyncpg.connect(**options)  # "another replica": a commit this process never sees
    try:
        async with other.transaction():
            await other.execute(
                "UPDATE jobs SET directive_revision = directive_revision + 1 WHERE id = $1",
                uuid.UUID(job["id"]),
            )
            await other.execute("SELECT pg_notify($1, $2)", CHANGES_CHANNEL, f"{job['id']} another-replica")
    finally:
        await other.close()
    answer = (await asyncio.wait_for(poll, WOKEN_WITHIN_S)).json()
    assert answer["revision"] == first["revision"] + 1
