"""Registrations off the job row (issue 13): while the job is pending a registration claims its rank with one
INSERT that the live-rank unique index admits once, locks nothing shared (it goes through while another
transaction holds the job row), and the job starts exactly once when the last ranks are claimed at once.
Displacing a failed machine and an agent's restart still take the job row (test_recovery_flow, test_worker).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select

from services.root.db.models import Job, Machine
from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register
from tests.integration.conftest import admin, bearer, create_job
from tests.integration.test_progress_reports import statements_of
from tests.integration.web.scenario import eventually


def locks(statement: str) -> bool:
    return "for update" in statement or "for no key update" in statement


async def revision(client: httpx.AsyncClient, job: dict[str, Any]) -> int:
    directive = await client.get(
        f"/api/v1/worker/jobs/{job['id']}/directive", headers=bearer(str(job["worker_token"]))
    )
    value: int = directive.json()["revision"]
    return value


async def test_registrations_go_through_while_the_job_row_is_locked(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    machines = 4
    job = await create_job(client, machines=machines, replicas=2)
    job_id = uuid.UUID(str(job["id"]))
    # What every writer of the job row takes (repository.get_job): FOR NO KEY UPDATE.
    lock = select(Job).where(Job.id == job_id).with_for_update(key_share=True)

    async def held() -> int:
        async with database.session() as session:
            query = select(func.count()).select_from(Machine).where(Machine.job_id == job_id)
            return int((await session.execute(query)).scalar_one())

    async with database.session() as session:
        await session.execute(lock)
        # Before: every registration took this lock first, and waited here until the holder committed.
        responses = await asyncio.wait_for(
            asyncio.gather(*(register(client, job, f"i-{n}") for n in range(machines - 1))), 30
        )
        assert [r.status_code for r in responses] == [200] * (machines - 1), [r.text for r in responses]
        claimed = {r.json()["rank"] for r in responses}
        # Registrations at once take distinct ranks, not always the lowest (one that lost a rank to
        # another takes any free one).
        assert len(claimed) == machines - 1 and claimed < set(range(machines)), claimed
        (free,) = set(range(machines)) - claimed
        # The last one claims its rank (committed, visible to others) and then starts the job, which
        # writes the job row: that waits for the lock.
        last = asyncio.create_task(register(client, job, "i-last"))
        await eventually(lambda: _at_least(held, machines), "the last rank claimed under the lock")
        state = await client.get(f"/api/v1/jobs/{job_id}", headers=admin())
        assert state.json()["state"] == "pending", "the job row is still locked"
    response = await asyncio.wait_for(last, 30)
    assert response.status_code == 200 and response.json()["rank"] == free, response.text
    state = await client.get(f"/api/v1/jobs/{job_id}", headers=admin())
    assert state.json()["state"] == "running" and state.json()["started_at"] is not None


async def _at_least(count: Any, n: int) -> bool:
    return bool(await count() >= n)


async def test_concurrent_registrations_start_the_job_once(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    machines = 16
    job = await create_job(client, machines=machines, replicas=2)
    before = await revision(client, job)
    instances = [f"i-{n}" for n in range(machines)]

    def registering(instance: str) -> Any:
        async def send() -> None:
            response = await register(client, job, instance)
            assert response.status_code == 200, response.text
            ranks[instance] = response.json()["rank"]

        return send

    ranks: dict[str, int] = {}
    statements = await statements_of(root_app, *(registering(i) for i in instances))
    assert sorted(ranks.values()) == list(range(machines)), "every machine its own rank"
    assert not [s for s in statements if locks(s)], "no registration waits for the job row's lock"
    plan_reads = [s for s in statements if "sources" in s]
    assert len(plan_reads) == 1, "the plan is read once: by the registration that starts the job"
    machines_page = (await client.get(f"/api/v1/jobs/{job['id']}/machines", headers=admin())).json()
    assert {(m["rank"], m["instance_id"]) for m in machines_page} == set(
        (rank, instance) for instance, rank in ranks.items()
    ), "one machine row per instance"
    state = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert state["state"] == "running" and state["machines_healthy"] == machines
    assert await revision(client, job) == before + 1, "the job started once: one new revision"
    directive = await client.get(
        f"/api/v1/worker/jobs/{job['id']}/directive", headers=bearer(str(job["worker_token"]))
    )
    assert directive.json()["status"] == "ready", "the first plan is released"
    assert directive.json()["rendezvous"]["master_port"] is None or directive.json()["rendezvous"]
    assert_error(await register(client, job, "i-late"), 409, "job_full")


async def test_a_requested_rank_contested_at_once_goes_to_one_instance(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=4, replicas=2)
    contenders = [f"i-{n}" for n in range(6)]
    responses = await asyncio.gather(*(register(client, job, i, rank=2) for i in contenders))
    won = [r for r in responses if r.status_code == 200]
    assert len(won) == 1 and won[0].json()["rank"] == 2, [r.text for r in responses]
    for lost in (r for r in responses if r.status_code != 200):
        assert_error(lost, 409, "rank_taken")
    winner = contenders[responses.index(won[0])]
    again = await register(client, job, winner, rank=2)
    assert again.status_code == 200 and again.json()["machine_id"] == won[0].json()["machine_id"]
    loser = next(i for i in contenders if i != winner)
    assert (await register(client, job, loser)).json()["rank"] == 0, "the lowest free rank"
