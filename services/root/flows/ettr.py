"""A job's measured ETTR (domain/ettr.py) from its failure events and its machines' heartbeat summaries (the
checkpoint stalls), for the API, the pages and /metrics."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db.models import FailureState, Job
from services.root.domain import phases
from services.root.domain.ettr import (
    FailureRecord,
    MeasuredEttr,
    PhaseSpan,
    checkpoint_stall,
    iteration_seconds,
    measure_ettr,
)
from services.root.web import queries

FINISHED = (FailureState.RECOVERED, FailureState.UNRECOVERABLE)


async def failures_of(session: AsyncSession, job_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, list[Any]]:
    """Every failure of the jobs as the ETTR reads it: its times (web.queries.FailureTimes), not its row."""
    found: dict[uuid.UUID, list[Any]] = {}
    for event in await queries.failure_times(session, job_ids):
        found.setdefault(event.job_id, []).append(event)
    return found


async def summaries_of(
    session: AsyncSession, job_ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, list[Mapping[str, Any]]]:
    """The newest heartbeat summary of every machine of the jobs, replaced ones included (their ranks'
    stalls up to the failure count as much as their replacements'): of each, only what the checkpoint
    stall reads (the database extracts it)."""
    return await queries.stall_summaries(session, job_ids)


def record(event: Any, now: datetime, ended_at: datetime | None = None) -> FailureRecord:
    """A failure event's phases, as the pages draw them (a phase under way ends now). An unrecoverable
    failure (the job gave up on it, or was stopped during its recovery) was down from its last phase until
    the job ended (`ended_at`): its open phase runs until then, not dropped as one that never happened."""
    if event.state == FailureState.UNRECOVERABLE and ended_at is not None:
        steps = phases.phases(event, ended_at, finished=False)
        spans = tuple(PhaseSpan(p.name, p.start, p.end or ended_at) for p in steps)
    else:
        steps = phases.phases(event, now, finished=event.state in FINISHED)
        spans = tuple(PhaseSpan(p.name, p.start, p.end or now) for p in steps)
    return FailureRecord(phases.failed_at(event), spans, event.iterations_lost)


def job_ettr(
    job: Job,
    events: Sequence[Any],  # FailureEvent rows, or their times (web.queries.FailureTimes)
    now: datetime | None = None,
    summaries: Sequence[Mapping[str, Any]] = (),
) -> MeasuredEttr:
    now = now or datetime.now(UTC)
    # The iteration time as the recovery accounting takes it: from the effective checkpoint frequency.
    iteration_s = iteration_seconds(job.checkpoints_per_minute)
    return measure_ettr(
        started_at=job.started_at,
        ended_at=job.finished_at or now,
        failures=[record(e, now, job.finished_at or now) for e in events],
        iteration_s=iteration_s,
        stall=checkpoint_stall(summaries),
    )


def ettr_out(measured: MeasuredEttr) -> schemas.EttrOut:
    wasted = measured.wasted_s
    return schemas.EttrOut(
        ettr=None if measured.ettr is None else round(measured.ettr, 6),
        wall_s=round(measured.wall_s, 3),
        productive_s=round(measured.productive_s, 3),
        detection_s=round(wasted["detection"], 3),
        replacement_s=round(wasted["replacement"], 3),
        restore_s=round(wasted["restore"], 3),
        warmup_s=round(wasted["warmup"], 3),
        lost_iterations_s=round(wasted["lost_iterations"], 3),
        checkpoint_overhead_s=(
            None if measured.checkpoint_overhead_s is None else round(measured.checkpoint_overhead_s, 3)
        ),
        iteration_s=None if measured.iteration_s is None else round(measured.iteration_s, 6),
    )


async def ettr_by_job(session: AsyncSession, jobs: Sequence[Job]) -> dict[uuid.UUID, MeasuredEttr]:
    now = datetime.now(UTC)
    ids = [job.id for job in jobs]
    events, summaries = await failures_of(session, ids), await summaries_of(session, ids)
    return {job.id: job_ettr(job, events.get(job.id, []), now, summaries.get(job.id, [])) for job in jobs}
