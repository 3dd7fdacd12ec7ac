"""Read-only aggregate queries for the status pages and /metrics (the repository has the per-job reads)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from services.root.db.models import FailureEvent, FailureState, Job, JobState, Machine, MachineState


async def jobs_by_state(session: AsyncSession) -> dict[str, int]:
    query = select(Job.state, func.count()).group_by(Job.state)
    return {str(state): int(count) for state, count in (await session.execute(query)).all()}


async def machines_by_state(session: AsyncSession) -> dict[str, int]:
    query = select(Machine.state, func.count()).group_by(Machine.state)
    return {str(state): int(count) for state, count in (await session.execute(query)).all()}


async def failures_by_kind(session: AsyncSession) -> dict[str, int]:
    query = select(FailureEvent.kind, func.count()).group_by(FailureEvent.kind)
    return {str(kind): int(count) for kind, count in (await session.execute(query)).all()}


async def recoveries_by_tier(session: AsyncSession) -> dict[str, int]:
    query = (
        select(FailureEvent.tier, func.count())
        .where(FailureEvent.state == FailureState.RECOVERED)
        .group_by(FailureEvent.tier)
    )
    return {str(tier or "none"): int(count) for tier, count in (await session.execute(query)).all()}


async def recovered_failures(session: AsyncSession) -> Sequence[FailureEvent]:
    query = select(FailureEvent).where(FailureEvent.state == FailureState.RECOVERED)
    return (await session.execute(query)).scalars().all()


async def active_jobs(session: AsyncSession) -> Sequence[Job]:
    query = select(Job).where(Job.state.in_((JobState.PENDING, JobState.RUNNING, JobState.RECOVERING)))
    return (await session.execute(query.order_by(Job.name))).scalars().all()


async def live_machine_summaries(
    session: AsyncSession, job_ids: Sequence[Any]
) -> Sequence[tuple[Any, int, dict[str, Any]]]:
    """(job id, machine rank, heartbeat summary) of the live machines of `job_ids`."""
    if not job_ids:
        return []
    query = (
        select(Machine.job_id, Machine.rank, Machine.summary)
        .where(Machine.job_id.in_(job_ids), Machine.state != MachineState.REPLACED)
        .order_by(Machine.job_id, Machine.rank)
    )
    return [
        (job_id, int(rank), summary or {}) for job_id, rank, summary in (await session.execute(query)).all()
    ]
