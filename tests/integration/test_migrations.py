"""Migrations: up, down, up again; models and migrations agree; two replicas migrating at once."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from services.root.db import migrate
from services.root.db.models import Base
from tests import harness

TABLES = {
    "jobs",
    "machines",
    "placement_groups",
    "failure_events",
    "recovery_plans",
    "persisted_checkpoints",
    "persisted_shards",
    "web_sessions",
    "leader_epoch",
    "alembic_version",
}


@pytest.fixture(params=["postgres", "sqlite"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        server: harness.Postgres = request.getfixturevalue("postgres_server")
        return server.create_database(f"mig_{uuid.uuid4().hex[:8]}")
    return f"sqlite+aiosqlite:///{tmp_path / 'castor.db'}"


async def _tables(url: str) -> set[str]:
    engine = create_async_engine(url)
    async with engine.connect() as connection:
        names = await connection.run_sync(lambda c: set(inspect(c).get_table_names()))
    await engine.dispose()
    return names


def _diff(connection: Connection) -> list[object]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


async def test_upgrade_downgrade_upgrade(fresh_url: str) -> None:
    migrate.upgrade(fresh_url)
    assert await _tables(fresh_url) == TABLES
    migrate.downgrade(fresh_url, "base")
    assert await _tables(fresh_url) <= {"alembic_version"}
    migrate.upgrade(fresh_url)
    assert await _tables(fresh_url) == TABLES


async def test_models_and_migrations_agree(fresh_url: str) -> None:
    migrate.upgrade(fresh_url)
    engine = create_async_engine(fresh_url)
    async with engine.connect() as connection:
        diff = await connection.run_sync(_diff)
    await engine.dispose()
    assert diff == [], f"autogenerate found differences; add a migration: {diff}"


def test_two_replicas_migrating_at_once(fresh_url: str) -> None:
    code = "import sys; from services.root.db import migrate; migrate.upgrade(sys.argv[1])"
    replicas = [
        subprocess.Popen([sys.executable, "-c", code, fresh_url], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in replicas]
    assert all(rc == 0 for rc, _ in results), [err[-2000:] for rc, err in results if rc]
    migrate.upgrade(fresh_url)  # still at head, nothing to do
