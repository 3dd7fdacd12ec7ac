"""Interleaving (GEMINI's Algorithm 2): the idle spans of an iteration from training's busy spans, the
profile of a window of iterations, the sender's decisions, the partition of a checkpoint over idle spans,
and the communication board between a training process and its agent."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from worker_lib.agent import pacing
from worker_lib.agent.pacing import Pacer, replication_pacer
from worker_lib.api.worker import RegisterResponse
from worker_lib.comm_timing import CommBoard, CommTimer
from worker_lib.interleave import (
    CommProfile,
    IterationComm,
    chunk_size,
    idle_left,
    idle_spans,
    interval_bound,
    merge,
    next_grant,
    partition,
    profile,
)

MB = 1 << 20


def test_merge_joins_overlapping_spans_and_drops_empty_ones() -> None:
    assert merge([(0.5, 0.6), (0.1, 0.3), (0.2, 0.4), (0.7, 0.7)]) == [(0.1, 0.4), (0.5, 0.6)]


def test_idle_spans_are_the_gaps_and_the_tail_runs_into_the_next_iteration() -> None:
    # Forward 0-0.3 idle, backward's buckets 0.3-0.5 and 0.55-0.8, optimizer 0.8-1.0 idle.
    assert idle_spans([(0.3, 0.5), (0.55, 0.8)], 1.0) == [
        pytest.approx((0.5, 0.55)),
        pytest.approx((0.8, 1.3)),
    ]
    assert idle_spans([], 1.0) == [(0.0, 1.0)]  # no communication: all idle
    assert idle_spans([(0.0, 1.0)], 1.0) == []  # always communicating: nothing


def test_a_profile_takes_the_median_period_and_every_iterations_busy_time() -> None:
    iterations = [
        IterationComm(1.0, ((0.3, 0.5),)),
        IterationComm(1.2, ((0.35, 0.6),)),
        IterationComm(0.9, ((0.28, 0.5),)),
    ]
    found = profile(iterations)
    assert found is not None
    assert found.period == 1.0
    assert found.busy == ((0.28, 0.6),)  # an idle span is idle in every profiled iteration
    assert found.idle() == [pytest.approx((0.6, 1.28))]
    assert found.idle_fraction == pytest.approx(0.68)
    assert profile([]) is None


def test_one_late_iteration_does_not_erase_the_idle_span_of_the_others() -> None:
    # Eight iterations of 1 s whose all-reduce ends between 0.40 and 0.46 s, and one whose ends at 0.9 s (a
    # loaded host): the union would leave 0.1 s idle; the profile keeps the span the others had idle.
    ends = [0.40, 0.41, 0.42, 0.43, 0.44, 0.45, 0.46, 0.90]
    iterations = [IterationComm(1.0, ((0.2 + i * 0.01, end),)) for i, end in enumerate(ends)]
    found = profile(iterations)  # the default: a span outlasts 6 of the 8
    assert found is not None
    assert found.busy == (pytest.approx((0.2, 0.45)),)  # the earliest start, the third latest end
    assert found.idle_fraction == pytest.approx(0.75)
    seven = profile(iterations, coverage=0.875)  # outlasts 7 of the 8
    assert seven is not None and seven.busy == (pytest.approx((0.2, 0.46)),)
    union = profile(iterations, coverage=1.0)
    assert union is not None and union.busy == (pytest.approx((0.2, 0.9)),)
    assert union.idle_fraction == pytest.approx(0.3)
    # At 0.5 s into an iteration the sender may send (the late iteration is the in-flight check's).
    assert next_grant(found, 0.5, 0, 100 * MB, 100e6).size > 0
    assert next_grant(union, 0.5, 0, 100 * MB, 100e6).size == 0
    assert next_grant(found, 0.5, 1, 100 * MB, 100e6).size == 0


def test_the_profile_covers_most_iterations_and_every_recurring_pattern() -> None:
    # Three of eight iterations late (ends at 0.7 s): more than a quarter, so covered; two are not.
    found = profile([IterationComm(1.0, ((0.2, end),)) for end in [0.4] * 5 + [0.7] * 3])
    assert found is not None and found.busy == (pytest.approx((0.2, 0.7)),)
    found = profile([IterationComm(1.0, ((0.2, end),)) for end in [0.4] * 6 + [0.7] * 2])
    assert found is not None and found.busy == (pytest.approx((0.2, 0.4)),)
    # Two buckets whose spans alternate between iterations: both are busy in the profile (each recurs), and
    # the gap no iteration communicated in stays idle.
    iterations = [IterationComm(1.0, ((0.2, 0.3), (0.5, 0.6) if i % 2 else (0.6, 0.7))) for i in range(8)]
    found = profile(iterations)
    assert found is not None and found.busy == (pytest.approx((0.2, 0.3)), pytest.approx((0.5, 0.7)))
    # Overlapping buckets of one iteration count once: one iteration busy twice over is still one, and
    # three are needed.
    busy = [((0.2, 0.4), (0.3, 0.8))] * 2 + [((0.2, 0.4),)] * 6
    found = profile([IterationComm(1.0, spans) for spans in busy])
    assert found is not None and found.busy == (pytest.approx((0.2, 0.4)),)
    # A collective that starts early in one iteration only: the span starts there all the same (a chunk
    # granted before it would already be queued), while a collective seen in one iteration alone is left
    # out (the in-flight check holds the sender back while it runs).
    busy = [((0.1, 0.4),)] + [((0.2, 0.4),)] * 7
    found = profile([IterationComm(1.0, spans) for spans in busy])
    assert found is not None and found.busy == (pytest.approx((0.1, 0.4)),)
    busy = [((0.2, 0.4), (0.6, 0.7))] + [((0.2, 0.4),)] * 7
    found = profile([IterationComm(1.0, spans) for spans in busy])
    assert found is not None and found.busy == (pytest.approx((0.2, 0.4)),)
    # Few iterations: each is more than a quarter of them, and the profile is their union.
    found = profile([IterationComm(1.0, ((0.2, 0.4),)), IterationComm(1.0, ((0.3, 0.6),))])
    assert found is not None and found.busy == (pytest.approx((0.2, 0.6)),)


def test_the_profile_measures_the_quiet_gap_after_the_last_collective() -> None:
    # Two buckets per iteration whose end varies (0.5 to 0.8): the quiet time from the last one's end to
    # the next iteration's first start is 0.55 + 0.3 - 0.05 jitter. The profile's busy span ends late
    # (most iterations' ends), the gap follows the compute between them instead.
    ends = [0.5, 0.8, 0.6, 0.7, 0.5, 0.75, 0.55, 0.8]
    iterations = [IterationComm(end + 0.55, ((0.3, 0.4), (0.4, end))) for end in ends]
    found = profile(iterations)
    assert found is not None
    assert found.collectives == 2
    assert found.gap == pytest.approx(0.85)  # 0.55 after the end, and 0.3 into the next iteration
    assert found.busy[0][1] >= 0.75  # the phase alone leaves the quiet time after an early end unused
    # An iteration with a collective of its own (a third bucket) is no measure of the usual gap.
    odd = [*iterations[:4], IterationComm(1.0, ((0.3, 0.4), (0.4, 0.5), (0.6, 0.95))), *iterations[4:]]
    odd_found = profile(odd)
    assert odd_found is not None and odd_found.collectives == 2 and odd_found.gap == pytest.approx(0.85)
    # A short gap in a quarter of the iterations sets the gap: the sender must not run into the collective.
    short = [IterationComm(0.8 + (0.1 if i % 4 == 0 else 0.4), ((0.3, 0.4), (0.4, 0.8))) for i in range(8)]
    found = profile(short)
    assert found is not None and found.gap == pytest.approx(0.4)  # not the 0.7 of the other iterations
    assert profile([IterationComm(1.0, ())] * 3) == CommProfile(1.0, (), 0, 0.0)  # nothing to anchor on


def test_idle_left_counts_from_the_phase_and_wraps_the_head_of_the_iteration() -> None:
    found = CommProfile(1.0, ((0.3, 0.5),))
    assert idle_left(found, 0.6) == pytest.approx(0.7)  # 0.6 -> 1.3
    assert idle_left(found, 0.1) == pytest.approx(0.2)  # before the first bucket: 0.1 -> 0.3
    assert idle_left(found, 0.4) == 0.0  # training communicates
    assert idle_left(found, 1.4) == 0.0  # late: the next iteration's communication is due


def test_chunks_are_sized_to_drain_inside_the_span() -> None:
    # 0.5 s idle at 100 MB/s: mu 0.8 of it less 2 ms startup is 39.8 MB, capped at R/p (32 MiB).
    assert chunk_size(0.5, 100e6) == 32 * MB
    assert chunk_size(0.1, 100e6) == int((0.08 - 0.002) * 100e6)
    assert chunk_size(0.001, 100e6) == 0  # less than the startup time
    assert chunk_size(0.5, 100e6, chunk_max=MB) == MB


def test_the_sender_sends_only_in_idle_spans_and_waits_for_the_next_one() -> None:
    found = CommProfile(1.0, ((0.3, 0.5),))
    bandwidth = 100e6
    # In the optimizer/forward span: a chunk that fits what is left of it.
    grant = next_grant(found, 0.9, 0, 100 * MB, bandwidth, chunk_max=100 * MB)
    assert grant.size == int((0.8 * 0.4 - 0.002) * bandwidth)
    # Never more than asked for.
    assert next_grant(found, 0.9, 0, 1000, bandwidth).size == 1000
    # In a busy span: wait until it ends.
    grant = next_grant(found, 0.35, 0, 100 * MB, bandwidth)
    assert grant.size == 0 and grant.wait_s == pytest.approx(0.15)
    # Training is on the wire now, whatever the profile says: hold back.
    grant = next_grant(found, 0.9, 1, 100 * MB, bandwidth)
    assert grant.size == 0 and grant.wait_s > 0
    # Without a profile nothing is known to protect.
    assert next_grant(None, 0.35, 0, 100 * MB, bandwidth).size == 32 * MB


def test_a_collective_that_ended_early_opens_the_gap_after_it() -> None:
    # Busy 0.3-0.8 by the profile; this iteration's collectives all ended at 0.45, and the gap after the
    # last collective is 0.4 (to the next iteration's first at about 0.85).
    found = CommProfile(1.0, ((0.3, 0.8),), collectives=1, gap=0.4)
    bandwidth = 100e6
    assert next_grant(found, 0.5, 0, 100 * MB, bandwidth).size == 0  # the phase alone: busy
    granted = next_grant(found, 0.5, 0, 100 * MB, bandwidth, quiet_for=0.05).size
    # Up to mu of the whole gap (0.32 s), of which 0.05 s passed.
    assert granted > 0 and granted == pytest.approx((0.8 * 0.4 - 0.05 - 0.002) * bandwidth, abs=1)
    # The gap's last (1 - mu) is a guard: a quarter of the iterations had a shorter gap than the profile's.
    assert next_grant(found, 0.5, 0, 100 * MB, bandwidth, quiet_for=0.33).size == 0
    assert next_grant(found, 0.5, 0, 100 * MB, bandwidth, quiet_for=0.5).size == 0  # the gap is over
    assert next_grant(found, 0.5, 1, 100 * MB, bandwidth, quiet_for=0.05).size == 0  # on the wire again
    # Past the phase's own idle span the longer of the two counts: the phase at 0.9 leaves 0.4 s.
    assert next_grant(found, 0.9, 0, 100 * MB, bandwidth, quiet_for=0.39).size == pytest.approx(
        chunk_size(0.4, bandwidth), abs=1
    )
    # Without a measured gap (an older board, no collectives) the phase decides.
    assert next_grant(CommProfile(1.0, ((0.3, 0.8),)), 0.5, 0, MB, bandwidth, quiet_for=0.0).size == 0


def test_algorithm_2_partitions_a_checkpoint_over_the_spans_and_spills_into_the_last() -> None:
    bandwidth = 100e6
    # Spans of 0.5 s and 0.25 s: 0.4 s and 0.2 s usable (mu 0.8); 100 MB and 2 copies = 200 MB.
    parts = partition([0.5, 0.25, 0.5], 100 * 10**6, 2, bandwidth, chunk_max=32 * 10**6)
    assert sum(map(sum, parts)) == 200 * 10**6  # every byte of both copies
    first, second, last = parts
    assert sum(first) <= 0.4 * bandwidth and sum(second) <= 0.2 * bandwidth
    assert max(max(p) for p in parts if p) <= 32 * 10**6
    assert sum(last) == 200 * 10**6 - sum(first) - sum(second)  # the leftover: the last span is infinite
    # Enough idle time: the last span is not needed.
    parts = partition([10.0, 10.0], 10**6, 1, bandwidth)
    assert parts == [[10**6]]


def test_the_interval_bound_rounds_up() -> None:
    # 100 MB over 0.25 of a 1 s iteration at 100 MB/s: 4 iterations; a little more: 5.
    assert interval_bound(100 * 10**6, 0.25, 100e6, 1.0) == 4
    assert interval_bound(100 * 10**6 + 1, 0.25, 100e6, 1.0) == 5


def test_the_board_carries_the_profile_the_start_and_the_collectives_in_flight(tmp_path: Path) -> None:
    board = CommBoard(tmp_path / "comm-timing", create=True)
    reader = CommBoard.open(tmp_path / "comm-timing")
    assert reader is not None and CommBoard.open(tmp_path / "missing") is None
    timer = CommTimer(board, warmup=1, window=3, every=2)
    # Drive the timer as the hooks would, with real time.monotonic() stamps: the shape matters, not values.
    for _ in range(6):
        timer.iteration_start()
        started = timer.comm_started()
        state = reader.read()
        assert state is not None and state.in_flight == 1
        timer.comm_finished(started)
    state = reader.read()
    assert state is not None
    assert state.in_flight == 0 and state.iterations == 6 and state.iteration_start > 0
    assert state.profile is not None and timer.profile is not None
    assert state.profile.period == pytest.approx(timer.profile.period)
    assert state.profile.busy == timer.profile.busy  # doubles, as written
    assert state.profile.collectives == timer.profile.collectives == 1
    assert state.profile.gap == pytest.approx(timer.profile.gap)
    # The iteration's one collective ended: quiet since then, across the next iteration's start, until the
    # next collective starts.
    assert state.quiet_since >= state.iteration_start > 0
    timer.iteration_start()
    quiet = reader.read()
    assert quiet is not None and quiet.quiet_since == state.quiet_since
    started = timer.comm_started()
    busy = reader.read()
    assert busy is not None and busy.quiet_since == 0.0 and busy.in_flight == 1
    timer.comm_finished(started)
    again = reader.read()
    assert again is not None and again.quiet_since >= started
    board.close()
    reader.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_interleaved_pacer_grants_nothing_while_training_communicates(tmp_path: Path) -> None:
    path = tmp_path / "comm-timing"
    board = CommBoard(path, create=True)
    clock = FakeClock()
    board.publish(CommProfile(1.0, ((0.3, 0.5),)), clock.now)
    pacer = Pacer("interleaved", boards=lambda: [path], clock=clock)
    pacer.bandwidth = 100e6
    # Iteration started 0.9 s ago: in the idle span, a chunk that fits.
    board.iteration_started(clock.now - 0.9, 10)
    assert 0 < pacer.grant(100 * MB, lambda: 0) <= 0.4 * 100e6
    pacer.finished()  # the put is over: the wire is free
    assert len(pacer.windows) == 1
    # A collective in flight: nothing, once the grant's patience is spent (the clock moved on meanwhile).
    board.set_in_flight(1)
    done = threading.Event()
    result: list[int] = []

    def ask() -> None:
        result.append(pacer.grant(MB, lambda: 0))
        done.set()

    thread = threading.Thread(target=ask)
    clock_mover = threading.Timer(0.05, lambda: setattr(clock, "now", clock.now + 1.0))
    clock_mover.start()
    thread.start()
    assert done.wait(5)
    assert result == [0]
    pacer.finished()
    pacer.close()
    board.close()


@pytest.mark.parametrize("gap", [0.0, 0.05])
def test_a_grant_that_must_wait_past_its_patience_sleeps_it_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gap: float
) -> None:
    # The next idle span opens later than a grant waits (WAIT_MAX_S): the grant still sleeps its patience
    # before it answers 0, or the sender (which asks again at once) spins for the whole wait. With a gap in
    # the profile, a collective ending early would open it: then it looks again every POLL_S.
    path = tmp_path / "comm-timing"
    board = CommBoard(path, create=True)
    clock = FakeClock()
    board.publish(CommProfile(1.0, ((0.1, 0.9),), collectives=1, gap=gap), clock.now)
    pacer = Pacer("interleaved", boards=lambda: [path], clock=clock)
    pacer.bandwidth = 100e6
    board.iteration_started(clock.now - 0.2, 10)  # in the busy span, nothing on the wire: 0.7 s to wait
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(pacing.time, "sleep", sleep)
    assert pacer.grant(MB, lambda: 0) == 0
    assert sum(slept) == pytest.approx(pacing.WAIT_MAX_S)
    assert max(slept) == pytest.approx(pacing.POLL_S if gap else 0.05)
    pacer.finished()
    pacer.close()
    board.close()


def test_the_pacer_sends_in_the_quiet_gap_after_training_communicated(tmp_path: Path) -> None:
    path = tmp_path / "comm-timing"
    board = CommBoard(path, create=True)
    clock = FakeClock()
    board.publish(CommProfile(1.0, ((0.3, 0.8),), collectives=1, gap=0.5), clock.now)
    pacer = Pacer("interleaved", boards=lambda: [path], clock=clock)
    pacer.bandwidth = 50e6
    board.iteration_started(clock.now - 0.5, 10)  # by the phase, the collective still runs
    board.set_in_flight(0, clock.now - 0.05)  # it ended 50 ms ago: 0.45 s of the 0.5 s gap left
    granted = pacer.grant(100 * MB, lambda: 0)
    # Up to mu of the whole gap (0.4 s), of which 0.05 s passed, less the startup time.
    assert granted == pytest.approx((0.8 * 0.5 - 0.05 - 0.002) * 50e6, abs=1)
    pacer.finished()
    pacer.close()
    board.close()


def test_the_policy_and_cap_come_from_the_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASTOR_REPLICATION_POLICY", raising=False)
    # Only the fields the pacer reads (model_construct fills the others' defaults, or leaves them out).
    eager = RegisterResponse.model_construct(replication_policy="eager", replication_bandwidth_gbps=0.8)
    pacer = replication_pacer(eager, list)
    assert pacer.policy == "eager" and pacer.cap == pytest.approx(1e8)
    assert replication_pacer(RegisterResponse.model_construct(), list).policy == "interleaved"
    monkeypatch.setenv("CASTOR_REPLICATION_POLICY", "eager")
    interleaved = RegisterResponse.model_construct(replication_policy="interleaved")
    assert replication_pacer(interleaved, list).policy == "eager"
    with pytest.raises(ValueError):
        Pacer("lazy")
