"""What a job's agents do on a timer, they must not do together: agents start together (a job's start, the
change that answered every long poll), and a fixed period from a common start keeps them together for
good. At 1,000 machines the summaries' puts and the idle long polls' answers each came as a thousand in
one second, and the lease refreshes behind them waited up to 1.2 s (benchmarks/scale.py)."""

from __future__ import annotations

import random

import pytest

from services.root.flows.directives import IDLE_ANSWER_MIN_FRACTION, idle_answer_after
from worker_lib.agent.heartbeat import next_summary_due

AGENTS = 1000


def busiest_tenth(times: list[float], start: float, length: float) -> float:
    """The largest share of `times` that falls in one tenth of [start, start + length)."""
    counts = [0] * 10
    for at in times:
        counts[min(9, int((at - start) / length * 10))] += 1
    return max(counts) / len(times)


@pytest.fixture(autouse=True)
def seeded() -> None:
    random.seed(20261128)  # the spread is random; the figures checked hold with any seed but a silly one


def test_agents_starting_together_rewrite_their_summaries_spread_over_the_period() -> None:
    period = 10.0
    second = [next_summary_due(None, 0.0, period) for _ in range(AGENTS)]
    assert all(0.0 <= at <= period for at in second)
    assert busiest_tenth(second, 0.0, period) < 0.15, "a tenth of the period holds about a tenth of them"
    third = [next_summary_due(at, at, period) for at in second]
    assert [b - a for a, b in zip(second, third, strict=True)] == pytest.approx([period] * AGENTS), (
        "after the first, every period: the spread stays"
    )


def test_puts_held_back_together_keep_their_own_phases() -> None:
    """A stall (slow refreshes during a burst of registrations) holds every agent's put back, and they
    are all made at the same moment once it ends: their next rewrites keep the phases they had."""
    period, released = 10.0, 14.0
    due = [5.0 + 5.0 * random.random() for _ in range(AGENTS)]  # due at 5-10 s, all made at 14 s
    after = [next_summary_due(at, released, period) for at in due]
    assert after == pytest.approx([at + period for at in due])
    assert busiest_tenth(after, 15.0, 5.0) < 0.15, "not all at 24 s"
    lost = [next_summary_due(at, at + 2.5 * period, period) for at in due]  # more than a period late
    assert all(at + 2.5 * period <= nxt <= at + 3.5 * period for at, nxt in zip(due, lost, strict=True))


def test_long_polls_begun_together_are_answered_spread_over_the_wait() -> None:
    wait = 20.0
    answered = [idle_answer_after(wait) for _ in range(AGENTS)]
    earliest = wait * IDLE_ANSWER_MIN_FRACTION
    assert all(earliest <= at <= wait for at in answered), "never later than asked, never before the floor"
    assert busiest_tenth(answered, earliest, wait - earliest) < 0.15
    assert idle_answer_after(0.0) == 0.0, "a poll that asked not to wait is answered at once"
