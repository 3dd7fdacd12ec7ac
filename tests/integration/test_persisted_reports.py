"""Persisted-shard reports off the job row (issue 13): a report writes its own shard's row and locks nothing
shared (it goes through while another transaction holds the job row); the report that finds every rank's
shard in takes the lock to complete the checkpoint, and retention still expires what it drops."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Select, delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.root.db import repository as repo
from services.root.db.models import Job, PersistedCheckpoint
from tests.integration.api.test_worker import register, report_persisted
from tests.integration.conftest import admin, create_job
from tests.integration.test_progress_reports import statements_of
from tests.integration.test_registrations import locks

MACHINES = 4


async def registered(client: httpx.AsyncClient) -> dict[str, object]:
    job = await create_job(client, machines=MACHINES, replicas=2, keep_persisted=1)
    for rank in range(MACHINES):
        assert (await register(client, job, f"i-{rank}", rank=rank)).status_code == 200
    return job


async def checkpoints(client: httpx.AsyncClient, job: dict[str, object]) -> list[tuple[int, int]]:
    found = (await client.get(f"/api/v1/jobs/{job['id']}/checkpoints", headers=admin())).json()
    return [(c["iteration"], len(c["shards"])) for c in found]


async def test_shard_reports_go_through_while_the_job_row_is_locked(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    job = await registered(client)
    for rank in range(MACHINES):
        await report_persisted(client, job, rank, 5, 1, f"five{rank}")
    assert await checkpoints(client, job) == [(5, MACHINES)]
    lock = select(Job).where(Job.id == uuid.UUID(str(job["id"]))).with_for_update(key_share=True)
    async with database.session() as session:
        await session.execute(lock)
        # Before: every report took this lock first, and waited here until the holder committed.
        for rank in range(MACHINES - 1):
            await asyncio.wait_for(report_persisted(client, job, rank, 10, 1, f"ten{rank}"), 30)
    await report_persisted(client, job, MACHINES - 1, 10, 1, f"ten{MACHINES - 1}")
    assert await checkpoints(client, job) == [(10, MACHINES)], "10 complete: 5 expired (keep 1)"


async def test_reports_at_once_complete_the_checkpoint(client: httpx.AsyncClient, root_app: FastAPI) -> None:
    job = await registered(client)
    statements = await statements_of(
        root_app,
        *(lambda r=rank: report_persisted(client, job, r, 10, 1, f"ten{r}") for rank in range(MACHINES)),
    )
    writes = [s for s in statements if s.startswith(("update", "insert", "delete"))]
    assert not [s for s in writes if s.startswith("update jobs")], "no announcement: none was made"
    assert not [s for s in statements if "sources" in s], "the plan's per-rank sources stay unread"
    if not root_app.state.castor.database.is_sqlite:
        # At least the report that committed last counts every shard and takes the lock (each report counts
        # after its own commit; more than one may, when they commit before any counts).
        assert len([s for s in statements if locks(s)]) >= 1, "no report completed the checkpoint"
    assert await checkpoints(client, job) == [(10, MACHINES)]
    # A retry of a report changes nothing (a late upload from before a rollback: test_worker).
    await report_persisted(client, job, 1, 10, 1, "ten1")
    found = (await client.get(f"/api/v1/jobs/{job['id']}/checkpoints", headers=admin())).json()
    assert [(s["rank"], s["digest"]) for s in found[0]["shards"]] == [(r, f"ten{r}") for r in range(MACHINES)]


class _ExpiresBeforeTheLookup:
    """A session whose persisted checkpoint is deleted (another report's expiry, committed) right before
    persisted_checkpoint_id looks up the row its insert conflicted with."""

    def __init__(self, session: AsyncSession, expire: Callable[[], Awaitable[None]]) -> None:
        self._session, self._expire = session, expire
        self.bind = session.bind
        self.expired = False

    async def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(statement, Select) and not self.expired:
            self.expired = True
            await self._expire()
        return await self._session.execute(statement, *args, **kwargs)


async def test_a_checkpoint_expired_between_its_insert_and_its_lookup_is_recorded_anew(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """Before, the lookup found nothing and the report failed with a 500 (NoResultFound)."""
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite serializes writers: no deletion can land between the two statements")
    job_id = uuid.UUID(str((await registered(client))["id"]))
    async with database.session() as session:
        first = await repo.persisted_checkpoint_id(session, job_id, 10, "s3://b/ten")

    async def expire() -> None:
        async with database.session() as other:
            await other.execute(delete(PersistedCheckpoint).where(PersistedCheckpoint.id == first))

    async with database.session() as session:
        racing = _ExpiresBeforeTheLookup(session, expire)
        found = await repo.persisted_checkpoint_id(racing, job_id, 10, "s3://b/ten")  # type: ignore[arg-type]
        assert racing.expired
    async with database.session() as session:
        query = select(PersistedCheckpoint.id).where(PersistedCheckpoint.job_id == job_id)
        rows = (await session.execute(query)).scalars().all()
    assert found != first and list(rows) == [found]
