"""Directives: what every agent of a job must do now, derived from the job's newest recovery plan.

Agents long-poll for a revision newer than the last one they acted on. A plan moves through
pending (machines still registering) -> ready (train from `iteration`); a recovery opens a new generation
in collecting (stop training, report inventories) that becomes ready once planned.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from sqlalchemy import event as orm_event
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.database import Database, mark_changed
from services.root.db.models import Job, JobState, Machine, MachineState, PlanStatus, RecoveryPlan
from services.root.errors import NotFound

FINISHED_STATES = (JobState.COMPLETED, JobState.STOPPED, JobState.FAILED)
POLL_INTERVAL_S = 0.5
CHANGED_JOBS = "changed_jobs"  # where database.mark_changed notes a job until the commit


def directive_changed(session: AsyncSession, job: Job) -> None:
    job.directive_revision += 1
    mark_changed(session, job.id)


def make_ready(session: AsyncSession, job: Job, plan: RecoveryPlan, rank0: Machine) -> None:
    """Release a plan: every rank trains from `plan.iteration`, meeting at machine 0."""
    plan.status = PlanStatus.READY
    plan.rendezvous = {"master_addr": rank0.address, "master_port": rank0.rendezvous_port}
    directive_changed(session, job)


def persist_out(job: Job) -> schemas.PersistSchedule | None:
    """The iteration every rank persists next, as announced (domain.persist_schedule); None: no tier."""
    if job.persist_every <= 0:
        return None
    return schemas.PersistSchedule(
        every=job.persist_every, iteration=job.persist_iteration, generation=job.persist_generation
    )


async def directive_of(session: AsyncSession, job: Job) -> schemas.DirectiveOut:
    plan = await repo.latest_plan(session, job.id)
    if plan is None:
        raise NotFound(f"job {job.id} has no recovery plan", code="plan_not_found")
    status = "finished" if job.state in FINISHED_STATES else plan.status
    # The machines' addresses only: their summaries and inventories stay unread.
    query = (
        select(Machine.rank, Machine.address, Machine.data_port, Machine.state, Machine.instance_id)
        .where(Machine.job_id == job.id, Machine.state != MachineState.REPLACED)
        .order_by(Machine.rank)
    )
    return schemas.DirectiveOut(
        revision=job.directive_revision,
        job_state=job.state,
        status=status,
        generation=plan.generation,
        iteration=plan.iteration,
        world_size=job.num_machines * job.procs_per_machine,
        procs_per_machine=job.procs_per_machine,
        rendezvous=schemas.Rendezvous(**plan.rendezvous) if plan.rendezvous else None,
        sources=[schemas.PlanSource(**source) for source in plan.sources],
        machines=[
            schemas.Peer(rank=rank, address=address, data_port=port, state=state, instance_id=instance_id)
            for rank, address, port, state, instance_id in (await session.execute(query)).all()
        ],
        persist=persist_out(job),
    )


@dataclass(frozen=True)
class Built:
    """A job's directive as read at `at` (monotonic), and its JSON."""

    at: float
    directive: schemas.DirectiveOut
    body: bytes


# Every agent of a job long-polls the same directive and refreshes its peers from it: with a thousand
# machines, reading it per request (every machine, every rank's source) is the root's biggest load. Each
# process reads a job's directive once per POLL_INTERVAL_S at most, one read shared by every request in
# flight (a local change is seen at once: its commit wakes the waiters, who read afresh).
_built: dict[uuid.UUID, Built] = {}
_reading: dict[uuid.UUID, asyncio.Future[Built]] = {}
_changes: dict[uuid.UUID, int] = {}  # commits here that changed a job's directive: a read older is stale
DIRECTIVES_CACHED = 256


@orm_event.listens_for(Session, "after_commit")
def _forget_changed(sync_session: Session) -> None:
    """A commit in this process that changed directives (mark_changed): the next request reads afresh, so
    an agent's own report is in the answer to its next poll."""
    for job_id in sync_session.info.get(CHANGED_JOBS, ()):
        _built.pop(job_id, None)
        _changes[job_id] = _changes.get(job_id, 0) + 1


async def current_directive(database: Database, job_id: uuid.UUID, *, fresh: bool = False) -> Built:
    loop = asyncio.get_running_loop()
    built = _built.get(job_id)
    if built is not None and not fresh and loop.time() - built.at < POLL_INTERVAL_S:
        return built
    reading = _reading.get(job_id)
    if reading is not None:
        return await asyncio.shield(reading)
    future: asyncio.Future[Built] = loop.create_future()
    _reading[job_id] = future
    try:
        started, changes = loop.time(), _changes.get(job_id, 0)
        async with database.session() as session:
            job = await repo.get_job(session, job_id)
            if job is None:
                _built.pop(job_id, None)
                raise NotFound(f"job {job_id} does not exist", code="job_not_found")
            directive = await directive_of(session, job)
        built = Built(started, directive, directive.model_dump_json().encode())
        if _changes.get(job_id, 0) == changes:  # else a commit landed meanwhile: answer, but keep nothing
            if job_id not in _built and len(_built) >= DIRECTIVES_CACHED:
                del _built[next(iter(_built))]
            if len(_changes) > 4 * DIRECTIVES_CACHED:
                _changes.clear()
            _built[job_id] = built
        future.set_result(built)
        return built
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved here: no "never retrieved" warning when nobody else waited
        raise
    finally:
        del _reading[job_id]


async def wait_for_directive(database: Database, job_id: uuid.UUID, after: int, wait_s: float) -> Built:
    """The job's directive once its revision is newer than `after`, or the current one after `wait_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    woken = False
    while True:
        built = await current_directive(database, job_id, fresh=woken)
        if built.directive.revision > after or loop.time() >= deadline:
            return built
        pause = min(POLL_INTERVAL_S, max(0.0, deadline - loop.time()))
        before = loop.time()
        await database.signals.wait(job_id, pause)
        woken = loop.time() - before < pause * 0.9  # a commit in this process changed it: read afresh
