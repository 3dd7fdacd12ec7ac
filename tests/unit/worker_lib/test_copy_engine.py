"""The copy engine's scheduling (the calling thread works too, failures wait for every thread), its memoised
restore plans, and what a fresh process's first restore() does not pay for."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from worker_lib.checkpointer import fenced_save_threads
from worker_lib.store.copy import CopyEngine, Extent, Piece, StripePlan, plan_checked

ROOT = Path(__file__).resolve().parents[3]


class _Recording:
    """A transfer that notes which thread copied each piece. A piece waits until `expected` threads have
    copied one (for at most 5 s in all): on a loaded host a pool thread may wake after the others took
    every piece, and a fixed sleep per piece would then count it missing."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.threads: set[int] = set()
        self._arrived = threading.Condition()
        self._deadline = time.monotonic() + 5

    def copy(self, lo: int, hi: int) -> None:
        with self._arrived:
            self.threads.add(threading.get_ident())
            self._arrived.notify_all()
            left = max(0.0, self._deadline - time.monotonic())
            self._arrived.wait_for(lambda: len(self.threads) >= self.expected, timeout=left)
        time.sleep(0.002)  # and long enough that a thread beyond the expected ones would get pieces too


def _stripes(count: int) -> list[StripePlan]:
    return [StripePlan.of(i, i + 1, [Piece(0, i, i + 1, i, 0)]) for i in range(count)]


def test_the_calling_thread_copies_stripes_too(engine: CopyEngine) -> None:
    transfer = _Recording(engine.threads)
    engine.copy(_stripes(40), [transfer])
    assert threading.get_ident() in transfer.threads
    assert len(transfer.threads) == engine.threads  # the caller and threads - 1 of the pool


def test_a_copy_can_be_held_to_fewer_threads_than_the_engine_has() -> None:
    """A save that runs beside a GPU job's training step uses some of the threads (fenced_save_threads)."""
    copy_engine = CopyEngine(threads=4)
    try:
        for workers, expected in ((1, 1), (2, 2), (9, 4)):
            transfer = _Recording(expected)
            copy_engine.copy(_stripes(40), [transfer], workers=workers)
            assert len(transfer.threads) == expected
    finally:
        copy_engine.close()
    assert [fenced_save_threads(n) for n in (1, 2, 3, 16)] == [1, 1, 1, 8]


def test_a_failure_in_the_callers_share_waits_for_the_other_threads(engine: CopyEngine) -> None:
    caller = threading.get_ident()
    finished: list[int] = []

    class Failing:
        def copy(self, lo: int, hi: int) -> None:
            if threading.get_ident() == caller:
                raise OSError("copy failed")
            time.sleep(0.2)  # the other thread is still writing when the caller fails
            finished.append(lo)

    with pytest.raises(OSError, match="copy failed"):
        engine.copy(_stripes(2), [Failing()])
    assert finished  # raised only once the other thread's piece was done


def test_restore_plans_are_memoised() -> None:
    extents = [Extent(0, 150, 1, 192), Extent(192, 100, 1, 320)]
    stripes = [(0, 128), (128, 320)]
    plan = plan_checked(extents, stripes)
    assert plan_checked(list(extents), list(stripes)) is plan
    assert plan_checked(extents, [(0, 64), (64, 320)]) is not plan


def test_a_fresh_process_restores_without_importing_the_dtensor_package(tmp_path: Path) -> None:
    # torch.distributed.tensor brings torch.fx and sympy: importing it inside the first restore() of a
    # restarted process cost about 0.7 s of CPU (3 s on a loaded machine), more than the restore itself.
    program = f"""
import sys, torch
from worker_lib import Checkpointer
state = {{"w": torch.arange(1000.0), "step": 3}}
with Checkpointer({str(tmp_path)!r}, blocking=True) as checkpointer:
    checkpointer.save(3, state)
    restored = checkpointer.restore(into={{"w": torch.zeros(1000), "step": 0}})
assert restored is not None and restored.iteration == 3
print("torch.distributed.tensor" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("compiled", [False, True])
def test_bytes_a_device_copy_landed_in_the_slot_are_hashed_not_copied(
    engine: CopyEngine, compiled: bool
) -> None:
    """A blob copied from the device straight into the slot (LandedTransfer) costs the save only its
    checksum, which matches that of the same bytes copied from host memory."""
    import numpy as np
    import torch

    from worker_lib.store.copy import compile_save
    from worker_lib.store.layout import plan, save_transfers

    tensors = [torch.arange(700_000, dtype=torch.float32), torch.randn(3, 5_000)]
    layout = plan(tensors, ["a", "b"])
    copied = np.zeros(layout.data_bytes, dtype=np.uint8)
    expected = engine.copy(layout.stripes, save_transfers(layout, tensors, copied), copied)

    landed = np.zeros(layout.data_bytes, dtype=np.uint8)
    first = layout.blobs[0]
    landed[first.offset : first.offset + first.nbytes] = tensors[0].view(torch.uint8).numpy()
    # The background thread is given a placeholder for the landed blob: it must not be read.
    sources = [torch.empty(0, dtype=torch.uint8), tensors[1]]
    transfers = save_transfers(layout, sources, landed, frozenset({0}))
    plans = compile_save(layout.stripes, transfers, landed) if compiled else None
    assert engine.copy(layout.stripes, transfers, landed, plans) == expected
    assert np.array_equal(landed, copied)
