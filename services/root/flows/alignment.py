"""Replication alignment as it changes: a long poll for the agents that align their rounds (REST heartbeats).

An aligned round moves in steps (the last machine done, the next proposal, its adoption, every machine's
pin, the go: services.root.domain.replication), each a change in one machine's summary that every other
machine must hear of before it can act. Heard only with each machine's next heartbeat, every step costs up to
a heartbeat period (1 s by default), several per round: with iterations of half a second, aligned rounds
waited 5-10 iterations between transfers. So an agent that aligns its rounds heartbeats at once when its own
part changed, and long-polls the job's alignment here, answered the moment it changes.

After a heartbeat of a followed job commits, the job's alignment is read afresh from every live machine's
committed summary (one read per job at a time, again if a heartbeat committed meanwhile): a heartbeat's own
answer is computed before its commit, beside others in flight, so two machines that became ready together
each saw the other not ready yet. A job counts as followed for FOLLOWED_S after its last poll, so jobs whose
agents do not align (CASTOR_REPLICATION_ALIGN=0) cost nothing more per heartbeat. Another replica's
heartbeats are not heard here: a poll reads the summaries itself when the newest read is older than
RECHECK_S.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid

from sqlalchemy import event as orm_event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from services.root.db import repository as repo
from services.root.domain.replication import ReplicationAlignment, replication_alignment
from services.root.errors import NotFound
from services.root.flows.machines import COUNTERS_INLINE_MAX_MACHINES
from services.root.flows.waiting import Waiting, until_woken, wake
from services.root.tasks import start_after_commit

log = logging.getLogger(__name__)

# (aligned_iteration, target, go) as an agent last heard it; the job's answer when no machine replicates
# (None) reads as NOTHING.
Seen = tuple[int | None, int | None, bool]
NOTHING: Seen = (None, None, False)
RECHECK_S = 0.25  # a poll answers from a read at most this old (another replica's heartbeats go unheard)
FOLLOWED_S = 30.0  # a job's heartbeats refresh its alignment this long after its last poll
KEPT_JOBS = 1024  # reads kept; the oldest go first

# Jobs past COUNTERS_INLINE_MAX_MACHINES do not align (their heartbeats compute no job-wide figures inline).
# job -> (loop time, ticket, alignment) of the newest read: a read that began before the one published (its
# ticket is older) is not published after it, so a poll never hears an older alignment after a newer one.
_latest: dict[uuid.UUID, tuple[float, int, ReplicationAlignment | None]] = {}
_tickets = itertools.count()
_waiting: Waiting = {}
_followed: dict[uuid.UUID, float] = {}  # job -> loop time of its last poll
_reading: set[uuid.UUID] = set()
_read_locks: dict[uuid.UUID, asyncio.Lock] = {}  # a poll's own read of a job: one at a time
_stale: set[uuid.UUID] = set()
_DUE = "castor_alignment_due"


def seen_of(alignment: ReplicationAlignment | None) -> Seen:
    if alignment is None:
        return NOTHING
    return alignment.aligned_iteration, alignment.target, alignment.go


def followed(job_id: uuid.UUID) -> bool:
    at = _followed.get(job_id)
    return at is not None and asyncio.get_running_loop().time() - at < FOLLOWED_S


def refresh_after_commit(session: AsyncSession, job_id: uuid.UUID) -> None:
    """A heartbeat of a followed job: read its alignment afresh once this transaction committed."""
    session.info.setdefault(_DUE, {})[job_id] = session.bind


@orm_event.listens_for(Session, "after_commit")
def _schedule_reads(sync_session: Session) -> None:
    for job_id, engine in sync_session.info.pop(_DUE, {}).items():
        if job_id in _reading:
            _stale.add(job_id)  # the read in flight may predate this commit: it reads again
            continue
        _reading.add(job_id)
        start_after_commit(engine, _read_until_current(engine, job_id), f"alignment-{job_id}")


async def _read_until_current(engine: AsyncEngine, job_id: uuid.UUID) -> None:
    try:
        while True:
            _stale.discard(job_id)  # before reading: a heartbeat committed from now on marks it again
            try:
                await read_alignment(engine, job_id)
            except Exception as exc:  # the next heartbeat, or a poll's own read, tries again
                log.warning("reading the replication alignment of job %s failed: %s", job_id, exc)
                return
            if job_id not in _stale:
                return
    finally:
        _reading.discard(job_id)
        _stale.discard(job_id)


async def read_alignment(engine: AsyncEngine, job_id: uuid.UUID) -> ReplicationAlignment | None:
    """The job's alignment from its live machines' committed summaries, kept and announced to its polls."""
    ticket = next(_tickets)
    async with AsyncSession(engine) as session:
        job = await repo.get_job(session, job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found", code="job_not_found")
        too_large = job.num_machines > COUNTERS_INLINE_MAX_MACHINES
        alignment = None if too_large else replication_alignment(await repo.live_summaries(session, job_id))
    return _publish(job_id, ticket, alignment)


def _publish(
    job_id: uuid.UUID, ticket: int, alignment: ReplicationAlignment | None
) -> ReplicationAlignment | None:
    """Keep the read as the job's newest (unless a later read was kept already) and wake the polls that wait
    for a change; the newest alignment."""
    previous = _latest.pop(job_id, None)
    if previous is not None and previous[1] > ticket:
        _latest[job_id] = previous
        return previous[2]
    if len(_latest) >= KEPT_JOBS:
        del _latest[next(iter(_latest))]
    _latest[job_id] = (asyncio.get_running_loop().time(), ticket, alignment)
    if previous is None or previous[2] != alignment:
        wake(_waiting.get(job_id, set()))
    return alignment


async def wait_for_alignment(
    engine: AsyncEngine, job_id: uuid.UUID, seen: Seen, wait_s: float
) -> ReplicationAlignment | None:
    """The job's alignment once it differs from `seen`, or as it is after at most `wait_s`."""
    loop = asyncio.get_running_loop()
    _followed[job_id] = loop.time()
    if len(_followed) > KEPT_JOBS:
        del _followed[next(iter(_followed))]
    deadline = loop.time() + wait_s
    while True:
        current = await _recent(engine, job_id)
        if seen_of(current) != seen or loop.time() >= deadline:
            return current
        await until_woken(_waiting, job_id, min(RECHECK_S, deadline - loop.time()))


async def _recent(engine: AsyncEngine, job_id: uuid.UUID) -> ReplicationAlignment | None:
    """The newest read if it is at most RECHECK_S old, else a new one: one at a time per job, shared by the
    polls that found the newest too old together (they wait out their RECHECK_S together)."""

    def fresh() -> tuple[float, int, ReplicationAlignment | None] | None:
        latest = _latest.get(job_id)
        return latest if latest is not None and loop.time() - latest[0] <= RECHECK_S else None

    loop = asyncio.get_running_loop()
    if (latest := fresh()) is not None:
        return latest[2]
    lock = _read_locks.setdefault(job_id, asyncio.Lock())
    if len(_read_locks) > KEPT_JOBS:
        del _read_locks[next(iter(_read_locks))]
    async with lock:
        if (latest := fresh()) is not None:  # read meanwhile by the poll that held the lock
            return latest[2]
        return await read_alignment(engine, job_id)
