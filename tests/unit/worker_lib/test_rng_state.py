"""worker_lib.rng_state / restore_rng_state: the global generators' states survive a checkpoint round trip,
so the draws after a restore are the draws an uninterrupted process would make."""

from __future__ import annotations

import random
from pathlib import Path

import numpy
import torch

import worker_lib
from worker_lib import Checkpointer, restore_rng_state, rng_state


def draws() -> tuple[list[float], list[float], list[float], float]:
    """One draw of each kind, the gaussian ones last (they keep a cached second value)."""
    return (
        torch.rand(4).tolist(),
        numpy.random.rand(4).tolist(),
        [random.random() for _ in range(4)],
        numpy.random.standard_normal() + random.gauss(0, 1),
    )


def test_rng_state_round_trips_through_a_checkpoint(shm_dir: Path) -> None:
    torch.manual_seed(1)
    numpy.random.seed(2)
    random.seed(3)
    numpy.random.standard_normal()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)  # and in Python's
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(0, {"rng": rng_state()})
        expected = draws()
        draws()  # the process goes on drawing, then fails
        restored = checkpointer.restore()
    assert restored is not None
    restore_rng_state(restored.state["rng"])
    assert draws() == expected


def test_rng_state_is_public_and_small() -> None:
    assert {"rng_state", "restore_rng_state"} <= set(worker_lib.__all__)
    state = rng_state()
    assert set(state) == {"torch", "python", "numpy"}  # no CUDA here
    assert state["numpy"]["keys"].dtype == torch.int64 and state["python"]["internal"].numel() == 625
