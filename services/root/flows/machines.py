"""Machines joining a job and keeping in touch: registration (idempotent), heartbeats, process exits."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy import event as orm_event
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from services.root import schemas
from services.root.clients.etcd import MachineKey, machine_key
from services.root.db import repository as repo
from services.root.db.database import Database, mark_changed
from services.root.db.models import (
    FailureEvent,
    FailureKind,
    Job,
    JobState,
    Machine,
    MachineState,
    PlanStatus,
    utcnow,
)
from services.root.domain import embedded
from services.root.domain.embedded import RELAUNCHED_AT
from services.root.domain.persist_schedule import PersistTarget, next_target
from services.root.domain.persisted import hosted_ranks
from services.root.domain.placement import Placement
from services.root.domain.replication import job_replication, replication_alignment
from services.root.domain.summaries import confined_to_machine
from services.root.errors import Conflict, NotFound
from services.root.flows.directives import directive_changed, make_ready, persist_out
from services.root.flows.jobs import placement_out, stored_placement
from services.root.settings import Settings
from services.root.tasks import start_after_commit

log = logging.getLogger(__name__)


# How often a registration off the job row tries to claim a rank before it falls back to the job row's
# lock (each try is a rank another registration claimed first: rare past the first).
CLAIM_TRIES = 20


class _Locked:
    """A registration that needs the job row's lock: it displaces a failed machine, records an agent's
    restart, or finds the job past pending."""


class _Contested:
    """Another registration claimed the rank (or registered the same instance) first: read again."""


LOCKED, CONTESTED = _Locked(), _Contested()


async def register(
    database: Database, job_id: uuid.UUID, request: schemas.RegisterRequest, settings: Settings
) -> schemas.RegisterResponse:
    """Bind the calling instance to a machine rank (see register_machine), without the job row's lock while
    the job is pending: a thousand machines register at once. A new instance claims its rank with one
    INSERT that the live-rank unique index admits once (a claim that loses reads again and takes another
    rank; the rank it asked for: rank_taken); the registration commits, and then the job starts when every
    rank is held, by a conditional UPDATE (of several last registrations at once exactly one starts it).
    What touches shared state the leader also writes (displacing a failed machine, an agent restarting on
    a live machine, any registration once the job runs) takes the job row's lock, as before."""
    if settings.cloud == "aws":
        async with database.session() as session:
            await _refuse_an_instance_of_another_job(session, job_id, request.instance_id)
    for attempt in range(CLAIM_TRIES):
        async with database.session() as session:
            job = await _job(session, job_id)
            claimed = await _claim(session, job, request, attempt=attempt, locked=False)
            if isinstance(claimed, Machine):
                response = await _registered(session, job, claimed, settings)
                machines = job.num_machines
        if claimed is LOCKED:
            break
        if isinstance(claimed, Machine):
            # After the claim committed: of the last registrations at once, the one that commits last sees
            # every rank held.
            async with database.session() as session:
                await start_if_full(session, job_id, machines)
            return response
    async with database.session() as session:
        job = await _job(session, job_id, for_update=True)
        response = await register_machine(session, job, request, settings)
        machines, pending = job.num_machines, job.state == JobState.PENDING
    if pending:
        async with database.session() as session:
            # Claims made off the lock meanwhile: the job may be full only now that this one committed.
            await start_if_full(session, job_id, machines)
    return response


async def _refuse_an_instance_of_another_job(
    session: AsyncSession, job_id: uuid.UUID, instance_id: str
) -> None:
    """On AWS an instance id names one EC2 instance of the root's one Auto Scaling Group, and a failed
    machine's instance is terminated: an instance another job runs on, registered with this job's token
    (by mistake, or by a holder of this job's token only), would be terminated when this job declared it
    failed. (Locally an instance id is a host name, and two jobs may share one host.)"""
    held = await repo.instance_held_elsewhere(session, instance_id, job_id)
    if held is not None:
        job_name, rank = held
        # The other job is named in the root's log only: this job's token gives no view of other jobs.
        log.warning(
            "job %s: instance %r refused, it is machine %d of job %r", job_id, instance_id, rank, job_name
        )
        raise Conflict(
            f"instance {instance_id!r} is a machine of another job that is still running; an instance runs "
            "one job",
            code="instance_in_use",
        )


async def _job(session: AsyncSession, job_id: uuid.UUID, *, for_update: bool = False) -> Job:
    job = await repo.get_job(session, job_id, for_update=for_update)
    if job is None:
        raise NotFound(f"job {job_id} does not exist", code="job_not_found")
    return job


async def register_machine(
    session: AsyncSession, job: Job, request: schemas.RegisterRequest, settings: Settings
) -> schemas.RegisterResponse:
    """Bind the calling instance to a machine rank. The same instance always gets the same rank back; a
    new instance takes the requested rank, else a failed machine's rank, else the lowest free one.

    The caller holds the job row locked (SELECT ... FOR UPDATE): registrations that change what the leader
    also writes serialize with it (`register` takes this way for those only)."""
    machine = await _claim(session, job, request, attempt=0, locked=True)
    assert isinstance(machine, Machine), "under the job row's lock a claim is never contested"
    if job.state == JobState.PENDING:
        await start_if_full(session, job.id, job.num_machines)
    return await _registered(session, job, machine, settings)


async def _claim(
    session: AsyncSession, job: Job, request: schemas.RegisterRequest, *, attempt: int, locked: bool
) -> Machine | _Locked | _Contested:
    """This instance's machine, bound to its rank and with its newest address (in the session, not yet
    committed). Off the job row's lock (`locked` False) only while the job is pending, and only a claim of
    a free rank or an instance's registration again; anything else answers LOCKED."""
    if job.state in (JobState.COMPLETED, JobState.STOPPED, JobState.FAILED):
        raise Conflict(f"job {job.name!r} is {job.state}; it takes no new machines", code="job_finished")
    if not locked and job.state != JobState.PENDING:
        return LOCKED
    # Ranks and states only, not every machine's row: a thousand machines register one after another.
    live = await repo.live_ranks(session, job.id)
    machine = await repo.machine_by_instance(session, job.id, request.instance_id)
    if machine is not None and machine.state == MachineState.REPLACED:
        raise Conflict(
            f"instance {request.instance_id!r} was replaced as machine {machine.rank}; start a new instance",
            code="instance_replaced",
        )
    now = utcnow()
    address = {
        "address": request.address,
        "data_port": request.data_port,
        "hostname": request.hostname,
        "rendezvous_port": request.rendezvous_port,
        "embedded": request.embedded,
        "agent_session": request.agent_session,
    }
    if machine is None:
        # A later try spreads over the free ranks: the registrations that lost a rank together do not all
        # go for the same next one.
        rank = _choose_rank(job, live, request.rank, spread=attempt > 0 and request.rank is None)
        holder = next((m for m in live if m.rank == rank), None)
        if holder is not None and not locked:
            return LOCKED  # a failed machine's rank: its failure's recovery moves on (_note_replacement)
        if holder is None and not locked:
            claimed = await repo.claim_rank(
                session,
                job.id,
                rank,
                instance_id=request.instance_id,
                state=MachineState.HEALTHY,
                last_heartbeat_at=now,
                **address,
            )
            if claimed is None:
                return CONTESTED
            machine = await session.get(Machine, claimed)
            assert machine is not None
            mark_changed(session, job.id, wake=False)  # see below
            return machine
        displaced = next(iter(await repo.machines_at_ranks(session, job.id, [rank])), None)
        if displaced is not None:
            displaced.state = MachineState.REPLACED
            await session.flush()  # frees the live-rank unique index before the insert
            await _note_replacement(session, job, displaced, request.instance_id)
        machine = Machine(job_id=job.id, rank=rank, instance_id=request.instance_id)
        session.add(machine)
    elif request.rank is not None and request.rank != machine.rank:
        raise Conflict(
            f"instance {request.instance_id!r} is already machine {machine.rank}, not {request.rank}",
            code="rank_mismatch",
        )
    elif job.state in (JobState.RUNNING, JobState.RECOVERING) and _restarted(request, machine):
        # The agent restarted on a live machine, or torchrun relaunched the training: the training processes
        # had stopped.
        if not locked:
            return LOCKED
        if request.embedded:  # not orchestrated, but recorded, and closed once training resumes
            await _note_embedded_relaunch(session, job, machine, now)
        else:
            cause = f"the agent of machine {machine.rank} ({machine.instance_id}) restarted"
            session.add(_software_failure(job, machine, cause, detected_at=now, classified_at=now))
    # An agent restarted on the same instance may listen on a new port: take the newest address.
    for key, value in address.items():
        setattr(machine, key, value)
    machine.state = MachineState.HEALTHY
    machine.last_heartbeat_at = now
    # The directive's machine list changed (a new holder of a rank, a new address): drop the cached copy at
    # commit, else a replacement's first poll can read its rank still held by the machine it displaced
    # and stop as "replaced". No long poll wakes for it (the revision stays).
    mark_changed(session, job.id, wake=False)
    await session.flush()
    return machine


async def start_if_full(session: AsyncSession, job_id: uuid.UUID, machines: int) -> bool:
    """A pending job whose every rank is held starts: training from scratch, meeting at machine 0. One
    conditional UPDATE, so of the last registrations at once (each after its own commit, so the last to
    commit sees every rank held) exactly one starts it and releases the first plan."""
    if await repo.live_machine_count(session, job_id) < machines:
        return False
    if not await repo.start_job(session, job_id, utcnow()):
        return False  # started already, or not pending (stopped meanwhile)
    # Running now, its row locked by the UPDATE until this transaction ends: read afresh.
    job = await session.get(Job, job_id, populate_existing=True)
    assert job is not None
    plan = await repo.latest_plan(session, job_id)
    if plan is not None and plan.status == PlanStatus.PENDING:
        (rank0,) = await repo.machines_at_ranks(session, job_id, [0])
        make_ready(session, job, plan, rank0)
    await session.flush()
    return True


async def _registered(
    session: AsyncSession, job: Job, machine: Machine, settings: Settings
) -> schemas.RegisterResponse:
    """The registration's answer: the job's shape, the machine's placement group's peers, the newest plan's
    generation (not the plan: its per-rank sources stay unread)."""
    placement = await cached_placement(session, job)
    members = placement.group_of(machine.rank).members
    peers = await repo.machines_at_ranks(session, job.id, [m for m in members if m != machine.rank])
    return schemas.RegisterResponse(
        machine_id=machine.id,
        rank=machine.rank,
        job_id=job.id,
        machines=job.num_machines,
        replicas=job.replicas,
        procs_per_machine=job.procs_per_machine,
        persist_every=job.persist_every,
        checkpoint_bytes_max=job.checkpoint_bytes_max,
        replication_policy=job.replication_policy,
        replication_bandwidth_gbps=job.replication_bandwidth_gbps,
        placement=placement_out(job, placement),
        peers=_group_peers(machine.rank, members, peers),
        heartbeat=heartbeat_config(job, machine.rank, machine.instance_id, settings),
        directive_wait_s=directive_wait_s(job.num_machines),
        plan_generation=await repo.latest_generation(session, job.id),
        persistent=persistent_tier(settings),
    )


# Embedded mode: a machine relaunched with no failure of its own joins another machine's failure detected at
# most this long before its own last heartbeat (or since): that machine's crash stopped its collectives too.
RELAUNCH_JOIN_S = 10.0


async def _note_embedded_relaunch(session: AsyncSession, job: Job, machine: Machine, now: datetime) -> None:
    """The machine's open failures (its loss, declared while it was silent) are reinstated and wait for the
    relaunched training's first commit (domain.embedded). With none open (a relaunch within the heartbeat
    timeout, a one-machine job), the relaunch is a failure of its own, from the machine's last heartbeat,
    unless it joins another machine's failure of the same crash: torchrun relaunches every machine's
    processes after one failed, and one crash is one failure."""
    from services.root.flows.failures import latest_silent_losses, reinstate  # it imports this module

    relaunched = {RELAUNCHED_AT: now.isoformat()}
    # The summary is still the crashed session's: what the relaunch may roll back (domain.embedded).
    reached = embedded.reached_iteration(machine.summary)
    job_failures = list(await repo.open_failures(session, job.id))
    opened = [e for e in job_failures if e.machine_id == machine.id]
    for event in opened:
        event.details = {**event.details, **relaunched}
        _note_reached(event, reached)
    silent = latest_silent_losses(opened).get(machine.id)
    if silent is not None:
        reinstate(machine, "its training was relaunched (embedded mode)", silent)
    if opened:
        return
    last_seen = machine.last_heartbeat_at
    since = (last_seen or now) - timedelta(seconds=RELAUNCH_JOIN_S)
    crash = next((e for e in job_failures if e.detected_at >= since), None)
    if crash is not None:
        joined = [*crash.details.get("relaunched_machines", []), machine.rank]
        crash.details = {**crash.details, "relaunched_machines": joined}
        _note_reached(crash, reached)
        return
    cause = (
        f"the training on machine {machine.rank} ({machine.instance_id}) was relaunched: its processes had "
        "stopped (embedded mode)"
    )
    detected_at = min(last_seen, now) if last_seen is not None else now
    failure = _software_failure(
        job, machine, cause, detected_at=detected_at, classified_at=now, embedded=True, **relaunched
    )
    _note_reached(failure, reached)
    session.add(failure)


def _note_reached(event: FailureEvent, reached: int | None) -> None:
    """A machine of the failure was relaunched, having committed up to `reached` (None: nothing known)."""
    noted = event.details.get(embedded.REACHED)
    newest = embedded.newer(noted if type(noted) is int else None, reached)
    if newest is not None and newest != noted:
        event.details = {**event.details, embedded.REACHED: newest}


def _restarted(request: schemas.RegisterRequest, machine: Machine) -> bool:
    """Whether a registration of a registered instance comes from a new agent process (a new session), not
    the same one sending it again (its answer lost, nothing died). An agent too old to send a session is
    taken as new; an embedded machine only when both sessions are known (a relaunch is recorded only when
    it can be told)."""
    if request.embedded:
        return machine.agent_session is not None and request.agent_session not in (
            None,
            machine.agent_session,
        )
    return request.agent_session is None or request.agent_session != machine.agent_session


def _software_failure(
    job: Job, machine: Machine, cause: str, *, detected_at: datetime, classified_at: datetime, **details: Any
) -> FailureEvent:
    return FailureEvent(
        job_id=job.id,
        machine_id=machine.id,
        rank=machine.rank,
        kind=FailureKind.SOFTWARE,
        cause=cause,
        detected_at=detected_at,
        classified_at=classified_at,
        details={"instance_id": machine.instance_id, **details},
    )


async def _note_replacement(session: AsyncSession, job: Job, failed: Machine, instance_id: str) -> None:
    """The failed machine's rank is taken: that phase of its failure's recovery is done."""
    now = utcnow()
    for event in await repo.open_failures(session, job.id):
        if event.machine_id == failed.id and event.replaced_at is None:
            event.replaced_at = now
            # An embedded machine's: torchrun's training, relaunched on another instance (domain.embedded).
            relaunched = {RELAUNCHED_AT: now.isoformat()} if failed.embedded else {}
            event.details = {**event.details, "replaced_by": instance_id, **relaunched}
            if failed.embedded:
                _note_reached(event, embedded.reached_iteration(failed.summary))


def _choose_rank(
    job: Job, live: Sequence[repo.LiveRank], requested: int | None, *, spread: bool = False
) -> int:
    bound = {m.rank: m for m in live}
    if requested is not None:
        if requested >= job.num_machines:
            raise Conflict(
                f"rank {requested} is outside 0..{job.num_machines - 1} for job {job.name!r}",
                code="rank_out_of_range",
            )
        holder = bound.get(requested)
        if holder is not None and holder.state != MachineState.FAILED:
            raise Conflict(
                f"rank {requested} is held by live instance {holder.instance_id!r}", code="rank_taken"
            )
        return requested
    failed = sorted(m.rank for m in live if m.state == MachineState.FAILED)
    if failed:
        return failed[0]
    free = [r for r in range(job.num_machines) if r not in bound]
    if not free:
        raise Conflict(
            f"job {job.name!r} already has all {job.num_machines} machines registered", code="job_full"
        )
    return random.choice(free) if spread else free[0]


def _group_peers(rank: int, members: Sequence[int], live: Sequence[Machine]) -> list[schemas.Peer]:
    by_rank = {m.rank: m for m in live}
    peers = []
    for member in members:
        if member == rank:
            continue
        machine = by_rank.get(member)
        peers.append(
            schemas.Peer(
                rank=member,
                address=machine.address if machine else None,
                data_port=machine.data_port if machine else None,
                state=machine.state if machine else None,
            )
        )
    return peers


# etcd mode: a job's agents rewrite their summary keys at most this many times a second together (each is a
# raft write and an event on the leader's watch): every 2 s up to 200 machines, then less often (1,000
# machines: every 10 s). At 1,000 x 8 every 2 s made 500 writes a second, which with the simulated agents'
# keepalives saturated a 2-core host. The job's counters and the persist schedule follow the summaries a
# few seconds later at that size.
SUMMARY_WRITES_PER_S = 100.0
SUMMARY_PERIOD_MIN_S = 2.0


def summary_period_s(num_machines: int) -> float:
    return max(SUMMARY_PERIOD_MIN_S, num_machines / SUMMARY_WRITES_PER_S)


# Every agent long-polls its directive, and an idle long poll answers (unchanged) when its wait is up: each
# answer is a request the root parses, reads a cached body for and sends. 10 s up to 500 machines, then
# longer so that a job's idle answers stay at 50 a second (1,000 machines: 20 s), at most 30 s (under the
# idle timeouts of common proxies). A change still answers every long poll at once.
DIRECTIVE_ANSWERS_PER_S = 50.0
DIRECTIVE_WAIT_MIN_S = 10.0
DIRECTIVE_WAIT_MAX_S = 30.0


def directive_wait_s(num_machines: int) -> float:
    return min(DIRECTIVE_WAIT_MAX_S, max(DIRECTIVE_WAIT_MIN_S, num_machines / DIRECTIVE_ANSWERS_PER_S))


def heartbeat_config(job: Job, rank: int, instance_id: str, settings: Settings) -> schemas.HeartbeatConfig:
    if settings.etcd_endpoints:
        return schemas.HeartbeatConfig(
            mode="etcd",
            interval_s=min(settings.heartbeat_interval_s, settings.lease_ttl_s / 3),
            timeout_s=settings.lease_ttl_s,
            etcd_endpoints=settings.etcd_endpoints,
            etcd_key=machine_key(settings.etcd_prefix, job.id, rank, instance_id),
            summary_period_s=summary_period_s(job.num_machines),
        )
    return schemas.HeartbeatConfig(
        mode="rest", interval_s=settings.heartbeat_interval_s, timeout_s=settings.heartbeat_timeout_s
    )


def persistent_tier(settings: Settings) -> schemas.PersistentTier:
    if settings.s3_bucket:
        return schemas.PersistentTier(
            kind="s3",
            prefix=settings.s3_prefix,
            bucket=settings.s3_bucket,
            region=settings.aws_region,
            endpoint_url=settings.s3_endpoint_url or settings.aws_endpoint_url,
        )
    return schemas.PersistentTier(kind="local", prefix=settings.s3_prefix, path=str(settings.persistent_dir))


async def live_machine_at(session: AsyncSession, job: Job, rank: int, instance_id: str) -> Machine:
    """The live machine bound to `rank`, which must be `instance_id` (a replaced zombie gets a 409)."""
    machine = await repo.machine_by_instance(session, job.id, instance_id)
    if machine is None or machine.rank != rank:
        raise Conflict(
            f"instance {instance_id!r} is not registered as machine {rank} of job {job.name!r}",
            code="not_registered",
        )
    if machine.state == MachineState.REPLACED:
        raise Conflict(f"instance {instance_id!r} was replaced as machine {rank}", code="instance_replaced")
    return machine


async def record_heartbeat(
    session: AsyncSession,
    job: Job,
    rank: int,
    request: schemas.HeartbeatRequest,
    settings: Settings | None = None,
) -> schemas.HeartbeatResponse:
    """A heartbeat: one indexed UPDATE of this machine's row, nothing shared locked (the job row is read, not
    locked: a thousand machines heartbeat a second). Its group's peers and the newest plan's generation are
    small reads; the job-wide counters follow off the request for jobs past COUNTERS_INLINE_MAX_MACHINES."""
    summary = own_summary(job, rank, request.instance_id, request.summary.model_dump(mode="json"))
    latency_s = persist_latency_s(settings, job.num_machines)
    newest = await repo.newest_plan(session, job.id)
    if job.num_machines <= COUNTERS_INLINE_MAX_MACHINES:
        released = await _released_generation(session, job, newest)
        live = await _counters_inline(session, job, {request.instance_id: summary}, released, latency_s)
        # Replication rounds aligned across machines: the answer every agent acts on (domain.replication).
        alignment = replication_alignment(live)
    else:
        refresh_counters_soon(session, job.id, latency_s)
        alignment = None  # rounds run free (README, Limitations)
    state = await repo.touch_machine(session, job.id, rank, request.instance_id, at=utcnow(), summary=summary)
    if state is None:
        await live_machine_at(session, job, rank, request.instance_id)  # says why (409)
        raise Conflict(f"instance {request.instance_id!r} is not machine {rank}", code="not_registered")
    # A suspect (or failed) machine heartbeating again is reinstated by the leader, which records it and
    # cancels a replacement it requested (orchestrator.judge).
    members = (await cached_placement(session, job)).group_of(rank).members
    peers = await repo.machines_at_ranks(session, job.id, [m for m in members if m != rank])
    return schemas.HeartbeatResponse(
        state=state,
        job_state=job.state,
        plan_generation=None if newest is None else newest.generation,
        peers=_group_peers(rank, members, peers),
        replication=None if alignment is None else schemas.ReplicationAlignment(**asdict(alignment)),
        persist=persist_out(job),
    )


async def record_summaries(
    session: AsyncSession, job_id: uuid.UUID, summaries: Mapping[MachineKey, dict[str, Any]]
) -> None:
    """etcd mode: heartbeats' summaries read from the agents' keys (key -> its newest), recorded as
    REST heartbeats record theirs, a batch of one job's machines in one transaction: the machines' rows in
    one statement (a replaced machine's summary is dropped), the job's counters and persist schedule once
    (inline for a handful of machines, else off the transaction: refresh_counters_soon).

    The job row is read, not locked (a large job's is not written either): a lock serialized every batch
    behind the recovery driver's and the judgements' transactions, which hold it for seconds when most
    leases lapse at once, and the summaries of the machines coming back waited there. A judgement writing
    several of the same machines' rows meanwhile can deadlock with a batch; Postgres aborts one of the two
    after its deadlock_timeout (the leader retries a judgement at its next tick; a batch is dropped, and a
    returned machine's next summary is written at once)."""
    job = await repo.get_job(session, job_id)
    if job is None or not summaries:
        return
    checked = {
        key.instance_id: own_summary(
            job, key.rank, key.instance_id, checked_summary(key.instance_id, summary)
        )
        for key, summary in summaries.items()
    }
    ranks = {key.instance_id: key.rank for key in summaries}
    latency_s = _etcd_persist_latency_s(job.num_machines)
    if job.num_machines <= COUNTERS_INLINE_MAX_MACHINES:
        generation = await _released_generation(session, job, await repo.newest_plan(session, job_id))
        await _counters_inline(session, job, checked, generation, latency_s, ranks)
    else:
        refresh_counters_soon(session, job_id, latency_s)
    await repo.touch_machines(session, job_id, checked, ranks, at=utcnow())


def checked_summary(instance_id: str, summary: dict[str, Any]) -> dict[str, Any]:
    """An etcd key's summary held to the schema a REST heartbeat's is (the key's value is whatever the agent
    wrote): one that fails it is recorded as empty, the machine still alive, rather than failing its whole
    batch at every pass, or being stored for the recovery planner to trip on."""
    try:
        schemas.CheckpointSummary.model_validate(summary)
        return summary
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        log.warning(
            "machine %s: its etcd summary is not valid (%d problems; %s: %s), taken as empty",
            instance_id,
            exc.error_count(),
            where,
            first["msg"],
        )
        return {}


# (job, instance) pairs whose summaries named ranks their machine cannot hold: warned of once per process.
_confined_warned: set[tuple[uuid.UUID, str]] = set()
CONFINED_WARNED_MAX = 10_000


def own_summary(job: Job, machine_rank: int, instance_id: str, summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without entries of ranks its machine neither runs nor replicates (domain.summaries)."""
    world_size = job.num_machines * job.procs_per_machine
    confined, dropped = confined_to_machine(summary, machine_rank, job.procs_per_machine, world_size)
    if dropped and (job.id, instance_id) not in _confined_warned:
        if len(_confined_warned) >= CONFINED_WARNED_MAX:
            _confined_warned.clear()
        _confined_warned.add((job.id, instance_id))
        hosted = hosted_ranks(machine_rank, job.procs_per_machine)
        log.warning(
            "job %s: machine %d (%s) names ranks %s in its summary where it cannot: it runs ranks %d..%d "
            "and holds replicas of other machines' ranks only. Those entries are ignored (does the training "
            "run %d processes per machine?)",
            job.name,
            machine_rank,
            instance_id,
            ", ".join(map(str, dropped[:8])) + (" ..." if len(dropped) > 8 else ""),
            hosted.start,
            hosted.stop - 1,
            job.procs_per_machine,
        )
    return confined


async def _released_generation(session: AsyncSession, job: Job, newest: repo.NewestPlan | None) -> int | None:
    """The generation the persist schedule runs in (the newest plan's, once released), with `job`, read
    without its lock before `newest`, read again where a recovery may have released its plan between the
    two reads: the schedule would otherwise see the released plan beside the target before it, give that
    up, and choose its own from the abandoned history's reports in place of the one released with the
    plan. Only during a recovery or until the new generation has a target: not on every heartbeat."""
    if newest is None or not newest.released:
        return None
    if job.persist_every > 0 and (
        job.state == JobState.RECOVERING
        or (job.state == JobState.RUNNING and job.persist_generation != newest.generation)
    ):
        await session.refresh(job)
    return newest.generation


async def _counters_inline(
    session: AsyncSession,
    job: Job,
    fresh: Mapping[str, dict[str, Any]],
    generation: int | None,
    latency_s: float,
    ranks: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """A handful of machines: the job's counters and persist schedule at once, from its live machines'
    summaries with `fresh` (instance id -> summary, not written yet) in place of their rows'; the job row
    written (flushed) before the machines' are (the orchestrator's lock order, job then machines: no
    deadlock between the two). `ranks`: the rank each of `fresh` was sent for (etcd keys), taken only for
    the machine at that rank, as touch_machines writes it. The live summaries."""
    live = [
        fresh.get(m.instance_id, m.summary)
        if ranks is None or ranks.get(m.instance_id) == m.rank
        else m.summary
        for m in await repo.live_machines(session, job.id, documents=["summary"])
    ]
    _refresh_job_counters(job, live)
    await schedule_persist(session, job, live, generation, latency_s)
    await session.flush()
    return live


# Job-wide counters (newest iteration, checkpoints, replication) come from every live machine's summary:
# O(machines) per refresh. Up to this many machines a heartbeat refreshes them itself; past it, a refresh
# runs at most every COUNTERS_EVERY_S per job, in a transaction of its own after the heartbeats' commits.
COUNTERS_INLINE_MAX_MACHINES = 32
COUNTERS_EVERY_S = 1.0
# One refresh per job and process at a time: a job whose summaries changed while its refresh ran is refreshed
# again by the same task. (A task per second, each waiting for the job row, held a pooled connection each
# while the job was locked: at 1,000 machines they piled up until no request got a connection.)
_counters_scheduled: set[uuid.UUID] = set()
_counters_stale: set[uuid.UUID] = set()


def refresh_counters_soon(session: AsyncSession, job_id: uuid.UUID, latency_s: float | None = None) -> None:
    """Have the job's counters refreshed once this session's transaction committed (its summary in them),
    and the persist schedule moved on if it is due (`latency_s`: see persist_latency_s)."""
    latency = PERSIST_LATENCY_DEFAULT_S if latency_s is None else latency_s
    session.info.setdefault(_COUNTERS_DUE, {})[job_id] = (session.bind, latency)


_COUNTERS_DUE = "castor_counters_due"


@orm_event.listens_for(Session, "after_commit")
def _schedule_counters(sync_session: Session) -> None:
    for job_id, (engine, latency_s) in sync_session.info.pop(_COUNTERS_DUE, {}).items():
        if job_id in _counters_scheduled:
            _counters_stale.add(job_id)  # its refresh may have read the summaries already: it goes again
            continue
        _counters_scheduled.add(job_id)
        start_after_commit(engine, _refresh_counters(engine, job_id, latency_s), f"counters-{job_id}")


async def _refresh_counters(engine: AsyncEngine, job_id: uuid.UUID, latency_s: float) -> None:
    """Refresh the job's counters every COUNTERS_EVERY_S until a refresh went through with no summary
    committed since it began."""
    try:
        while True:
            await asyncio.sleep(COUNTERS_EVERY_S)
            _counters_stale.discard(job_id)  # before reading: a heartbeat committed from now on marks it
            try:
                done = await _refresh_counters_once(engine, job_id, latency_s)
            except Exception as exc:  # the next heartbeat schedules another
                log.warning("refreshing the counters of job %s failed: %s", job_id, exc)
                return
            if done and job_id not in _counters_stale:
                return
    finally:
        _counters_scheduled.discard(job_id)
        _counters_stale.discard(job_id)


async def _refresh_counters_once(engine: AsyncEngine, job_id: uuid.UUID, latency_s: float) -> bool:
    """False when the job's row is locked (the orchestrator, a registration): tried again later, without
    holding a connection while it waits."""
    async with AsyncSession(engine, expire_on_commit=False) as session, session.begin():
        job = await repo.get_job(session, job_id, for_update=True, skip_locked=True)
        if job is None:
            return not await repo.job_exists(session, job_id)  # gone, or locked
        summaries = await repo.live_summaries(session, job_id)
        _refresh_job_counters(job, summaries)
        generation = await repo.released_generation(session, job_id)
        await schedule_persist(session, job, summaries, generation, latency_s)
        return True


# The placement never changes after the job is created: read once per job by the heartbeats.
_placements: dict[uuid.UUID, Placement] = {}
PLACEMENTS_CACHED = 256


async def cached_placement(session: AsyncSession, job: Job) -> Placement:
    placement = _placements.get(job.id)
    if placement is None:
        placement = stored_placement(job, await repo.placement_groups(session, job.id))
        if len(_placements) >= PLACEMENTS_CACHED:
            del _placements[next(iter(_placements))]
        _placements[job.id] = placement
    return placement


def _refresh_job_counters(job: Job, live: Sequence[dict[str, Any]]) -> None:
    """Job-wide counters from the live machines' newest summaries: the iteration every rank has committed,
    checkpoints taken and skipped, and the effective checkpoint frequency."""
    newest: dict[int, int] = {}
    for summary in live:
        for rank, iteration in summary.get("local", {}).items():
            newest[int(rank)] = max(iteration, newest.get(int(rank), -1))
    world_size = job.num_machines * job.procs_per_machine
    job.newest_iteration = min(newest.values()) if len(newest) == world_size else None
    job.checkpoints_committed = sum(summary.get("committed", 0) for summary in live)
    job.checkpoints_skipped = sum(summary.get("skipped", 0) for summary in live)
    rates = [summary["per_minute"] for summary in live if summary.get("per_minute") is not None]
    if rates:  # else the last one measured stands (no machine has two commits of one process yet)
        job.checkpoints_per_minute = min(rates)
    progress = job_replication(live)
    job.replicated_iteration, job.replication_interval = progress.replicated_iteration, progress.interval
    job.replication_lag, job.replication_state = progress.lag, progress.state


# -- the persist schedule (domain.persist_schedule) -----------------------------------------------------
# How long after a commit the fastest rank hears of an announcement, without settings: a summary is up to a
# heartbeat interval old, the announcement then travels on the directive's long poll.
PERSIST_LATENCY_DEFAULT_S = 2.0
# The long poll: woken at once in the root process that announced, within a poll interval on the others.
ANNOUNCE_S = 0.5


def persist_latency_s(settings: Settings | None, num_machines: int) -> float:
    """How stale the newest reported iteration may be when an announcement reaches the fastest rank: the
    summary's age and the announcement's way to the agents. A rank that is a few iterations past the
    target when it hears of it still finds it in one of its slots (or reports it missed, and the root
    announces another). The summary's age is a heartbeat interval over REST; under etcd, summaries are put
    every summary_period_s (10 s at 1,000 machines), and a lead sized for a 2 s heartbeat announced
    iterations every rank had already overwritten: no complete persisted checkpoint at that scale."""
    if settings is None:
        return PERSIST_LATENCY_DEFAULT_S
    if settings.etcd_endpoints:
        return _etcd_persist_latency_s(num_machines)
    return settings.heartbeat_interval_s + ANNOUNCE_S


def _etcd_persist_latency_s(num_machines: int) -> float:
    return summary_period_s(num_machines) + ANNOUNCE_S


_SCHEDULING = (JobState.RUNNING, JobState.RECOVERING)


async def schedule_persist(
    session: AsyncSession,
    job: Job,
    summaries: Sequence[dict[str, Any]],
    generation: int | None,
    latency_s: float,
    *,
    complete: bool = False,
    releasing: bool = False,
    uploading: Collection[tuple[int, int, int]] = (),
) -> None:
    """Announce the next iteration every rank persists when the current one is complete (`complete`) or
    given up, or none was announced yet. `generation`: the newest plan's once it is released, None while a
    recovery collects inventories: its generation decides, with its plan, whether the current target is
    kept (domain.persist_schedule). The plan's release announces at once (flows.recovery), so the new
    generation's target reaches the agents with the plan, before any rank restarts (`releasing`, with
    `uploading`: the (rank, iteration, generation) of the uploads its inventories name in flight). That
    release decides whether a target of an older generation is kept; later calls only move it on once it
    is complete or missed."""
    if job.persist_every <= 0 or job.state not in _SCHEDULING or generation is None:
        return
    current = (
        PersistTarget(job.persist_iteration, job.persist_generation)
        if job.persist_iteration is not None and job.persist_generation is not None
        else None
    )
    resumed_from, uploaded = None, 0
    if current is not None and current.generation != generation:
        # A recovery since the announcement: the target stays if its shards are still on the timeline and
        # the ranks can finish it (two small queries, only until the target is kept complete or replaced).
        resumed_from = await repo.resumed_since(session, job.id, current.generation)
        uploaded = await repo.persisted_shard_count(session, job.id, current.iteration, current.generation)
    target = next_target(
        current,
        every=job.persist_every,
        generation=generation,
        summaries=summaries,
        latency_s=latency_s,
        complete=complete,
        resumed_from=resumed_from,
        uploaded=uploaded,
        world_size=job.num_machines * job.procs_per_machine,
        uploading=(
            0
            if current is None
            else len({rank for rank, i, g in uploading if (i, g) == (current.iteration, current.generation)})
        ),
        kept=current is not None and current.generation != generation and not releasing,
    )
    if target is None and complete and current is not None:
        # No successor a report could name (a summary claims an iteration near 2**31): announce none, so the
        # next calls choose afresh from the summaries (a complete target would otherwise stay announced, its
        # completion seen only once); its iteration stays the bound reports are held to (flows.persistence).
        log.warning(
            "job %s: iteration %d is persisted and no next one can be announced: a machine reports an "
            "iteration near 2**31",
            job.name,
            current.iteration,
        )
        job.persist_generation = None
        directive_changed(session, job)
        return
    if target is None or target == current:
        return
    log.info(
        "job %s: every rank persists iteration %d next (generation %d; the previous: %s)",
        job.name,
        target.iteration,
        target.generation,
        "none" if current is None else f"{current.iteration}, {'complete' if complete else 'given up'}",
    )
    job.persist_iteration, job.persist_generation = target.iteration, target.generation
    directive_changed(session, job)  # wakes every agent's directive long poll: each hears of it at once
