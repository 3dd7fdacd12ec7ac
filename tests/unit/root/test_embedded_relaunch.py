"""domain.embedded: an embedded-mode failure ends at the first heartbeat after torchrun's relaunch that shows
a commit of the relaunched session, on the machine that holds the failed rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from services.root.db.models import FailureEvent, Job
from services.root.domain.embedded import RELAUNCHED_AT, Resumed, resumed_after_relaunch
from services.root.flows.recovery import _close_embedded

RELAUNCH = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LATER = RELAUNCH + timedelta(seconds=2)


@dataclass
class Event:
    id: int
    rank: int | None
    details: dict[str, Any] = field(default_factory=lambda: {RELAUNCHED_AT: RELAUNCH.isoformat()})


@dataclass
class Holder:
    state: str = "healthy"
    last_heartbeat_at: datetime | None = LATER


def test_the_first_commit_seen_after_the_relaunch_ends_the_failure() -> None:
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder()}, {0: 1}) == [Resumed(1, LATER)]


def test_no_commit_no_heartbeat_since_the_relaunch_or_no_relaunch_leaves_it_open() -> None:
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder()}, {0: 0}) == [], "restored, not committed yet"
    # The registration's own time, and the old session's summary, say nothing about the relaunch.
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder(last_heartbeat_at=RELAUNCH)}, {0: 9}) == []
    assert resumed_after_relaunch([Event(1, 0, details={})], {0: Holder()}, {0: 9}) == [], "not relaunched"
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder(state="suspect")}, {0: 9}) == []
    assert resumed_after_relaunch([Event(1, 0)], {1: Holder()}, {1: 9}) == [], "another rank's machine"
    assert resumed_after_relaunch([Event(1, None)], {0: Holder()}, {0: 9}) == [], "no rank"


def test_failures_of_one_crash_closed_together_charge_the_job_their_downtime_once() -> None:
    job = Job(wasted_time_s=0.0)
    # Two machines declared lost while torchrun relaunched them (1.7 s apart), both resumed at LATER.
    first = FailureEvent(id=1, detected_at=RELAUNCH - timedelta(seconds=10), details={})
    second = FailureEvent(id=2, detected_at=RELAUNCH - timedelta(seconds=8.3), details={})
    charged = _close_embedded(job, first, LATER, "resumed", None)
    charged = _close_embedded(job, second, LATER, "resumed", charged)
    assert job.wasted_time_s == 12.0 and charged == LATER
    assert first.state == second.state == "recovered" and second.resumed_at == LATER
    # A later crash, after the first ones were closed: its own downtime.
    third = FailureEvent(id=3, detected_at=LATER + timedelta(seconds=60), details={})
    _close_embedded(job, third, LATER + timedelta(seconds=65), "resumed", charged)
    assert job.wasted_time_s == 17.0
