"""A job's measured ETTR from its failure events: downtime by cause, overlaps counted once, lost work."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from services.root.domain.ettr import (
    CheckpointStall,
    FailureRecord,
    PhaseSpan,
    checkpoint_stall,
    measure_ettr,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def failure(start: float, phases: list[tuple[str, float]], lost: int | None = 0) -> FailureRecord:
    """Phases as (name, duration) back to back from `start`."""
    spans, t = [], start
    for name, seconds in phases:
        spans.append(PhaseSpan(name, at(t), at(t + seconds)))
        t += seconds
    return FailureRecord(at(start), tuple(spans), lost)


def test_no_failures_is_one() -> None:
    result = measure_ettr(started_at=T0, ended_at=at(3600), failures=[], iteration_s=2.0)
    assert result.ettr == 1.0 and result.wall_s == 3600 and result.productive_s == 3600
    assert result.checkpoint_overhead_s is None  # not measured, not zero


def test_not_started() -> None:
    result = measure_ettr(started_at=None, ended_at=at(10), failures=[], iteration_s=None)
    assert result.ettr is None and result.wall_s == 0


def test_causes_of_one_hardware_failure() -> None:
    hardware = failure(
        100, [("detect", 2), ("classify", 1), ("replace", 30), ("restore", 5), ("resume", 14)], lost=3
    )
    result = measure_ettr(started_at=T0, ended_at=at(1000), failures=[hardware], iteration_s=4.0)
    assert result.wasted_s == {
        "detection": 3.0,
        "replacement": 30.0,
        "restore": 5.0,
        "warmup": 10.0,  # the resume phase less its first iteration (kept work)
        "lost_iterations": 12.0,  # 3 iterations of 4 s
    }
    assert result.productive_s == pytest.approx(1000 - 60)
    assert result.ettr == pytest.approx(0.94)


def test_overlapping_failures_are_counted_once() -> None:
    first = failure(100, [("detect", 0), ("classify", 0), ("restore", 20), ("resume", 10)], lost=2)
    # A second failure 10 s into the first one's restore: one recovery, restarted.
    second = failure(110, [("detect", 0), ("classify", 0), ("restore", 30), ("resume", 10)], lost=2)
    result = measure_ettr(started_at=T0, ended_at=at(1000), failures=[first, second], iteration_s=1.0)
    downtime = sum(v for k, v in result.wasted_s.items() if k != "lost_iterations")
    assert downtime == pytest.approx(149 - 100)  # 100 -> 150, less the kept first iteration
    # 100-120 the first's restore, 120-129 its warm-up, 129-140 the second's restore, 140-149 its warm-up
    assert result.wasted_s["restore"] == pytest.approx(31) and result.wasted_s["warmup"] == pytest.approx(18)
    assert result.wasted_s["lost_iterations"] == 2.0  # one rollback, reported by both events


def test_separate_recoveries_each_lose_their_iterations() -> None:
    one = failure(100, [("detect", 0), ("restore", 1), ("resume", 1)], lost=2)
    two = failure(500, [("detect", 0), ("restore", 1), ("resume", 1)], lost=5)
    result = measure_ettr(started_at=T0, ended_at=at(1000), failures=[one, two], iteration_s=0.5)
    assert result.wasted_s["lost_iterations"] == 3.5


def test_recovery_under_way_counts_until_now_and_is_clipped_to_the_wall() -> None:
    ongoing = FailureRecord(
        at(900), (PhaseSpan("detect", at(900), at(900)), PhaseSpan("restore", at(900), at(1200))), None
    )
    result = measure_ettr(started_at=T0, ended_at=at(1000), failures=[ongoing], iteration_s=None)
    assert result.wasted_s["restore"] == 100.0 and result.ettr == pytest.approx(0.9)


def test_ettr_falls_with_more_failures() -> None:
    values = []
    for count in range(5):
        failures = [
            failure(100 + 100 * i, [("detect", 1), ("restore", 5), ("resume", 3)], lost=1)
            for i in range(count)
        ]
        values.append(measure_ettr(started_at=T0, ended_at=at(1000), failures=failures, iteration_s=1.0).ettr)
    assert values == sorted(values, reverse=True) and len(set(values)) == 5


def brute_force_downtime(failures: list[FailureRecord], iteration_s: float) -> dict[str, float]:
    """Second by second (in 0.5 s steps): the phase of the earliest failure under way."""
    from services.root.domain.ettr import PHASE_CAUSE

    out = dict.fromkeys(("detection", "replacement", "restore", "warmup"), 0.0)
    ordered = sorted(failures, key=lambda f: f.failed_at)
    for step in range(0, 2000):
        t = at(step * 0.5 + 0.25)
        for f in ordered:
            phase = next((p for p in f.phases if p.start <= t < p.end), None)
            if (
                phase is not None
                and phase.name == "resume"
                and t >= phase.end - timedelta(seconds=iteration_s)
            ):
                phase = None  # the kept first iteration
            if phase is not None:
                out[PHASE_CAUSE[phase.name]] += 0.5
                break
    return out


def test_overlap_attribution_matches_brute_force() -> None:
    import random

    rng = random.Random(7)
    for _ in range(30):
        failures = []
        for _ in range(rng.randint(1, 6)):
            start = rng.randint(0, 150) * 5.0
            names = ["detect", "classify", *(["replace"] if rng.random() < 0.5 else []), "restore", "resume"]
            failures.append(failure(start, [(n, rng.randint(0, 12) * 5.0) for n in names], lost=1))
        result = measure_ettr(started_at=T0, ended_at=at(1000), failures=failures, iteration_s=5.0)
        expected = brute_force_downtime(failures, 5.0)
        for cause, seconds in expected.items():
            assert result.wasted_s[cause] == pytest.approx(seconds), cause


def test_checkpoint_stalls_are_charged_as_wasted_time() -> None:
    stall = CheckpointStall(rank=3, seconds=5.0, saves=500)
    result = measure_ettr(started_at=T0, ended_at=at(1000), failures=[], iteration_s=2.0, stall=stall)
    assert result.checkpoint_overhead_s == 5.0
    assert result.productive_s == 995.0 and result.ettr == pytest.approx(0.995)
    assert sum(result.wasted_s.values()) == 0  # the other causes are untouched


def test_stalls_of_iterations_rolled_back_are_not_charged_twice() -> None:
    """3 iterations of 4 s lost: their 4 s already include their stalls (0.02 s a save), charged as lost."""
    lost = failure(100, [("detect", 1), ("restore", 4), ("resume", 5)], lost=3)
    stall = CheckpointStall(rank=0, seconds=8.0, saves=400)
    result = measure_ettr(started_at=T0, ended_at=at(1000), failures=[lost], iteration_s=4.0, stall=stall)
    assert result.wasted_s["lost_iterations"] == 12.0
    assert result.checkpoint_overhead_s == pytest.approx(8.0 - 3 * 0.02)
    downtime = 1 + 4 + (5 - 4)
    assert result.productive_s == pytest.approx(1000 - downtime - 12 - (8.0 - 0.06))
    # Without an iteration time nothing is charged for the lost iterations, so their stalls stay.
    unknown = measure_ettr(started_at=T0, ended_at=at(1000), failures=[lost], iteration_s=None, stall=stall)
    assert unknown.checkpoint_overhead_s == 8.0


def test_the_job_is_charged_its_slowest_rank_summed_over_the_machines_that_ran_it() -> None:
    summaries = [
        # machine 0 (ranks 0, 1), replaced after a failure; then its replacement
        {"stalled_s": {"0": 2.0, "1": 3.0}, "save_calls": {"0": 100, "1": 100}},
        {"stalled_s": {"0": 1.5, "1": 0.25}, "save_calls": {"0": 50, "1": 50}},
        # machine 1 (ranks 2, 3)
        {"stalled_s": {"2": 3.25, "3": 1.0}, "save_calls": {"2": 150, "3": 150}},
        {"local": {"4": 7}},  # an agent from before the figure
        {"stalled_s": {"x": 9.0, "5": -1.0, "6": float("nan"), "7": True}},  # junk from etcd: skipped
        {"stalled_s": [1.0]},
    ]
    assert checkpoint_stall(summaries) == CheckpointStall(rank=0, seconds=3.5, saves=150)
    assert checkpoint_stall([{"local": {}}, {}]) is None  # not measured, not zero
    assert checkpoint_stall([{"stalled_s": {"1": 0}, "save_calls": {"1": 4}}]) == CheckpointStall(1, 0.0, 4)


def test_lost_iterations_are_clipped_to_the_wall_time() -> None:
    """At the API's slowest accepted rate (1e-6 checkpoints a minute) one iteration lasts 60 million s: the
    lost work of 100 s of training was charged 1.3e17 s."""
    crash = failure(50, [("detect", 0), ("restore", 1), ("resume", 1)], lost=5)
    result = measure_ettr(started_at=T0, ended_at=at(100), failures=[crash], iteration_s=6e7)
    assert result.wasted_s["lost_iterations"] == 100.0 and result.ettr == 0.0
