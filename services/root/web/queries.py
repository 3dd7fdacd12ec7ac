"""Read-only aggregate queries for the status pages and /metrics (the repository has the per-job reads)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from services.root.db.models import FailureEvent, FailureState, Job, JobState, Machine, MachineState
from services.root.domain.embedded import CRASH


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


@dataclass(frozen=True)
class FailureTimes:
    """What the phases, the histograms and the ETTR read of a failure event (domain.phases.EventTimes):
    its timestamps, and of its details only the two times `phases.failed_at` reads and the embedded-mode
    crash it was part of (the histograms count a crash's rollback once); not its cause, its cascade or its
    replacement's record."""

    id: int
    job_id: Any
    kind: str
    state: str
    plan_id: int | None
    iterations_lost: int | None
    detected_at: datetime
    classified_at: datetime | None
    replaced_at: datetime | None
    restored_at: datetime | None
    resumed_at: datetime | None
    details: Mapping[str, Any]


def _failure_times() -> Any:  # a select of FailureTimes' fields
    return select(
        FailureEvent.id,
        FailureEvent.job_id,
        FailureEvent.kind,
        FailureEvent.state,
        FailureEvent.plan_id,
        FailureEvent.iterations_lost,
        FailureEvent.detected_at,
        FailureEvent.classified_at,
        FailureEvent.replaced_at,
        FailureEvent.restored_at,
        FailureEvent.resumed_at,
        FailureEvent.details["failed_since"],
        FailureEvent.details["last_heartbeat_at"],
        FailureEvent.details[CRASH],
    )


async def _times(session: AsyncSession, query: Any) -> list[FailureTimes]:
    found = []
    for row in (await session.execute(query)).all():
        *fields, failed_since, last_heartbeat_at, crash = row
        details = {"failed_since": failed_since, "last_heartbeat_at": last_heartbeat_at, CRASH: crash}
        kept = {key: value for key, value in details.items() if value is not None}
        found.append(FailureTimes(*fields, details=kept))  # type: ignore[misc]
    return found


async def recovered_failures(session: AsyncSession) -> list[FailureTimes]:
    """Every recovered failure's times (the /metrics histograms count them all), as narrow rows."""
    return await _times(session, _failure_times().where(FailureEvent.state == FailureState.RECOVERED))


async def failure_times(session: AsyncSession, job_ids: Sequence[Any]) -> list[FailureTimes]:
    """The times of every failure of `job_ids` (their ETTR), as narrow rows."""
    if not job_ids:
        return []
    return await _times(session, _failure_times().where(FailureEvent.job_id.in_(list(job_ids))))


async def active_jobs(session: AsyncSession) -> Sequence[Job]:
    query = select(Job).where(Job.state.in_((JobState.PENDING, JobState.RUNNING, JobState.RECOVERING)))
    return (await session.execute(query.order_by(Job.name))).scalars().all()


SUMMARY_COUNTERS = (
    "committed",
    "replicated",
    "skipped",
    "replicas_skipped",
    "replication_lag_s",
    "store_filesystem",
)


async def stall_summaries(
    session: AsyncSession, job_ids: Sequence[Any]
) -> dict[Any, list[Mapping[str, Any]]]:
    """Per job, of the newest heartbeat summary of each of its machines (replaced ones too), only the two
    maps the checkpoint stall reads (domain.ettr.checkpoint_stall): stalled_s and save_calls."""
    if not job_ids:
        return {}
    query = select(Machine.job_id, Machine.summary["stalled_s"], Machine.summary["save_calls"]).where(
        Machine.job_id.in_(list(job_ids))
    )
    found: dict[Any, list[Mapping[str, Any]]] = {}
    for job_id, stalled, calls in (await session.execute(query)).all():
        found.setdefault(job_id, []).append({"stalled_s": stalled, "save_calls": calls})
    return found


async def machine_states(session: AsyncSession, job_id: Any) -> list[tuple[int, str, Any, Any]]:
    """(rank, state, its summary's replicas_skipped and store_filesystem) of each live machine of the job, by
    rank: what the job page counts and pages by, without the machines' rows (the database extracts the two
    fields)."""
    query = (
        select(
            Machine.rank,
            Machine.state,
            Machine.summary["replicas_skipped"],
            Machine.summary["store_filesystem"],
        )
        .where(Machine.job_id == job_id, Machine.state != MachineState.REPLACED)
        .order_by(Machine.rank)
    )
    rows = (await session.execute(query)).all()
    return [(int(rank), str(state), skipped, filesystem) for rank, state, skipped, filesystem in rows]


async def live_machines_at(session: AsyncSession, job_id: Any, ranks: Sequence[int]) -> Sequence[Machine]:
    """The job's live machines of these ranks, without their inventories: the ones a page draws."""
    if not ranks:
        return []
    query = (
        select(Machine)
        .options(defer(Machine.inventory))
        .where(
            Machine.job_id == job_id, Machine.state != MachineState.REPLACED, Machine.rank.in_(list(ranks))
        )
        .order_by(Machine.rank)
    )
    return (await session.execute(query)).scalars().all()


async def machine_summaries(
    session: AsyncSession, job_ids: Sequence[Any]
) -> tuple[list[tuple[Any, int, dict[str, Any]]], dict[Any, list[Mapping[str, Any]]]]:
    """In one read of the machines of `job_ids`, what /metrics takes of their heartbeat summaries: (job
    id, rank, the SUMMARY_COUNTERS) of each live machine by job and rank, and as `stall_summaries`, per
    job the stall maps of every machine (replaced ones too). The summaries come whole: sending the stored
    JSON text costs the database nothing, where extracting seven fields from each made it parse each
    summary seven times (1,000 machines: tens of milliseconds of the database's time a scrape)."""
    if not job_ids:
        return [], {}
    query = (
        select(Machine.job_id, Machine.rank, Machine.state, Machine.summary)
        .where(Machine.job_id.in_(list(job_ids)))
        .order_by(Machine.job_id, Machine.rank)
    )
    live: list[tuple[Any, int, dict[str, Any]]] = []
    stalls: dict[Any, list[Mapping[str, Any]]] = {}
    for job_id, rank, state, summary in (await session.execute(query)).all():
        summary = summary if isinstance(summary, dict) else {}
        stalls.setdefault(job_id, []).append(
            {"stalled_s": summary.get("stalled_s"), "save_calls": summary.get("save_calls")}
        )
        if state != MachineState.REPLACED:
            counters = {key: summary[key] for key in SUMMARY_COUNTERS if summary.get(key) is not None}
            live.append((job_id, int(rank), counters))
    return live, stalls
