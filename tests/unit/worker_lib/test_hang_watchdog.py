"""The hang watchdog's bookkeeping (worker_lib/agent/watchdog.py): when a silent rank counts as hung."""

from __future__ import annotations

import math

import pytest

from worker_lib.agent.watchdog import AUTO_FLOOR_S, HangPolicy, HangWatch, Overdue


def test_a_rank_is_watched_from_its_first_commit_and_reported_once_per_stall() -> None:
    watch = HangWatch(HangPolicy(timeout_s=10), generation=2)
    assert watch.overdue(1_000.0) == [], "nothing committed yet: still starting, not hung"
    watch.committed(0, 5, now=0.0)
    watch.committed(1, 5, now=0.0)
    watch.committed(1, 6, now=8.0)
    assert watch.overdue(9.0) == []
    assert watch.overdue(10.5) == [Overdue(0, 10.5, 10, 5)]
    assert watch.overdue(11.0) == [], "reported once"
    assert watch.overdue(18.5) == [Overdue(1, 10.5, 10, 6)]
    watch.committed(0, 6, now=20.0)  # it moved again: a later stall is a new one
    assert watch.overdue(30.5) == [Overdue(0, 10.5, 10, 6)]


def test_auto_limit_is_a_multiple_of_the_longest_gap_with_a_floor() -> None:
    policy = HangPolicy(factor=10, floor_s=60)
    watch = HangWatch(policy, generation=1)
    watch.committed(0, 0, now=0.0)
    watch.committed(0, 1, now=2.0)  # 2 s iterations: 10 x 2 = 20 s, below the floor
    assert watch.overdue(2.0 + 59) == []
    assert [o.limit_s for o in watch.overdue(2.0 + 61)] == [60]
    watch.committed(0, 2, now=100.0)  # a 98 s gap (an evaluation pass): the limit grows to 980 s
    assert watch.overdue(100.0 + 900) == []
    assert [o.limit_s for o in watch.overdue(100.0 + 981)] == [980]


def test_a_zero_timeout_turns_the_watchdog_off() -> None:
    watch = HangWatch(HangPolicy.parse("0"), generation=1)
    watch.committed(0, 0, now=0.0)
    assert not watch.policy.enabled and watch.policy.limit_s(1.0) == math.inf
    assert watch.overdue(1e9) == []


def test_next_check_comes_no_later_than_the_earliest_deadline_nor_than_a_second() -> None:
    watch = HangWatch(HangPolicy(timeout_s=3), generation=1)
    assert watch.next_check_in(0.0) == 1.0
    watch.committed(0, 0, now=0.0)
    assert watch.next_check_in(2.5) == pytest.approx(0.5)
    assert watch.next_check_in(0.0) == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("auto", HangPolicy()), (" AUTO ", HangPolicy()), ("0", HangPolicy(0.0)), ("90.5", HangPolicy(90.5))],
)
def test_parse(text: str, expected: HangPolicy) -> None:
    assert HangPolicy.parse(text) == expected
    assert HangPolicy().limit_s(0.0) == AUTO_FLOOR_S


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf", ""])
def test_parse_refuses_what_is_not_a_timeout(text: str) -> None:
    with pytest.raises(ValueError, match="'auto', 0 \\(off\\) or a number of seconds"):
        HangPolicy.parse(text)
