"""The root app on a real database: Postgres (from the harness) and the embedded SQLite default.

Every API test runs on both backends. The app starts once per backend (migrations applied by its
lifespan, as in production); each test starts from empty tables."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import delete
from sqlalchemy.exc import DBAPIError

from services.root.app import create_app
from services.root.db.database import Database, is_transient_conflict
from services.root.db.models import Base
from services.root.settings import Settings

ADMIN_TOKEN = "castor-admin.test-token"


@pytest.fixture(scope="session", params=["postgres", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return server.create_database(f"api_{uuid.uuid4().hex[:8]}")
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'castor.db'}"


@pytest.fixture(scope="session")
async def root_app(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FastAPI]:
    state_dir: Path = tmp_path_factory.mktemp("state")
    # No heartbeats in these tests: a long timeout keeps the failure detector out of them.
    settings = Settings(
        database_url=database_url, admin_token=ADMIN_TOKEN, state_dir=state_dir, heartbeat_timeout_s=3600
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield app


async def empty_tables(database: Database) -> None:
    # The leader may still be driving a recovery of the previous test's job; Postgres then aborts one of
    # the two transactions as a deadlock. Retry ours, as the orchestrator retries its own.
    for attempt in range(10):
        try:
            async with database.session() as session:
                for table in reversed(Base.metadata.sorted_tables):
                    # The leader's fencing epoch stays: without it the running leader is deposed and
                    # campaigns again, and a test could look while no replica leads.
                    if table.name != "leader_epoch":
                        await session.execute(delete(table))
            return
        except DBAPIError as exc:
            if not is_transient_conflict(exc) or attempt == 9:
                raise
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def fresh_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process client of `app` over empty tables."""
    await empty_tables(app.state.castor.database)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://castor.test") as http:
        yield http


@pytest.fixture
async def client(root_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with fresh_client(root_app) as http:
        yield http


def admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def create_job(client: httpx.AsyncClient, **fields: object) -> dict[str, object]:
    body = {"name": f"job-{uuid.uuid4().hex[:8]}", "machines": 4, **fields}
    response = await client.post("/api/v1/jobs", json=body, headers=admin())
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]
