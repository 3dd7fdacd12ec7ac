"""An asynchronous save of host tensors copies on SCHED_IDLE threads, so it takes only the cycles training
leaves; training that needs the state back joins the copy (CopyEngine.help) instead of waiting for threads
a busy host may never run. The tests hold copies back with events, never with timing."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from worker_lib import Checkpointer
from worker_lib.store import copy as copy_module
from worker_lib.store.copy import COPY_IDLE_ENV, CopyEngine, Piece, StripePlan

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")


def _stripes(count: int) -> list[StripePlan]:
    return [StripePlan.of(i, i + 1, [Piece(0, i, i + 1, i, 0)]) for i in range(count)]


class _Held:
    """A transfer that notes which thread copied each piece, at which scheduling policy, and holds the
    pieces named in `hold` until their events are set."""

    def __init__(self, hold: dict[int, threading.Event] | None = None, fail: int | None = None):
        self.copied: dict[int, tuple[int, int]] = {}  # piece -> (thread ident, policy)
        self.started = {piece: threading.Event() for piece in hold or {}}
        self._hold = hold or {}
        self._fail = fail

    def copy(self, lo: int, hi: int) -> None:
        if lo in self._hold:
            self.started[lo].set()
            assert self._hold[lo].wait(30)
        if lo == self._fail:
            raise ValueError(f"piece {lo} cannot be copied")
        self.copied[lo] = (threading.get_ident(), os.sched_getscheduler(0))


def _copy_in_background(engine: CopyEngine, transfer: _Held, count: int) -> tuple[threading.Thread, list]:
    outcome: list[object] = []

    def run() -> None:
        try:
            engine.copy(_stripes(count), [transfer], beside_training=True)
            outcome.append("done")
        except Exception as raised:
            outcome.append(raised)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _policies(threads: list[threading.Thread]) -> set[int]:
    return {os.sched_getscheduler(thread.native_id or 0) for thread in threads}


def test_a_copy_beside_training_runs_on_the_caller_and_idle_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COPY_IDLE_ENV, raising=False)
    engine = CopyEngine(3)
    try:
        transfer = _Held()
        engine.copy(_stripes(20), [transfer], beside_training=True)
        assert sorted(transfer.copied) == list(range(20))
        caller = threading.get_ident()
        # The calling thread (a save's background thread) copies at normal priority, every other at idle.
        for thread, policy in transfer.copied.values():
            assert policy == (os.SCHED_OTHER if thread == caller else os.SCHED_IDLE)
        idle = [thread for thread in threading.enumerate() if thread.name.startswith("castor-idle-copy")]
        assert idle and all(thread.native_id for thread in idle)
        deadline = time.monotonic() + 30  # a thread takes its policy once it first runs
        while _policies(idle) != {os.SCHED_IDLE} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _policies(idle) == {os.SCHED_IDLE}
        # Any other copy (a restore, a blocking save) runs on the normal threads.
        other = _Held()
        engine.copy(_stripes(20), [other])
        assert {policy for _, policy in other.copied.values()} == {os.SCHED_OTHER}
    finally:
        engine.close()


def test_with_idle_copies_turned_off_a_copy_beside_training_runs_as_any_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(COPY_IDLE_ENV, "0")
    engine = CopyEngine(2)
    try:
        transfer = _Held()
        engine.copy(_stripes(20), [transfer], beside_training=True)
        assert {policy for _, policy in transfer.copied.values()} == {os.SCHED_OTHER}
    finally:
        engine.close()


def test_a_thread_that_helps_copies_what_the_idle_threads_have_not_started() -> None:
    release = threading.Event()
    transfer = _Held(hold={0: release})
    engine = CopyEngine(1)
    try:
        copying, outcome = _copy_in_background(engine, transfer, 10)
        assert transfer.started[0].wait(30)  # the one idle thread is held in piece 0 (a starved thread)
        engine.help()
        assert {piece: thread for piece, (thread, _) in transfer.copied.items()} == dict.fromkeys(
            range(1, 10), threading.get_ident()
        )
        assert outcome == []  # piece 0 is not copied yet: the copy has not returned
        release.set()
        copying.join(30)
        assert outcome == ["done"] and sorted(transfer.copied) == list(range(10))
        engine.help()  # no copy under way: nothing to do
    finally:
        release.set()
        engine.close()


def test_a_copy_returns_only_once_its_helpers_have_finished_their_pieces() -> None:
    idle_release, helper_release = threading.Event(), threading.Event()
    transfer = _Held(hold={0: idle_release, 1: helper_release})
    engine = CopyEngine(1)
    try:
        copying, outcome = _copy_in_background(engine, transfer, 2)
        assert transfer.started[0].wait(30)
        helper = threading.Thread(target=engine.help)
        helper.start()
        assert transfer.started[1].wait(30)  # the helper holds piece 1
        idle_release.set()  # the idle thread finishes piece 0 and finds nothing left
        copying.join(0.5)
        assert outcome == [] and 1 not in transfer.copied, "returned while a helper was still copying"
        helper_release.set()
        helper.join(30)
        copying.join(30)
        assert outcome == ["done"] and sorted(transfer.copied) == [0, 1]
    finally:
        idle_release.set()
        helper_release.set()
        engine.close()


def test_a_helpers_failure_is_raised_by_the_copy_it_helped() -> None:
    release = threading.Event()
    transfer = _Held(hold={0: release}, fail=3)
    engine = CopyEngine(1)
    try:
        copying, outcome = _copy_in_background(engine, transfer, 6)
        assert transfer.started[0].wait(30)
        engine.help()  # fails at piece 3: the helper returns, the copy raises it
        release.set()
        copying.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], ValueError) and "piece 3" in str(outcome[0])
    finally:
        release.set()
        engine.close()


def test_training_that_waits_for_a_save_copies_it_when_the_idle_threads_never_run(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extreme of a host whose cores are all busy: the idle threads never start. optimizer.step() (its
    fence) and wait() still complete every save, bit-exact: the save's own thread and training copy it."""
    never = threading.Event()
    idle_threads: list[int] = []

    def never_runs() -> None:
        idle_threads.append(threading.get_ident())
        never.wait(120)

    monkeypatch.delenv(COPY_IDLE_ENV, raising=False)
    monkeypatch.setattr(copy_module, "_run_when_idle", never_runs)
    model = torch.nn.Linear(2048, 2048)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = Checkpointer(shm_dir, threads=3)  # 16 MB: 8 stripes for the saving thread and two idle
    saved: dict[str, torch.Tensor] = {}

    def train() -> None:
        for iteration in (1, 2):
            model(torch.randn(4, 2048)).sum().backward()
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer})
            saved.update({name: tensor.clone() for name, tensor in model.state_dict().items()})
            optimizer.step()  # waits for the save, copying along
            assert checkpointer.stats.saves_committed == iteration
        checkpointer.save(3, {"model": model})
        checkpointer.wait()

    try:
        training = threading.Thread(target=train)
        training.start()
        training.join(60)
        assert not training.is_alive(), "training waited for idle threads that never ran"
        assert idle_threads, "the save did not copy on the idle threads"
        assert checkpointer.stats.saves_committed == 3
        fresh = torch.nn.Linear(2048, 2048)
        restored = checkpointer.restore(into={"model": fresh}, iteration=2)
        assert restored is not None and restored.iteration == 2
        assert saved and all(torch.equal(fresh.state_dict()[name], tensor) for name, tensor in saved.items())
    finally:
        never.set()
        checkpointer.close()


def test_a_blocking_save_copies_at_normal_priority_on_the_training_thread(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    monkeypatch.delenv(COPY_IDLE_ENV, raising=False)
    monkeypatch.setattr(copy_module, "_run_when_idle", lambda: made.append(1))
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(1, {"x": torch.randn(1_000_000)})
    assert made == []


def test_a_bad_copy_idle_setting_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COPY_IDLE_ENV, "maybe")
    with pytest.raises(ValueError, match=r"CASTOR_COPY_IDLE='maybe': expected 1 .* or 0"):
        Checkpointer(tmp_path / "store")
    assert not (tmp_path / "store").exists()
