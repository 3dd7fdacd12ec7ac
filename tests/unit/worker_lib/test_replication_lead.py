"""How far ahead an aligned round's proposal leads (worker_lib.agent.replication, Replicator._needed_lead): by
the iterations committed while it travels to every machine. Heard with heartbeats, that is AGREE_PERIODS of
the root's answers; with the alignment pushed (the agent heartbeats at once and long-polls the root), the
answers come only when the alignment changes, a few times a round, and their period says nothing of the
travel: the lead follows the measured trips of this machine's own proposals to an answer naming them (with
the answers' period, the real root's aligned rounds led by 13-28 iterations of 0.13 s and waited for them)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker_lib.agent import replication
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.replication import Replicator


@pytest.fixture
def replicator(tmp_path: Path) -> Iterator[Replicator]:
    holdings = Holdings(tmp_path / "shm")
    made = Replicator(holdings, b"k" * 32, "job", [1], lambda machine: None)
    # Commits every 0.125 s and the root's answers every 2 s (a heartbeat-paced job, or a pushed alignment
    # that changed that seldom).
    made._commit_times.extend((0.125 * i, i) for i in range(10))
    made._answer_times.extend([0.0, 2.0, 4.0])
    yield made
    made.pacer.close()
    holdings.close()


def test_heard_with_heartbeats_the_lead_covers_the_answers_period(replicator: Replicator) -> None:
    assert replicator._needed_lead() == 40  # 2.5 periods of 2 s at 0.125 s an iteration


def test_pushed_the_lead_follows_the_measured_trips(replicator: Replicator) -> None:
    replicator.answers_pushed = True
    # Nothing measured yet: PUSHED_TRAVEL_S (0.1 s), rounded up to an iteration.
    assert replicator._needed_lead() == math.ceil(replication.PUSHED_TRAVEL_S / 0.125) == 1
    # A proposal named in an answer 20 ms later: under half an iteration: the newest commit.
    replicator._proposed = (10, time.monotonic() - 0.02)
    replicator.align(None, 12, False)
    assert replicator._proposed is None and len(replicator._travels) == 1
    assert replicator._needed_lead() == 0
    # A slow trip (the root busy): the longest of the last few counts.
    replicator._travels.append(0.5)
    assert replicator._needed_lead() == 4  # 0.5 s of 0.125 s iterations


def test_the_replication_age_is_never_negative_when_the_wall_clock_steps_back(replicator: Replicator) -> None:
    """A negative age fails the heartbeat's schema: the root refuses the whole heartbeat (REST) or records
    the summary empty (etcd)."""
    replicator.stats.replicated_at = time.time() + 60.0  # the last round, as stamped before the step back
    assert replicator.summary()["replication_age_s"] == 0.0
    replicator.stats.replicated_at = time.time() - 2.0
    age = replicator.summary()["replication_age_s"]
    assert age is not None and 2.0 <= age < 60.0


def test_a_restore_starts_the_pace_again(tmp_path: Path) -> None:
    """Two commits 1 s apart, a 30 s recovery, then the first commit after the restore: kept, the recovery
    would be an iteration of the pace (the upper median of two), and training that stopped after that commit
    would look stopped only STALL_ITERATIONS x 30 s later, its newest commit replicated no sooner."""
    holdings = Holdings(tmp_path / "shm")
    replicator = Replicator(holdings, b"k" * 32, "job", [1], lambda machine: None)
    try:
        now = time.monotonic()
        replicator._commit_times.extend([(now - 31.0, 0), (now - 30.0, 1)])
        replicator.resume(restored=1)
        replicator.notice_commit(0, 2)
        assert replicator._iteration_s() is None  # one commit since the restore: no pace yet
        replicator._last_commit_at = time.monotonic() - 2.0  # then nothing for 2 s
        assert replicator._stalled()
        replicator.notice_commit(0, 3)
        pace = replicator._iteration_s()
        assert pace is not None and pace < 1.0
    finally:
        replicator.pacer.close()
        holdings.close()
