"""Engine and session factory for Postgres (production) and SQLite (embedded default)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session

from services.root.tasks import stop_after_commit

log = logging.getLogger(__name__)


# A commit that changed a job's directive (mark_changed) is announced to every replica of the root on one
# Postgres: NOTIFY is transactional, so listeners hear of it once it committed and never of one rolled back.
# The payload is the job's id, the announcing process's token (a process hears its own commits sooner,
# from SQLAlchemy's after_commit) and whether the long polls must wake (1: the revision moved; 0: only the
# content, e.g. an address, which the next read must show). SQLite (embedded mode) has one process: no
# channel.
CHANGES_CHANNEL = "castor_changes"
_TOKEN = uuid.uuid4().hex[:12]


def origin() -> str:
    """This process's name on the channel (its pid too: a process forked after import is another one)."""
    return f"{os.getpid()}.{_TOKEN}"


CHANGED_JOBS = "changed_jobs"
LISTEN_RETRY_S = (0.5, 1.0, 2.0, 5.0)
LISTEN_CHECK_S, LISTEN_CHECK_TIMEOUT_S = 15.0, 5.0


def mark_changed(session: AsyncSession, job_id: uuid.UUID, *, wake: bool = True) -> None:
    """Note that this transaction changes the job's directive: once it commits, every copy of it is stale
    and (`wake`: its revision moved) the job's long polls wake, in this process (services.root.flows.
    directives) and, on Postgres, in every other replica (NOTIFY)."""
    changed: dict[uuid.UUID, bool] = session.info.setdefault(CHANGED_JOBS, {})
    changed[job_id] = changed.get(job_id, False) or wake


def changed_jobs(sync_session: Session, *, pop: bool = False) -> dict[uuid.UUID, bool]:
    """The jobs whose directive the session's transaction changed, each with whether to wake long polls."""
    info = sync_session.info
    return dict((info.pop(CHANGED_JOBS, None) if pop else info.get(CHANGED_JOBS)) or {})


@event.listens_for(Session, "before_commit")
def _announce_changes(sync_session: Session) -> None:
    changed = changed_jobs(sync_session)
    if not changed or sync_session.get_bind().dialect.name != "postgresql":
        return
    for job_id, wake in sorted(changed.items(), key=lambda item: str(item[0])):
        sync_session.execute(
            text("SELECT pg_notify(:channel, :payload)"),
            {"channel": CHANGES_CHANNEL, "payload": f"{job_id} {origin()} {int(wake)}"},
        )


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
            # No pre-ping: asyncpg's is three round trips (BEGIN, a query, ROLLBACK) on every checkout, a
            # tenth of the root's event loop while a thousand agents report their inventories at once. A
            # pooled connection that died (Postgres restarted or failed over) fails its transaction
            # instead; SQLAlchemy then invalidates the whole pool, the request is answered 503 `retry`
            # (errors.py, which agents retry) and the next one connects afresh.
            # Thirty connections, all kept: overflow connections (above pool_size) are closed as they come
            # back, so a burst of reports beyond the pool's size connected afresh (asyncpg's handshake and
            # SQLAlchemy's per-connection setup) in 3-5 % of the root's event loop in a recovery at
            # 1,000 machines. Two replicas hold 60 of Postgres's default 100.
            options.update(pool_size=30, max_overflow=0)
        self.engine: AsyncEngine = create_async_engine(url, **options)
        if self.is_sqlite:
            _serialize_sqlite_writers(self.engine)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False, autoflush=False)
        self._listener: asyncio.Task[None] | None = None
        self._on_change: Callable[[uuid.UUID | None, bool], None] | None = None
        self.listening = False  # LISTEN is up: other replicas' changes are heard at once

    @asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """A session in a transaction: committed when the block succeeds, rolled back when it raises."""
        async with self._sessions() as session, session.begin():
            yield session

    @asynccontextmanager
    async def single_statement(self) -> AsyncIterator[AsyncConnection]:
        """A connection for a write that is one statement, atomic by itself: on Postgres in autocommit, one
        round trip where a transaction takes three (BEGIN, the statement, COMMIT). For the agents' reports,
        a thousand at once in a recovery: measured in process, 0.7-0.9 ms of the root's CPU per inventory
        report this way (with a prebuilt statement) against 2.1-2.3 ms through a session. On SQLite a
        transaction as usual (its writers are serialized at BEGIN), where a report may take two statements
        (see repository.mark_progress).
        """
        async with self.engine.connect() as connection:
            if self.is_sqlite:
                async with connection.begin():
                    yield connection
            else:
                yield await connection.execution_options(isolation_level="AUTOCOMMIT")

    def listen(self, on_change: Callable[[uuid.UUID | None, bool], None]) -> None:
        """Call `on_change(job_id, wake)` whenever another process commits a change to a job's directive
        (see mark_changed), and `on_change(None, True)` (anything may have changed) each time the LISTEN
        connection comes up, since what was committed while it was down went unheard. Postgres only;
        idempotent. `listening` says whether the connection is up now: while it is not, the caller re-reads
        the database on its own."""
        if self.is_sqlite or self._listener is not None:
            return
        self._on_change = on_change
        self._listener = asyncio.get_running_loop().create_task(self._listen(), name="castor-listen")

    async def _listen(self) -> None:
        import asyncpg  # the Postgres driver; absent from an embedded (SQLite) install

        _, options = self.engine.dialect.create_connect_args(self.engine.url)
        for key in ("prepared_statement_cache_size", "prepared_statement_name_func", "async_creator_fn"):
            options.pop(key, None)
        failures = 0
        while True:
            connection = None
            try:
                connection = await asyncpg.connect(**options)
                lost = _lost_event(connection)
                await connection.add_listener(CHANGES_CHANNEL, self._heard)
                self.listening, failures = True, 0
                if self._on_change is not None:
                    self._on_change(None, True)
                log.info("listening for directive changes on Postgres channel %s", CHANGES_CHANNEL)
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow the cancellation that
                # stops this loop at shutdown (clients/etcd.py, EtcdCoordinator.lead), and it would run on.
                while not lost.is_set():  # a connection silently gone (no FIN) fails the check
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(LISTEN_CHECK_S):
                            await lost.wait()
                    if not lost.is_set():
                        async with asyncio.timeout(LISTEN_CHECK_TIMEOUT_S):
                            await connection.execute("SELECT 1")
                log.warning("the LISTEN connection to Postgres closed; reconnecting")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("cannot LISTEN on Postgres (%s); directives fall back to re-reading", exc)
            finally:
                self.listening = False
                if connection is not None:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(5):
                            await connection.close()
            await asyncio.sleep(LISTEN_RETRY_S[min(failures, len(LISTEN_RETRY_S) - 1)])
            failures += 1

    def _heard(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        job, sender, wake = [*payload.split(" "), "", ""][:3]
        if sender == origin() or self._on_change is None:
            return  # this process's own commit: its after_commit has already told the caller
        try:
            job_id = uuid.UUID(job)
        except ValueError:
            return
        self._on_change(job_id, wake != "0")

    async def dispose(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
            self._listener = None
        await stop_after_commit(self.engine)
        await self.engine.dispose()


def _lost_event(connection: Any) -> asyncio.Event:
    """An event set when an asyncpg connection terminates."""
    lost = asyncio.Event()
    connection.add_termination_listener(lambda _connection: lost.set())
    return lost


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
