"""Crash safety of the shared-memory store: a process saving checkpoints in a tight loop is killed with
SIGKILL at random instants, and at named instants of the commit; each time, restore returns a complete
checkpoint, bit-exact equal to one that was committed, never older than the newest one reported committed.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.worker_lib.helpers import assert_bit_equal, forkserver
from worker_lib import Checkpointer
from worker_lib.store.faults import PAUSE_ENV, PHASES
from worker_lib.store.slots import SlotStore

pytestmark = pytest.mark.slow

RANDOM_KILLS = 60
PAUSES_PER_PHASE = 4


def expected_state(iteration: int) -> dict[str, Any]:
    """A state whose every tensor depends on the iteration (a torn or mislabelled checkpoint cannot match),
    about 3 MiB and cheap to build, so that most of the child's time goes to saving. Its structure changes
    every few iterations (new keys, a new shape), so kills also land in saves that lay the slots out anew."""
    value = float(iteration)
    return {
        "iteration": iteration,
        "weights": torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024).add_(value),
        "moments": [torch.full((100_000,), value), torch.full((100_000,), -value)],
        "resized": torch.arange(1000 + 5000 * ((iteration // 7) % 3), dtype=torch.float64).mul_(value),
        "bf16": torch.full((3000,), value, dtype=torch.bfloat16),
        "extra": {f"t{k}": torch.full((100,), value + k) for k in range((iteration // 5) % 3)},
        "tag": str(iteration).encode(),
    }


def save_forever(
    directory: str, start: int, blocking: bool, pause_at: str | None, reports: Connection
) -> None:
    """Child process: save iteration after iteration; report each one once its save has committed."""
    if pause_at:
        os.environ[PAUSE_ENV] = pause_at
    with Checkpointer(directory, blocking=blocking) as checkpointer:
        iteration = start
        while True:
            checkpointer.save(iteration, expected_state(iteration))
            checkpointer.wait()
            reports.send(iteration)
            iteration += 1


@pytest.fixture
def store_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh store in /dev/shm, restored from as a standalone run would (no recovery plan)."""
    monkeypatch.delenv("CASTOR_RESTORE_ITERATION", raising=False)
    path = Path(tempfile.mkdtemp(prefix="castor-crash-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_until_stopped(pid: int, timeout: float = 60) -> None:
    """Until the child stopped itself at its pause point (state T in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        if state in "Tt":
            return
        assert state not in "ZX", "the child died before its pause point"
        time.sleep(0.001)
    raise AssertionError("the child never reached its pause point")


def test_a_killed_saver_always_leaves_the_newest_committed_checkpoint(store_dir: Path) -> None:
    rng = random.Random(1234)
    context = forkserver()
    paused = [f"{phase}@{n}" for phase in PHASES for n in range(1, PAUSES_PER_PHASE + 1)]
    rest: list[str | None] = [None] * (RANDOM_KILLS - 1) + paused
    rng.shuffle(rest)
    newest_reported: int | None = None
    for trial, pause_at in enumerate([None, *rest]):  # the first trial commits something to start from
        start = 0 if newest_reported is None else newest_reported + 1
        reports, child_end = context.Pipe(duplex=False)
        blocking = trial % 2 == 0
        child = context.Process(
            target=save_forever, args=(str(store_dir), start, blocking, pause_at, child_end)
        )
        child.start()
        child_end.close()
        assert child.pid is not None
        if pause_at:
            wait_until_stopped(child.pid)
        else:
            assert reports.poll(60), "the child committed nothing"
            time.sleep(rng.uniform(0, 0.03))
        child.kill()
        child.join(60)
        assert child.exitcode == -9
        while reports.poll():
            try:
                newest_reported = reports.recv()
            except EOFError:
                break
        reports.close()

        where = f"trial {trial}, killed at {pause_at or 'a random instant'}"
        with Checkpointer(store_dir) as checkpointer:
            restored = checkpointer.restore()
            # Every checkpoint the store still calls committed is complete, not only the newest one.
            for manifest in SlotStore(store_dir).committed():
                older = checkpointer.restore(iteration=manifest.iteration)
                assert older is not None, where
                assert_bit_equal(older.state, expected_state(manifest.iteration))
        assert restored is not None and newest_reported is not None, where
        assert_bit_equal(restored.state, expected_state(restored.iteration))
        if pause_at:
            # Paused in its n-th save (of iteration start + n - 1): visible only once the rename happened.
            phase, nth = pause_at.split("@")
            saving = start + int(nth) - 1
            assert restored.iteration == (saving if phase == "after-rename" else saving - 1), where
        else:
            # A save may commit just before the kill and before its report: at most one iteration newer.
            assert restored.iteration in (newest_reported, newest_reported + 1), where
        newest_reported = restored.iteration
