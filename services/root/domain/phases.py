"""The phases of one failure's recovery, from the timestamps on its failure event.

    detect    the failure happened -> it was detected. A process exit is reported by its agent at once
              (0 s); a lost machine counts from its last heartbeat (it died after it) to the first sign
              of trouble (a peer's collective failing, or the heartbeat timeout).
    classify  detected -> classified (software, hardware, unknown): for a lost machine, until its
              heartbeat timed out (or its etcd lease expired).
    replace   classified -> a new machine took the failed rank (hardware failures only).
    restore   classified, or replaced -> every machine holds the plan's iteration and restarted training
              (inventories collected, the plan decided, checkpoints fetched or found locally).
    resume    restored -> every rank completed its first iteration after the restore.

The one computation of phases: the pages (the bars), /metrics (the histograms), the ETTR accounting and
the CLI (`failure_phases`, from the API's failure JSON) all call it, so they say the same thing.

A failure's *recovery time* has one definition, `recovery_seconds`: from its detection to training resumed
(every rank completed its first iteration after the restore). The pages, /metrics, the API (`recovery_s`
of a failure) and the CLI all show that number; the detect phase before it is shown on its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

PHASES = ("detect", "classify", "replace", "restore", "resume")

PHASE_HELP = {
    "detect": "from the failure (a lost machine: its last heartbeat) to its detection",
    "classify": "from detection to classification (software, hardware)",
    "replace": "from classification until a new machine took the failed rank",
    "restore": "until every machine held the plan's iteration and restarted training",
    "resume": "until every rank completed its first iteration after the restore",
}


@dataclass(frozen=True)
class Phase:
    name: str
    start: datetime
    end: datetime | None  # None: under way
    seconds: float  # so far, when under way


class RecoveryTimes(Protocol):
    @property
    def detected_at(self) -> datetime: ...
    @property
    def resumed_at(self) -> datetime | None: ...


class EventTimes(Protocol):
    """The attributes of a failure event this module reads (a FailureEvent row has them all)."""

    @property
    def kind(self) -> str: ...
    @property
    def detected_at(self) -> datetime: ...
    @property
    def classified_at(self) -> datetime | None: ...
    @property
    def replaced_at(self) -> datetime | None: ...
    @property
    def restored_at(self) -> datetime | None: ...
    @property
    def resumed_at(self) -> datetime | None: ...
    @property
    def details(self) -> Mapping[str, Any]: ...


def parse_timestamp(value: Any) -> datetime | None:
    """An ISO timestamp from an event's JSON details (naive ones are UTC); None if absent or malformed."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def failed_at(event: EventTimes) -> datetime:
    """When the failure happened, as far as the root can tell: a lost machine's last sign of life (it died
    after it), a process exit when it was reported."""
    if event.kind != "hardware":
        return event.detected_at
    since = parse_timestamp(event.details.get("failed_since")) or parse_timestamp(
        event.details.get("last_heartbeat_at")
    )
    return min(since, event.detected_at) if since else event.detected_at


def phases(event: EventTimes, now: datetime | None = None, *, finished: bool | None = None) -> list[Phase]:
    """The phases that applied to `event`, in order; the last one may be under way (end None) unless the
    event is finished (recovered or unrecoverable), in which case phases that never happened are left out."""
    now = now or datetime.now(UTC)
    marks: list[tuple[str, datetime | None]] = [("detect", event.detected_at)]
    marks.append(("classify", event.classified_at))
    hardware = event.kind == "hardware" or event.replaced_at is not None
    # A lost machine reinstated before any replacement took its rank: no replacement phase; its recovery
    # restores and resumes like any other.
    reinstated = event.replaced_at is None and "reinstated" in event.details
    if hardware and not reinstated:
        marks.append(("replace", event.replaced_at))
    marks += [("restore", event.restored_at), ("resume", event.resumed_at)]

    result: list[Phase] = []
    start = failed_at(event)
    for index, (name, end) in enumerate(marks):
        if end is None:
            if any(later is not None for _, later in marks[index + 1 :]):
                continue  # a phase that did not happen (its mark unset) while later ones did
            if not finished:
                result.append(Phase(name, start, None, max(0.0, (now - start).total_seconds())))
            break
        end = max(end, start)
        result.append(Phase(name, start, end, (end - start).total_seconds()))
        start = end
    return result


def is_finished(state: str) -> bool:
    """A failure in this state (FailureState value) is over: recovered, or given up."""
    return state not in ("detected", "recovering")


@dataclass(frozen=True)
class _FailureJson:
    """A failure as the API returns it (GET .../failures/{id}), with its timestamps parsed."""

    kind: str
    detected_at: datetime
    classified_at: datetime | None
    replaced_at: datetime | None
    restored_at: datetime | None
    resumed_at: datetime | None
    details: Mapping[str, Any]


def failure_phases(failure: Mapping[str, Any], now: datetime | None = None) -> list[Phase]:
    """The phases of a failure from its API JSON (the CLI's view): the same as the pages show for it. A
    failure whose state is over (recovered, unrecoverable) leaves out the phases that never happened."""
    detected = parse_timestamp(failure.get("detected_at"))
    if detected is None:
        return []
    event = _FailureJson(
        kind=str(failure.get("kind", "")),
        detected_at=detected,
        classified_at=parse_timestamp(failure.get("classified_at")),
        replaced_at=parse_timestamp(failure.get("replaced_at")),
        restored_at=parse_timestamp(failure.get("restored_at")),
        resumed_at=parse_timestamp(failure.get("resumed_at")),
        details=failure.get("details") or {},
    )
    return phases(event, now, finished=is_finished(str(failure.get("state", ""))))


def recovery_seconds(event: RecoveryTimes) -> float | None:
    """The recovery time: from the failure's detection to training resumed; None until it resumed."""
    if event.resumed_at is None:
        return None
    return max(0.0, (event.resumed_at - event.detected_at).total_seconds())
