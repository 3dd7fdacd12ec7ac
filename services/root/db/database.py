"""Engine and session factory for Postgres (production) and SQLite (embedded default)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


class ChangeSignals:
    """Wakes long-polling agents in this process as soon as a job's directive changes (other replicas of
    the root notice through their polling of the database)."""

    def __init__(self) -> None:
        self._events: dict[uuid.UUID, asyncio.Event] = {}

    def wake(self, job_id: uuid.UUID) -> None:
        event = self._events.pop(job_id, None)
        if event is not None:
            event.set()

    async def wait(self, job_id: uuid.UUID, seconds: float) -> None:
        event = self._events.setdefault(job_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)


def mark_changed(session: AsyncSession, job_id: uuid.UUID) -> None:
    """Wake this job's long-polls once the session's transaction commits."""
    session.info.setdefault("changed_jobs", set()).add(job_id)


# Postgres aborts one of two transactions that wait on each other (deadlock_detected) or that cannot be
# serialized; SQLite gives up waiting for its single writer lock. Retrying the whole transaction is right.
_TRANSIENT_SQLSTATES = {"40P01", "40001"}


def is_transient_conflict(exc: BaseException) -> bool:
    """Whether a database error is a concurrency conflict that a retry of the transaction resolves."""
    if not isinstance(exc, DBAPIError):
        return False
    for error in (exc.orig, getattr(exc.orig, "__cause__", None)):
        if getattr(error, "sqlstate", None) in _TRANSIENT_SQLSTATES:
            return True
    return "database is locked" in str(exc.orig)


class Database:
    def __init__(self, url: str, *, echo: bool = False) -> None:
        self.url = url
        self.is_sqlite = make_url(url).get_backend_name() == "sqlite"
        options: dict[str, Any] = {"echo": echo}
        if not self.is_sqlite:
            options.update(pool_size=10, max_overflow=20, pool_pre_ping=True)
        self.engine: AsyncEngine = create_async_engine(url, **options)
        if self.is_sqlite:
            _serialize_sqlite_writers(self.engine)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False, autoflush=False)
        self.signals = ChangeSignals()

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session in a transaction: committed when the block succeeds, rolled back when it raises."""
        async with self._sessions() as session:
            async with session.begin():
                yield session
            for job_id in session.info.pop("changed_jobs", ()):
                self.signals.wake(job_id)

    async def dispose(self) -> None:
        await self.engine.dispose()


def _serialize_sqlite_writers(engine: AsyncEngine) -> None:
    """SQLite allows one writer. Python's driver starts transactions lazily (BEGIN DEFERRED), so two
    read-then-write transactions can deadlock into "database is locked". Take the write lock at BEGIN
    (BEGIN IMMEDIATE) and wait for it, which makes every transaction serializable, like SELECT ... FOR
    UPDATE on Postgres. The embedded mode's load (a few machines) makes that cheap."""

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")
