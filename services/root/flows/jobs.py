"""Creating jobs and presenting them: placement computed once and stored, counters joined in."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.clients import CloudOperator, CloudOperatorError, JobInfo
from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.models import (
    FailureEvent,
    FailureKind,
    FailureState,
    Job,
    JobState,
    PlacementGroupRow,
    PlanStatus,
    RecoveryPlan,
    utcnow,
)
from services.root.domain.placement import (
    Placement,
    PlacementGroup,
    plan_placement,
    recovery_probabilities,
)
from services.root.errors import Conflict, NotFound
from services.root.flows import ettr as ettr_flows
from services.root.flows.directives import FINISHED_STATES, directive_changed
from services.root.tokens import issue_worker_token

log = logging.getLogger(__name__)


async def create_job(session: AsyncSession, request: schemas.JobCreate) -> tuple[Job, str]:
    """Store a new job with its placement, recovery probabilities and first plan (start fresh)."""
    if await repo.job_by_name(session, request.name) is not None:
        raise Conflict(f"a job named {request.name!r} already exists", code="job_exists")
    # Seconds of CPU for thousands of machines: in a thread, so the event loop keeps serving heartbeats.
    placement, probabilities = await asyncio.to_thread(
        _plan, request.machines, request.replicas, request.placement
    )
    job = Job(
        name=request.name,
        state=JobState.PENDING,
        num_machines=request.machines,
        replicas=request.replicas,
        procs_per_machine=request.procs_per_machine,
        persist_every=request.persist_every,
        keep_persisted=request.keep_persisted,
        checkpoint_bytes_max=request.checkpoint_bytes_max,
        replication_policy=request.replication_policy,
        replication_bandwidth_gbps=request.replication_bandwidth_gbps,
        placement_strategy=placement.strategy,
        launch=request.launch.model_dump() if request.launch else None,
        recovery_probabilities=probabilities,
        worker_token_hash="",
    )
    session.add(job)
    await session.flush()  # assigns the id the token embeds
    token, token_hash = issue_worker_token(job.id)
    job.worker_token_hash = token_hash
    # One multi-row INSERT, not an ORM object per group: a job of thousands of machines has thousands of
    # groups, and the unit of work would run (and round-trip) for each one on the event loop.
    await session.execute(
        insert(PlacementGroupRow),
        [
            {"job_id": job.id, "index": g.index, "kind": g.kind, "members": list(g.members)}
            for g in placement.groups
        ],
    )
    session.add(
        RecoveryPlan(
            job_id=job.id,
            generation=1,
            iteration=None,
            status=PlanStatus.PENDING,
            reason="job start",
            sources=[],
        )
    )
    await session.flush()
    return job, token


def _plan(machines: int, replicas: int, strategy: Any) -> tuple[Placement, dict[str, float]]:
    placement = plan_placement(machines, replicas, strategy)
    return placement, {str(k): p for k, p in recovery_probabilities(placement, 4).items()}


async def stop_job(session: AsyncSession, job: Job) -> None:
    """Stop a job for good: its agents stop training and exit (the directive says finished), the leader
    stops watching it, and its history stays readable. Under the job row's lock, read afresh: a leader's
    step that holds it may be changing the state and the directive's revision, and a stop computed from
    the row as read before would overwrite them (a revision the agents had already seen: never acted on)."""
    if await repo.get_job(session, job.id, for_update=True) is None:
        raise NotFound(f"job {job.id} does not exist", code="job_not_found")
    if job.state in FINISHED_STATES:
        raise Conflict(f"job {job.name!r} has already {job.state}", code="job_finished")
    job.state, job.finished_at = JobState.STOPPED, utcnow()
    # Its open failures end with it: otherwise the pages show them under way for ever, and a replacement
    # still in flight goes on (record_intent refuses a closed failure's next cloud call).
    why = "the job was stopped before this failure was recovered"
    for event in await repo.open_failures(session, job.id):
        event.state = FailureState.UNRECOVERABLE
        event.details = {**event.details, "unrecoverable": why}
    directive_changed(session, job)
    await session.flush()


async def provision_machines(database: Database, operator: CloudOperator, job: JobInfo, token: str) -> None:
    """Start a new job's machines (the local operator runs its launch spec; after the create's commit, so
    that they can register at once). When they cannot be started (no process can be spawned, the state
    directory cannot be written), the job fails, the reason on a failure event, and the machines that did
    start are stopped: before, the job waited in pending for machines that would never come."""
    try:
        await operator.provision(job, token)
        return
    except (CloudOperatorError, OSError, subprocess.SubprocessError) as exc:
        why = f"the {operator.name} operator could not start the job's machines: {type(exc).__name__}: {exc}"
    log.error("job %s: %s", job.name, why)
    async with database.session() as session:
        row = await repo.get_job(session, job.id, for_update=True)
        if row is not None and row.state not in FINISHED_STATES:  # else stopped or deleted meanwhile
            now = utcnow()
            session.add(
                FailureEvent(
                    job_id=row.id,
                    kind=FailureKind.UNKNOWN,
                    state=FailureState.UNRECOVERABLE,
                    cause=why[:500],
                    detected_at=now,
                    classified_at=now,
                    details={"unrecoverable": why},
                )
            )
            row.state, row.finished_at = JobState.FAILED, now
            directive_changed(session, row)
    await operator.release(job)


def stored_placement(job: Job, groups: Sequence[PlacementGroupRow]) -> Placement:
    """The placement as it was decided when the job was created."""
    return Placement(
        strategy=job.placement_strategy,  # type: ignore[arg-type]
        num_machines=job.num_machines,
        replicas=job.replicas,
        groups=tuple(PlacementGroup(g.index, g.kind, tuple(g.members)) for g in groups),  # type: ignore[arg-type]
    )


def placement_out(job: Job, placement: Placement) -> schemas.PlacementOut:
    """The placement's wire form. Its groups and ranks are built once per job and process: the placement
    never changes once the job exists, every registration's answer carries it, and building it for 1,000
    machines took 30 ms, 45 % of the root's CPU while a thousand machines registered."""
    parts = _placement_parts.get(job.id)
    if parts is None or parts[0] != placement:
        groups = [
            schemas.PlacementGroupOut(index=g.index, kind=g.kind, members=list(g.members))
            for g in placement.groups
        ]
        ranks = [
            schemas.RankPlacement(
                rank=rank, holders=list(placement.holders(rank)), sends_to=list(placement.sends_to(rank))
            )
            for rank in range(placement.num_machines)
        ]
        parts = (placement, groups, ranks)
        if len(_placement_parts) >= PLACEMENTS_OUT_CACHED:
            del _placement_parts[next(iter(_placement_parts))]
        _placement_parts[job.id] = parts
    _, groups, ranks = parts
    return schemas.PlacementOut(
        strategy=placement.strategy,
        machines=placement.num_machines,
        replicas=placement.replicas,
        groups=groups,
        ranks=ranks,
        recovery_probability=job.recovery_probabilities,
    )


# job id -> (its placement, the wire form of its groups and ranks); shared by every answer: never mutated.
_placement_parts: dict[
    uuid.UUID, tuple[Placement, list[schemas.PlacementGroupOut], list[schemas.RankPlacement]]
] = {}
PLACEMENTS_OUT_CACHED = 64


async def load_placement(session: AsyncSession, job: Job) -> Placement:
    """The stored placement, read as plain rows: ORM objects for thousands of groups cost seconds of the
    event loop to build."""
    query = (
        select(PlacementGroupRow.index, PlacementGroupRow.kind, PlacementGroupRow.members)
        .where(PlacementGroupRow.job_id == job.id)
        .order_by(PlacementGroupRow.index)
    )
    rows = (await session.execute(query)).all()
    return stored_placement(job, rows)  # type: ignore[arg-type]  # rows carry the same attributes


async def job_placement(session: AsyncSession, job: Job) -> schemas.PlacementOut:
    placement = await load_placement(session, job)
    _ = job.recovery_probabilities  # loaded here: the thread below must not touch the database
    return await asyncio.to_thread(placement_out, job, placement)  # O(N * m): every rank's holders


async def jobs_out(session: AsyncSession, jobs: Sequence[Job]) -> list[schemas.JobOut]:
    ids = [job.id for job in jobs]
    failures = await repo.failure_counts(session, ids)
    ettrs = await ettr_flows.ettr_by_job(session, jobs)
    healthy = await repo.healthy_counts(session, ids)
    return [
        schemas.JobOut(
            id=job.id,
            name=job.name,
            state=job.state,
            machines=job.num_machines,
            replicas=job.replicas,
            procs_per_machine=job.procs_per_machine,
            persist_every=job.persist_every,
            keep_persisted=job.keep_persisted,
            checkpoint_bytes_max=job.checkpoint_bytes_max,
            placement_strategy=job.placement_strategy,
            replication_policy=job.replication_policy,
            replication_bandwidth_gbps=job.replication_bandwidth_gbps,
            machines_healthy=healthy.get(job.id, 0),
            newest_iteration=job.newest_iteration,
            checkpoints_committed=job.checkpoints_committed,
            checkpoints_skipped=job.checkpoints_skipped,
            checkpoints_per_minute=job.checkpoints_per_minute,
            replicated_iteration=job.replicated_iteration,
            replication_interval=job.replication_interval,
            replication_lag=job.replication_lag,
            replication_state=job.replication_state,
            failures=failures.get(job.id, 0),
            wasted_time_s=job.wasted_time_s,
            created_at=job.created_at,
            updated_at=job.updated_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            ettr=ettr_flows.ettr_out(ettrs[job.id]),
        )
        for job in jobs
    ]


async def job_out(session: AsyncSession, job: Job) -> schemas.JobOut:
    return (await jobs_out(session, [job]))[0]
