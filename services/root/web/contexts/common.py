"""What the job and failure pages share: the hrefs, the job states, what a classification and a tier
mean, and one failure's row (its phases and their bars)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from services.root.db.models import FailureEvent, FailureState, JobState
from services.root.domain import phases
from services.root.web import charts

__all__ = [
    "CLASSIFICATION",
    "JOB_STATES",
    "LIVE_JOB_STATES",
    "TIER_MEANING",
    "TIMELINE_LIMIT",
    "FailureRow",
    "as_number",
    "failure_href",
    "failure_row",
    "job_href",
]


LIVE_JOB_STATES = frozenset({JobState.PENDING, JobState.RUNNING, JobState.RECOVERING})
JOB_STATES = tuple(state.value for state in JobState)
TIMELINE_LIMIT = 50

CLASSIFICATION = {
    "software": "A training process ended abnormally while its machine's agent stayed up: the machine and "
    "its memory are intact, so its ranks restart there from local memory.",
    "hardware": "The machine itself was lost (no heartbeat, an expired lease, or the cloud reported it "
    "unhealthy): it is replaced, and its ranks come back from a peer's memory, or from the persistent tier "
    "when its whole placement group was lost.",
    "unknown": "Castor could not tell what failed (for example, a restore that could not complete); the "
    "cause says what was seen.",
}

TIER_MEANING = {
    "local": "every rank restored from its own machine's memory",
    "peer": "at least one rank was fetched from a peer machine's memory",
    "persistent": "at least one rank came from the persistent tier (a whole placement group was lost)",
    "none": "nothing restorable: training restarted from scratch",
}


def as_number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def job_href(job_id: uuid.UUID) -> str:
    return f"/jobs/{job_id}"


def failure_href(job_id: uuid.UUID, failure_id: int) -> str:
    return f"/jobs/{job_id}/failures/{failure_id}"


@dataclass(frozen=True)
class FailureRow:
    id: int
    href: str
    kind: str
    state: str
    cause: str
    rank: int | None
    instance_id: str | None
    detected_at: datetime
    failed_at: datetime
    tier: str | None
    iterations_lost: int | None
    recovery_s: float | None  # detection to training resumed (phases.recovery_seconds); None until then
    elapsed_s: float  # so far, or in all
    phases: list[phases.Phase]
    segments: list[charts.Segment]
    current_phase: str | None  # the phase under way
    open: bool
    generation: int | None
    resumed_iteration: int | None
    number: int | None = None  # within the job (#3), as shown; the id is global and skips numbers

    @property
    def label(self) -> str:
        return f"#{self.number if self.number is not None else self.id}"

    @property
    def tier_meaning(self) -> str:
        return TIER_MEANING.get(self.tier or "", "")


def failure_row(
    job_id: uuid.UUID, event: FailureEvent, now: datetime, number: int | None = None
) -> FailureRow:

    is_open = event.state in (FailureState.DETECTED, FailureState.RECOVERING)
    steps = phases.phases(event, now, finished=not is_open)
    elapsed = sum(p.seconds for p in steps)
    current = steps[-1].name if steps and steps[-1].end is None else None
    details = event.details or {}
    return FailureRow(
        id=event.id,
        href=failure_href(job_id, event.id),
        kind=event.kind,
        state=event.state,
        cause=event.cause,
        rank=event.rank,
        instance_id=details.get("instance_id"),
        detected_at=event.detected_at,
        failed_at=phases.failed_at(event),
        tier=event.tier,
        iterations_lost=event.iterations_lost,
        recovery_s=phases.recovery_seconds(event),
        elapsed_s=elapsed,
        phases=steps,
        segments=charts.phase_segments(steps, elapsed),
        current_phase=current,
        open=is_open,
        generation=details.get("plan_generation"),
        resumed_iteration=details.get("iteration"),
        number=number,
    )
