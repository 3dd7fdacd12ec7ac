"""What checkpointing costs the training thread: `stats.stalled_s` counts every second it is blocked inside
Castor (save() calls, and waits for a copy at the optimizer step and in wait()), over `save_calls`,
and every notice to the agent carries both (issue 14, item 1: the checkpoint overhead of a job's ETTR).

The copies are held back by a gate that only a timer opens, so each wait is at least the timer's delay by
construction: the tests assert lower bounds that cannot fail by chance, never that anything is fast."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from worker_lib import Checkpointer

HELD_S = 0.2  # how long the gate holds a copy back once the test lets the timer run


@pytest.fixture
def gated() -> Iterator[Callable[[Checkpointer], threading.Event]]:
    """Make a Checkpointer's copies wait for an event; the test opens it with a timer."""
    timers: list[threading.Timer] = []

    def gate(checkpointer: Checkpointer) -> threading.Event:
        opened = threading.Event()
        write = checkpointer._write

        def gated_write(*args: Any) -> None:
            opened.wait(30)
            write(*args)

        checkpointer._write = gated_write  # type: ignore[method-assign]
        return opened

    def open_later(opened: threading.Event) -> None:
        # The timer starts before the waiting call does (on a loaded host, up to a scheduling slice or
        # more before it), and the copy behind the gate takes about a millisecond: the margin keeps each
        # measured wait above HELD_S.
        timer = threading.Timer(HELD_S + 0.3, opened.set)
        timers.append(timer)
        timer.start()

    gate.open_later = open_later  # type: ignore[attr-defined]
    yield gate
    for timer in timers:
        timer.join()


def test_a_blocking_save_counts_its_whole_call_as_a_stall(shm_dir: Path, gated: Any) -> None:
    tensor = torch.randn(2_000_000)  # 8 MB
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        assert checkpointer.stats.stalled_s == 0 and checkpointer.stats.save_calls == 0
        opened = gated(checkpointer)
        gated.open_later(opened)
        assert checkpointer.save(1, {"x": tensor})
        first = checkpointer.stats
        assert first.save_calls == 1 and first.saves_committed == 1
        assert first.stalled_s == first.last_save_s >= HELD_S  # the copy ran inside save()
        assert checkpointer.save(2, {"x": tensor})  # the gate is open now: a plain blocking save
        second = checkpointer.stats
    assert second.save_calls == 2
    assert second.stalled_s == pytest.approx(first.stalled_s + second.last_save_s)
    assert second.last_save_s > 0


def test_the_optimizer_step_waiting_for_the_copy_is_a_stall(shm_dir: Path, gated: Any) -> None:
    model = nn.Linear(256, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4, 256)).sum().backward()
    with Checkpointer(shm_dir) as checkpointer:
        opened = gated(checkpointer)
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        after_save = checkpointer.stats
        assert after_save.save_calls == 1 and after_save.saves_committed == 0  # the copy is held back
        gated.open_later(opened)
        optimizer.step()  # the step pre-hook waits for the copy: at least HELD_S from here
        after_step = checkpointer.stats
        assert after_step.saves_committed == 1
        assert after_step.stalled_s - after_save.stalled_s >= HELD_S
        optimizer.step()  # nothing pending: no wait, nothing counted
        assert checkpointer.stats.stalled_s == after_step.stalled_s
    assert checkpointer.stats.save_calls == 1


def test_wait_waiting_for_the_copy_is_a_stall_and_a_forward_never_waits(shm_dir: Path, gated: Any) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    with Checkpointer(shm_dir) as checkpointer:
        opened = gated(checkpointer)
        checkpointer.save(1, {"model": model})
        before = checkpointer.stats.stalled_s
        # BatchNorm updates its buffers, which save() captured: the forward runs with the copy held back.
        model(torch.randn(16, 8))
        assert checkpointer.stats.stalled_s == before and checkpointer.stats.saves_committed == 0
        gated.open_later(opened)
        checkpointer.wait()
        assert checkpointer.stats.stalled_s - before >= HELD_S

        opened = gated(checkpointer)
        checkpointer.save(2, {"model": model})
        before = checkpointer.stats.stalled_s
        gated.open_later(opened)
        checkpointer.wait()
        assert checkpointer.stats.stalled_s - before >= HELD_S
        assert checkpointer.stats.saves_committed == 2


def test_restore_and_close_are_not_training_stalls(shm_dir: Path, gated: Any) -> None:
    checkpointer = Checkpointer(shm_dir)
    opened = gated(checkpointer)
    checkpointer.save(1, {"x": torch.ones(4)})
    before = checkpointer.stats.stalled_s
    gated.open_later(opened)
    checkpointer.close()  # waits for the copy, at the end of training
    assert checkpointer.stats.stalled_s == before and checkpointer.stats.saves_committed == 1


def test_notices_carry_the_stall_so_far(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "agent.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    monkeypatch.setenv("CASTOR_AGENT_NOTIFY", str(path))
    monkeypatch.setenv("RANK", "1")
    try:
        with Checkpointer(shm_dir, blocking=True) as checkpointer:
            checkpointer.save(1, {"x": torch.ones(1000)})
            checkpointer.save(2, {"x": torch.ones(1000)})
            stats = checkpointer.stats
        notices = [json.loads(receiver.recv(65536)) for _ in range(3)]
    finally:
        receiver.close()
    assert [n["event"] for n in notices] == ["commit", "commit", "finished"]
    assert {n["pid"] for n in notices} == {os.getpid()}
    # A blocking save's commit notice leaves from inside that save() call: it carries the calls before it.
    assert [n["save_calls"] for n in notices] == [0, 1, 2]
    assert notices[0]["stalled_s"] == 0 and 0 < notices[1]["stalled_s"] <= notices[2]["stalled_s"]
    assert notices[2]["stalled_s"] == stats.stalled_s
