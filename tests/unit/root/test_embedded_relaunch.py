"""domain.embedded: an embedded-mode failure ends at the first heartbeat after torchrun's relaunch that shows
a commit of the relaunched session, on the machine that holds the failed rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from services.root.db.models import FailureEvent, Job
from services.root.domain.embedded import (
    COMMITTED_AT_LOSS,
    CRASH,
    FRESH_START,
    REACHED,
    RELAUNCHED_AT,
    Charged,
    Progress,
    Resumed,
    came_back,
    charged_by,
    iterations,
    progress_of,
    reached_iteration,
    resumed_after_relaunch,
    rollback,
)
from services.root.domain.failure_metrics import ITERATIONS_LOST, failure_counters
from services.root.flows.recovery import _close_embedded

RELAUNCH = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
LATER = RELAUNCH + timedelta(seconds=2)
NINE = {0: Progress(9)}  # nine commits since the relaunch


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
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder()}, {0: Progress(1)}) == [Resumed(1, LATER)]
    resumed = resumed_after_relaunch([Event(1, 0)], {0: Holder()}, {0: Progress(1, restored=5)})
    assert resumed == [Resumed(1, LATER, restored=5)], "with what the relaunched training restored"


def test_no_commit_no_heartbeat_since_the_relaunch_or_no_relaunch_leaves_it_open() -> None:
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder()}, {0: Progress(0)}) == [], "not committed yet"
    # The registration's own time, and the old session's summary, say nothing about the relaunch.
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder(last_heartbeat_at=RELAUNCH)}, NINE) == []
    assert resumed_after_relaunch([Event(1, 0, details={})], {0: Holder()}, NINE) == [], "not relaunched"
    assert resumed_after_relaunch([Event(1, 0)], {0: Holder(state="suspect")}, NINE) == []
    assert resumed_after_relaunch([Event(1, 0)], {1: Holder()}, {1: Progress(9)}) == [], "another rank's"
    assert resumed_after_relaunch([Event(1, None)], {0: Holder()}, NINE) == [], "no rank"


def test_failures_of_one_crash_closed_together_charge_the_job_their_downtime_once() -> None:
    job = Job(wasted_time_s=0.0)
    # Two machines declared lost while torchrun relaunched them (1.7 s apart), both resumed at LATER.
    first = FailureEvent(id=1, detected_at=RELAUNCH - timedelta(seconds=10), details={})
    second = FailureEvent(id=2, detected_at=RELAUNCH - timedelta(seconds=8.3), details={})
    charged = _close_embedded(job, first, LATER, "resumed", Charged())
    charged = _close_embedded(job, second, LATER, "resumed", charged)
    assert job.wasted_time_s == 12.0 and charged.until == LATER
    assert first.state == second.state == "recovered" and second.resumed_at == LATER
    # A later crash, after the first ones were closed: its own downtime.
    third = FailureEvent(id=3, detected_at=LATER + timedelta(seconds=60), details={})
    _close_embedded(job, third, LATER + timedelta(seconds=65), "resumed", charged)
    assert job.wasted_time_s == 17.0


def test_a_relaunch_loses_the_iterations_past_the_one_its_training_restored() -> None:
    assert reached_iteration({"local": {"0": 7, "1": 9}, "committed": 3}) == 9
    assert reached_iteration({"local": {}}) is None and reached_iteration(None) is None
    # A summary through etcd is not validated: only iterations count.
    assert reached_iteration({"local": {"0": "9", "1": -50, "2": 2**40, "3": True}}) is None
    assert iterations({"restored": {"0": -1, "1": -2, "2": 4}}, "restored", lowest=FRESH_START) == [-1, 4]
    assert rollback(9, 7) == ("local", 2)
    assert rollback(9, 9) == ("local", 0)
    assert rollback(9, FRESH_START) == ("none", 10), "a fresh start loses iteration 0 too"
    assert rollback(None, 7) == ("local", None), "nothing committed known before the relaunch"
    assert rollback(9, None) == (None, None), "a worker library that does not say what it restored"


def test_closing_records_the_rollback_and_charges_it_once_per_crash() -> None:
    job = Job(wasted_time_s=0.0, checkpoints_per_minute=30.0)  # 2 s per iteration
    first = FailureEvent(id=1, detected_at=RELAUNCH - timedelta(seconds=10), details={REACHED: 9})
    second = FailureEvent(id=2, detected_at=RELAUNCH - timedelta(seconds=8.3), details={REACHED: 8})
    charged = _close_embedded(job, first, LATER, "resumed", Charged(), restored=6)
    charged = _close_embedded(job, second, LATER, "resumed", charged, restored=6)
    assert (first.tier, first.iterations_lost) == ("local", 3)
    assert (second.tier, second.iterations_lost) == ("local", 2)
    assert first.details[CRASH] == second.details[CRASH] == 1, "one crash"
    # 12 s down, and the 3 iterations one crash rolled back (the overlapping failure's 2 are among them).
    assert job.wasted_time_s == 12.0 + 3 * 2.0
    # The relaunched ranks say the newest iteration they held: their last heartbeat was one behind.
    lagging = FailureEvent(id=4, detected_at=RELAUNCH - timedelta(seconds=5), details={REACHED: 8})
    _close_embedded(Job(wasted_time_s=0.0), lagging, LATER, "resumed", Charged(), restored=6, reached=9)
    assert (lagging.tier, lagging.iterations_lost) == ("local", 3)
    unknown = FailureEvent(id=3, detected_at=LATER + timedelta(seconds=60), details={REACHED: 20})
    _close_embedded(job, unknown, LATER + timedelta(seconds=65), "resumed", charged)
    assert unknown.tier is None and unknown.iterations_lost is None and unknown.details[CRASH] == 3
    assert job.wasted_time_s == 12.0 + 6.0 + 5.0


def test_a_crash_closed_over_several_steps_is_charged_its_largest_rollback_once() -> None:
    """The failure closed first may have lost fewer iterations than one closed later in the same crash (its
    machine's last heartbeat was older): the job, the metrics and the ETTR all count the crash's largest."""
    job = Job(wasted_time_s=0.0, checkpoints_per_minute=30.0)  # 2 s per iteration
    first = FailureEvent(id=1, detected_at=RELAUNCH - timedelta(seconds=10), details={REACHED: 8})
    second = FailureEvent(id=2, detected_at=RELAUNCH - timedelta(seconds=8), details={REACHED: 9})
    _close_embedded(job, first, LATER, "resumed", Charged(), restored=6)
    # A later leader step: what the first charged comes back from its row (repository.last_charged).
    charged = charged_by([first], first.resumed_at)
    assert (charged.crash, charged.lost, charged.since) == (1, 2, first.detected_at)
    _close_embedded(job, second, LATER + timedelta(seconds=1), "resumed", charged, restored=6)
    assert (first.iterations_lost, second.iterations_lost) == (2, 3)
    assert job.wasted_time_s == 13.0 + 3 * 2.0, "13 s down, 3 iterations rolled back, once"
    for event in (first, second):
        event.plan_id = None
        event.kind = "hardware"
    counted = failure_counters({"hardware": 2}, {"local": 2}, [first, second])
    assert counted[(ITERATIONS_LOST, "", "")] == 3


def test_what_a_crash_charged_is_read_back_whatever_order_its_failures_closed_in() -> None:
    """Failures closed in one step share their resume time; the row read back may be any of them."""
    job = Job(wasted_time_s=0.0, checkpoints_per_minute=30.0)
    early = FailureEvent(id=3, detected_at=RELAUNCH - timedelta(seconds=9), details={REACHED: 8})
    late = FailureEvent(id=2, detected_at=RELAUNCH - timedelta(seconds=4), details={REACHED: 14})
    charged = _close_embedded(job, early, LATER, "resumed", Charged(), restored=6)
    charged = _close_embedded(job, late, LATER, "resumed", charged, restored=6)
    assert (early.iterations_lost, late.iterations_lost) == (2, 8)
    for closed in ([early, late], [late, early], [late]):
        read = charged_by(closed, LATER)
        assert (read.until, read.crash, read.lost) == (LATER, 3, 8), closed
    assert charged_by([early, late], LATER).since == early.detected_at
    # A third failure of the crash, closed at a later step, adds no iteration: the crash lost 8.
    third = FailureEvent(id=4, detected_at=RELAUNCH - timedelta(seconds=1), details={REACHED: 14})
    before = job.wasted_time_s
    _close_embedded(job, third, LATER + timedelta(seconds=1), "resumed", charged_by([early, late], LATER), 6)
    assert job.wasted_time_s == before + 1.0
    assert (
        charged_by([], None) == Charged()
        and charged_by([FailureEvent(id=9, details={})], LATER).crash is None
    )


def test_a_failure_detected_earlier_but_closed_later_adds_the_downtime_before_the_crash() -> None:
    """The crash's downtime is the union of its failures' spans, as the ETTR counts it."""
    job = Job(wasted_time_s=0.0)
    later = FailureEvent(id=1, detected_at=RELAUNCH + timedelta(seconds=5), details={})
    earlier = FailureEvent(id=2, detected_at=RELAUNCH, details={})
    charged = _close_embedded(job, later, RELAUNCH + timedelta(seconds=8), "resumed", Charged())
    _close_embedded(job, earlier, RELAUNCH + timedelta(seconds=10), "resumed", charged)
    assert job.wasted_time_s == 10.0, "from the first detection to the last resume"


def test_a_machine_silent_before_the_last_resume_is_part_of_that_crash() -> None:
    """The ETTR dates a lost machine's failure from its last heartbeat: declared lost after the crash's
    resume, it is still the same crash, whose rollback counts once."""
    job = Job(wasted_time_s=0.0, checkpoints_per_minute=30.0)
    crash = FailureEvent(id=1, kind="software", detected_at=RELAUNCH, details={REACHED: 9})
    charged = _close_embedded(job, crash, LATER, "resumed", Charged(), restored=6)
    silent_since = (LATER - timedelta(seconds=1)).isoformat()
    lost = FailureEvent(
        id=2,
        kind="hardware",
        detected_at=LATER + timedelta(seconds=8),
        details={REACHED: 9, "failed_since": silent_since},
    )
    before = job.wasted_time_s
    _close_embedded(job, lost, LATER + timedelta(seconds=12), "resumed", charged, restored=6)
    assert lost.details[CRASH] == 1 and lost.iterations_lost == 3
    assert job.wasted_time_s == before + 4.0, "its downtime, not the crash's 3 iterations again"


def test_a_machine_reinstated_without_a_relaunch_ends_its_failure_once_its_training_committed() -> None:
    back = {
        "reinstated": {"at": RELAUNCH.isoformat(), "why": "its heartbeats resumed"},
        COMMITTED_AT_LOSS: 5,
    }
    trained = {0: Progress(6)}
    assert came_back([Event(1, 0, details=back)], {0: Holder()}, trained) == [Resumed(1, LATER)]
    # Heartbeats alone are no sign of training: local rank 0 may be stuck in a collective.
    assert came_back([Event(1, 0, details=back)], {0: Holder()}, {0: Progress(5)}) == []
    assert came_back([Event(1, 0, details=back)], {0: Holder(last_heartbeat_at=RELAUNCH)}, trained) == []
    relaunched = {**back, RELAUNCHED_AT: RELAUNCH.isoformat()}
    assert came_back([Event(1, 0, details=relaunched)], {0: Holder()}, trained) == [], "a relaunch's own end"
    assert came_back([Event(1, 0, details={COMMITTED_AT_LOSS: 5})], {0: Holder()}, trained) == []
    unknown = {"reinstated": back["reinstated"]}
    assert came_back([Event(1, 0, details=unknown)], {0: Holder()}, trained) == [], "commits then unknown"
    assert came_back([Event(1, 0, details=back)], {0: Holder(state="suspect")}, trained) == []


def test_a_summary_counts_for_its_own_agent_session_only() -> None:
    summary = {"committed": 4, "session": "a", "restored": {"0": 3}, "newest_at_restore": {"0": 5}}
    assert progress_of(summary, "a") == Progress(4, restored=3, reached=5)
    assert progress_of(summary, "b") is None, "a late heartbeat of the agent before"
    assert progress_of({"committed": 4}, "b") == Progress(4), "an agent too old to name its session"
    assert progress_of({"committed": -3, "session": "a"}, "a") == Progress(0), "through etcd, unvalidated"
