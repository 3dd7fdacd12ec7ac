"""Alembic environment: async engine, works on Postgres (asyncpg) and SQLite (aiosqlite)."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from services.root.db.models import Base

# Any constant works; it only has to be the same in every replica.
MIGRATION_LOCK_KEY = 0x6361_7374_6F72  # "castor"

target_metadata = Base.metadata


def _configure(**options: object) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **options)  # type: ignore[arg-type]


def run_migrations_offline() -> None:
    _configure(url=context.config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_with_connection(connection: Connection) -> None:
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Serialize concurrent upgrades: the second replica waits here, then sees the new revision.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url is not None
    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_with_connection)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
