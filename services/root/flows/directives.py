"""Directives: what every agent of a job must do now, derived from the job's newest recovery plan.

Agents long-poll for a revision newer than the last one they acted on. A plan moves through
pending (machines still registering) -> ready (train from `iteration`); a recovery opens a new generation
in collecting (stop training, report inventories) that becomes ready once planned.

Each agent asks for its own machine's directive: its ranks' sources and the machines holding its replicas
(domain.directives), not the whole job's. A process reads a job's directive once per change, shared by
every request; long polls wait on an event that a commit changing the directive sets: in this process
through SQLAlchemy's after_commit, in other replicas through Postgres NOTIFY (database.mark_changed).
"""

from __future__ import annotations

import asyncio
import random
import uuid

from sqlalchemy import event as orm_event
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.database import CHANGED_JOBS, Database, changed_jobs, mark_changed
from services.root.db.models import Job, JobState, Machine, MachineState, PlanStatus, RecoveryPlan
from services.root.domain.directives import JobDirectiveIndex
from services.root.domain.placement import Placement
from services.root.errors import Invalid, NotFound
from services.root.flows.waiting import Waiting, until_woken
from services.root.flows.waiting import wake as wake_all

FINISHED_STATES = (JobState.COMPLETED, JobState.STOPPED, JobState.FAILED)
# A read of a job's directive is answered from for this long at most, though no change was heard of: the
# safety net for a change committed without mark_changed (a machine's state) or a NOTIFY missed.
RECHECK_S = 5.0
# Postgres whose LISTEN connection is down: other replicas' changes are not heard, re-read this often.
RECHECK_UNHEARD_S = 0.5
# An unchanged directive is answered after a random part of the wait asked for, between this fraction and
# all of it. A job's long polls begin together (the change that answered the last ones woke them all), and
# answered after exactly their wait they would end together and begin again together, forever: at 1,000
# machines a thousand idle answers in one second every 20 s, which held the agents' lease refreshes back
# for up to 0.6 s each time on a 2-core host. Spread, a 20 s wait answers 67 a second at most.
IDLE_ANSWER_MIN_FRACTION = 0.5


def idle_answer_after(wait_s: float) -> float:
    """When a long poll that asked to wait `wait_s` answers if nothing changes (IDLE_ANSWER_MIN_FRACTION)."""
    return wait_s * random.uniform(IDLE_ANSWER_MIN_FRACTION, 1.0)


def directive_changed(session: AsyncSession, job: Job) -> None:
    """A new revision of the job's directive: its long polls answer once the transaction commits. Raised in
    the UPDATE itself: a writer that read the row without its lock (a heartbeat) would otherwise write the
    revision it read plus one, possibly one another writer committed meanwhile, and agents that saw that
    one would ignore this change."""
    job.directive_revision = Job.directive_revision + 1
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
    announced = job.persist_generation is not None  # none after a target completed with no successor
    return schemas.PersistSchedule(
        every=job.persist_every,
        iteration=job.persist_iteration if announced else None,
        generation=job.persist_generation,
    )


async def directive_of(session: AsyncSession, job: Job) -> schemas.DirectiveOut:
    """The whole job's directive: every rank's source and every live machine."""
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


class Built:
    """A job's directive as read at `at` (monotonic) when the job's change count was `changes`; each
    machine's share of it, and the JSON of each, made on first use and kept with it."""

    def __init__(
        self, at: float, changes: int, directive: schemas.DirectiveOut, placement: Placement
    ) -> None:
        self.at, self.changes, self.directive, self.placement = at, changes, directive, placement
        self._index: JobDirectiveIndex[schemas.PlanSource, schemas.Peer] | None = None
        self._bodies: dict[int | None, bytes] = {}

    def for_machine(self, machine: int) -> schemas.DirectiveOut:
        """What machine `machine`'s agent needs: its ranks' sources, and itself and the peers that hold its
        checkpoints' replicas (its placement group in the group strategy; its ring neighbours in a ring,
        not the whole ring)."""
        if not 0 <= machine < self.placement.num_machines:
            raise Invalid(
                f"machine {machine} is outside 0..{self.placement.num_machines - 1}", code="rank_out_of_range"
            )
        if self._index is None:
            directive = self.directive
            self._index = JobDirectiveIndex.of(
                directive.sources, directive.machines, directive.procs_per_machine
            )
        sources, machines = self._index.for_machine(machine, self.placement.holders(machine))
        update = {"machine": machine, "sources": sources, "machines": machines}
        return self.directive.model_copy(update=update)

    def body(self, machine: int | None) -> bytes:
        """The JSON answer for one machine (None: the whole job, as an agent that names none reads it)."""
        body = self._bodies.get(machine)
        if body is None:
            directive = self.directive if machine is None else self.for_machine(machine)
            body = self._bodies[machine] = directive.model_dump_json().encode()
        return body


# Every agent of a job long-polls the directive and refreshes its peers from it: with a thousand machines,
# reading it per request is the root's biggest load. Each process reads a job's directive once per change
# (or RECHECK_S), one read shared by every request in flight.
_built: dict[uuid.UUID, Built] = {}
_reading: dict[uuid.UUID, asyncio.Future[Built]] = {}
_changes: dict[uuid.UUID, int] = {}  # changes heard of per job: a read begun before the last one is stale
_waiting: Waiting = {}  # long polls waiting for a job's next change
DIRECTIVES_CACHED = 256


def _changed(job_id: uuid.UUID | None, wake: bool = True) -> None:
    """A job's directive changed (None: any job's may have): reads begun before are stale, the cached copy
    goes, and (`wake`: its revision moved) the job's long polls wake to read afresh. A change that moves
    no revision (a registration's address) wakes nobody: no long poll would answer for it, and a thousand
    registrations would each wake a thousand."""
    jobs = [job_id] if job_id is not None else list({*_built, *_waiting})
    for job in jobs:
        _built.pop(job, None)
        _changes[job] = _changes.get(job, 0) + 1
        if wake:
            wake_all(_waiting.pop(job, set()))
    if len(_changes) > 4 * DIRECTIVES_CACHED:
        for job in [job for job in _changes if job not in _built and job not in _reading]:
            del _changes[job]  # forgotten: a read of one starts from 0 again, and none is in flight


@orm_event.listens_for(Session, "after_commit")
def _forget_changed(sync_session: Session) -> None:
    """A commit in this process that changed directives (mark_changed): the next request reads afresh, so
    an agent's own report is in the answer to its next poll, and the job's long polls wake."""
    for job_id, wake in changed_jobs(sync_session, pop=True).items():
        _changed(job_id, wake)


@orm_event.listens_for(Session, "after_rollback")
def _drop_changed(sync_session: Session) -> None:
    sync_session.info.pop(CHANGED_JOBS, None)


def recheck_s(database: Database) -> float:
    """How long a read is answered from when no change was heard of (see RECHECK_S)."""
    return RECHECK_S if database.is_sqlite or database.listening else RECHECK_UNHEARD_S


async def current_directive(database: Database, job_id: uuid.UUID) -> Built:
    """The job's directive: the copy read since its last change, or a read shared with every request in
    flight."""
    database.listen(_changed)
    loop = asyncio.get_running_loop()
    while True:
        changes = _changes.get(job_id, 0)
        built = _built.get(job_id)
        if built is not None and built.changes == changes and loop.time() - built.at < recheck_s(database):
            return built
        reading = _reading.get(job_id)
        if reading is None:
            break
        built = await asyncio.shield(reading)
        if built.changes == _changes.get(job_id, 0):
            return built
        # A change was heard of after that read began: read again (unless another request already is).
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
            from services.root.flows.machines import cached_placement  # machines imports this module

            placement = await cached_placement(session, job)
        built = Built(started, changes, directive, placement)
        if _changes.get(job_id, 0) == changes:  # else a change was heard of meanwhile: answer, keep nothing
            if job_id not in _built and len(_built) >= DIRECTIVES_CACHED:
                del _built[next(iter(_built))]
            _built[job_id] = built
        future.set_result(built)
        return built
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved here: no "never retrieved" warning when nobody else waited
        raise
    finally:
        del _reading[job_id]


async def wait_for_directive(
    database: Database, job_id: uuid.UUID, after: int, wait_s: float, machine: int | None = None
) -> bytes:
    """The JSON of the job's directive (one machine's share if `machine` is given) once its revision is
    newer than `after`, or the current one after at most `wait_s` (idle_answer_after). Waits on the job's
    next change, not on the database: a read happens when a change is heard of (or RECHECK_S passed
    without one)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + idle_answer_after(wait_s)
    while True:
        built = await current_directive(database, job_id)
        if built.directive.revision > after or loop.time() >= deadline:
            return built.body(machine)
        if built.changes != _changes.get(job_id, 0):
            continue  # changed while this request was being answered: read afresh
        await until_woken(_waiting, job_id, min(recheck_s(database), deadline - loop.time()))
