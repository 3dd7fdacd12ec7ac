"""Migrations: up, down, up again; models and migrations agree; two replicas migrating at once."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from services.root.db import migrate
from services.root.db.models import Base, FailureEvent, Job, RankProgress, RecoveryPlan
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
    "rank_progress",
    "metric_totals",
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


async def test_progress_notes_move_to_rows_and_back(fresh_url: str) -> None:
    """0008 moves the recovery progress notes from the failure events' details into rank_progress rows
    (the newest event's note winning, as an event moved along from a superseded plan kept that plan's),
    and its downgrade puts them back."""
    migrate.upgrade(fresh_url, "0007_persist_schedule")
    engine = create_async_engine(fresh_url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    job_id = uuid.uuid4()
    early, late = "2026-11-20T10:00:01+00:00", "2026-11-20T10:00:05+00:00"
    async with sessions() as session, session.begin():
        session.add(
            Job(
                id=job_id,
                name="upgraded",
                num_machines=2,
                replicas=2,
                procs_per_machine=1,
                persist_every=0,
                keep_persisted=1,
                placement_strategy="group",
                recovery_probabilities={},
                worker_token_hash="0" * 64,
            )
        )
        await session.flush()
        plan = RecoveryPlan(job_id=job_id, generation=3, iteration=7, status="ready", sources=[])
        session.add(plan)
        await session.flush()
        stale = {"restored_reported_at": {"0": early, "1": early}, "restore": {"1": {"1": {"seconds": 9}}}}
        fresh = {
            "restored_reported_at": {"0": late},
            "resumed_reported_at": {"0": late},
            "restore": {"0": {"0": {"tier": "local", "seconds": 0.5}}},
        }
        for details in ({**stale, "instance_id": "i-1"}, {**fresh, "plan_generation": 3}):
            session.add(
                FailureEvent(job_id=job_id, cause="a crash", plan_id=plan.id, details=details, rank=0)
            )
        session.add(FailureEvent(job_id=job_id, cause="no plan", details={"restore": {"0": {}}}))
    await engine.dispose()

    migrate.upgrade(fresh_url)
    engine = create_async_engine(fresh_url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    async with sessions() as session:
        rows = (await session.execute(select(RankProgress).order_by(RankProgress.rank))).scalars().all()
        events = (await session.execute(select(FailureEvent).order_by(FailureEvent.id))).scalars().all()
    await engine.dispose()
    got = [(r.job_id, r.generation, r.rank, r.restored_at, r.resumed_at, r.restore) for r in rows]
    at = datetime.fromisoformat
    assert got == [
        (job_id, 3, 0, at(late), at(late), {"0": {"tier": "local", "seconds": 0.5}}),
        (job_id, 3, 1, at(early), None, {"1": {"seconds": 9}}),
    ]
    assert [e.details for e in events] == [
        {"instance_id": "i-1"},
        {"plan_generation": 3},
        {"restore": {"0": {}}},
    ]

    migrate.downgrade(fresh_url, "0007_persist_schedule")
    engine = create_async_engine(fresh_url)
    async with engine.connect() as connection:
        details = (await connection.execute(text("SELECT details FROM failure_events ORDER BY id"))).scalars()
        back = [d if isinstance(d, dict) else json.loads(d) for d in details]
    await engine.dispose()
    notes = {
        "restored_reported_at": {"0": at(late).isoformat(), "1": at(early).isoformat()},
        "resumed_reported_at": {"0": at(late).isoformat()},
        "restore": {"0": {"0": {"tier": "local", "seconds": 0.5}}, "1": {"1": {"seconds": 9}}},
    }
    assert back == [{"instance_id": "i-1", **notes}, {"plan_generation": 3, **notes}, {"restore": {"0": {}}}]
