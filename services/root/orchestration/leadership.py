"""Leadership of the root replicas, and the fencing of a deposed leader.

With etcd, root replicas campaign for a leader key (clients.etcd); without etcd, on Postgres, for a
session-level advisory lock; on SQLite the single process leads. A new leader raises the fencing epoch
(models.LeaderEpoch) and every orchestrator transaction (`Leadership.session`) reads it first (FOR SHARE, so
the raise waits for transactions in flight): a deposed leader's writes are refused, whatever it believes.
With etcd a leader also stops acting when its lease deadline passes by its own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

from sqlalchemy import select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from services.root.clients.etcd import EtcdCoordinator
from services.root.db.database import Database
from services.root.db.models import LeaderEpoch, utcnow
from services.root.settings import Settings

log = logging.getLogger(__name__)

# Postgres without etcd: the advisory lock whose session holds the leadership (per database). Not the
# migrations' key ("castor", migrations/env.py): sharing it, a replica starting while another led waited
# for its migrations behind the leader's lock forever.
ADVISORY_LOCK_KEY = 0x63617374_6F724C44  # "castorLD"
ADVISORY_CHECK_S = 1.0
# How long a new leader waits for the transactions in flight that hold the epoch row (milliseconds when
# their leader is alive) before it ends their sessions (claim_epoch).
EPOCH_LOCK_WAIT_S = 5.0
LOCK_NOT_AVAILABLE = "55P03"  # Postgres's SQLSTATE for a lock_timeout that expired


def _sqlstate(exc: DBAPIError) -> str | None:
    for error in (exc.orig, getattr(exc.orig, "__cause__", None)):
        if (state := getattr(error, "sqlstate", None)) is not None:
            return str(state)
    return None


class Deposed(Exception):
    """This replica is no longer the leader: another raised the epoch, or its lease deadline passed."""


class Leadership:
    """This replica's claim to lead: the campaign, the fencing epoch and the fenced transactions."""

    def __init__(self, database: Database, settings: Settings, coordinator: EtcdCoordinator | None):
        self.database = database
        self.coordinator = coordinator
        self.candidate = f"{socket.gethostname()}:{settings.port}:{os.getpid()}"
        self.is_leader = False
        self.leader_since = 0.0
        self.epoch: int | None = None  # the fencing epoch this replica leads with
        self.deposed = asyncio.Event()

    def took_office(self, lost: asyncio.Event) -> None:
        """Elected and the epoch raised: `lost` is set when the leadership ends (by the campaign or a
        refused transaction)."""
        self.deposed = lost
        self.is_leader, self.leader_since = True, time.monotonic()

    def left_office(self) -> None:
        self.is_leader, self.epoch = False, None

    async def campaign(self, elected: asyncio.Event, lost: asyncio.Event) -> None:
        if self.coordinator is not None:
            await self.coordinator.lead(self.candidate, elected, lost)
        elif not self.database.is_sqlite:
            await self._advisory_lead(elected, lost)
        else:
            elected.set()  # SQLite: one process uses the file; it leads
            await asyncio.Event().wait()

    async def _advisory_lead(self, elected: asyncio.Event, lost: asyncio.Event) -> None:
        """Postgres without etcd: the replica whose session holds the advisory lock leads; every other
        replica (or uvicorn worker) waits for it. The lock goes with its session: a leader whose connection
        breaks loses it at once on the server, and here at its next check (the epoch fences it meanwhile)."""
        connection = await self.database.engine.connect()
        try:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            query = text("SELECT pg_try_advisory_lock(:key)")
            while True:  # polling: Postgres cannot tell us when the lock frees without blocking the session
                if (await connection.execute(query, {"key": ADVISORY_LOCK_KEY})).scalar():
                    break
                await asyncio.sleep(ADVISORY_CHECK_S)
            log.info("elected leader (%s): holding the database's advisory lock", self.candidate)
            elected.set()
            while not lost.is_set():  # a deposition steps down here even if a cancellation went missing
                await asyncio.sleep(ADVISORY_CHECK_S)
                # asyncio.timeout, not wait_for, which on Python 3.11 can swallow the cancellation that
                # ends this loop (clients/etcd.py, EtcdCoordinator.lead).
                async with asyncio.timeout(5.0):
                    await connection.execute(text("SELECT 1"))
            log.warning("deposed: stepping down and releasing the advisory lock")
        except (OSError, TimeoutError, Exception) as exc:  # whatever broke the session, the lock is gone
            log.error("lost the database session holding the leadership: %s", exc)
        finally:
            lost.set()
            # Closing would return the connection to the pool with the lock still held: drop it instead.
            with contextlib.suppress(Exception):
                await connection.invalidate()
            with contextlib.suppress(Exception):
                await connection.close()

    async def claim_epoch(self, revision: int | None) -> None:
        """Raise the fencing epoch (to the etcd revision that elected this replica, or one past the last):
        from now on the previous leader's transactions are refused. Waits for those in flight, up to
        EPOCH_LOCK_WAIT_S: a transaction that holds the epoch row longer is a previous leader's whose host
        died or froze mid-transaction. Postgres would keep its session (and the row's lock) until TCP
        keepalive gives up on it, two hours by Linux's defaults, and no replica could lead meanwhile; its
        session is ended instead, which is the fencing that transaction was waiting for."""
        for _ in range(5):
            try:
                async with self.database.session() as session:
                    if not self.database.is_sqlite:
                        await session.execute(
                            text(f"SET LOCAL lock_timeout = {int(EPOCH_LOCK_WAIT_S * 1000)}")
                        )
                    query = select(LeaderEpoch).where(LeaderEpoch.id == 1).with_for_update()
                    row = (await session.execute(query)).scalar_one_or_none()
                    if row is None:
                        row = LeaderEpoch(id=1, epoch=0, holder="")
                        session.add(row)
                    epoch = max(row.epoch + 1, revision or 0)
                    row.epoch, row.holder, row.updated_at = epoch, self.candidate, utcnow()
            except IntegrityError:
                continue  # another replica created the row at the same moment
            except DBAPIError as exc:
                if _sqlstate(exc) != LOCK_NOT_AVAILABLE:
                    raise
                await self._end_sessions_holding_the_epoch()
                continue
            self.epoch = epoch
            log.info("leading with epoch %d", epoch)
            return
        raise RuntimeError("could not claim the leadership epoch")

    async def _end_sessions_holding_the_epoch(self) -> None:
        """End the other sessions whose transactions hold the epoch row (only a leader's fenced transactions
        take it), so that the epoch can be raised."""
        query = text(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_locks "
            "WHERE relation = 'leader_epoch'::regclass AND granted AND pid <> pg_backend_pid()"
        )
        async with self.database.engine.connect() as connection:
            ended = [row.pid for row in await connection.execute(query)]
        log.warning(
            "a previous leader's transaction held the leadership epoch for over %.0f s (its host died or "
            "froze mid-transaction): ended its database session(s) %s",
            EPOCH_LOCK_WAIT_S,
            ended,
        )

    def depose(self, why: str) -> Deposed:
        if self.is_leader:
            log.error("no longer the leader: %s", why)
        self.deposed.set()
        return Deposed(why)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[AsyncSession]:
        """An orchestrator transaction: refused unless this replica still holds the newest epoch (and, with
        etcd, its lease by its own clock) when it starts and when it commits."""
        async with self.database.session() as session:
            self._check_clock()
            query = select(LeaderEpoch.epoch).where(LeaderEpoch.id == 1).with_for_update(read=True)
            current = (await session.execute(query)).scalar_one_or_none()
            if self.epoch is None or current != self.epoch:
                raise self.depose(f"the leadership epoch is {current}, this replica's {self.epoch}")
            yield session
            self._check_clock()

    def _check_clock(self) -> None:
        if self.coordinator is not None and not self.coordinator.leading():
            raise self.depose("the leader lease's deadline passed")
