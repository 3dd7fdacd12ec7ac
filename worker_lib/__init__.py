"""Castor's training-side library: per-iteration in-memory checkpoints that survive a crashed process.

from worker_lib import Checkpointer

with Checkpointer() as checkpointer:
    if (restored := checkpointer.restore(into={"model": model, "optimizer": optimizer})) is not None:
        start = restored.iteration + 1
    for iteration in range(start, steps):
        ...  # forward, backward, optimizer.step()
        checkpointer.save(iteration, {"model": model, "optimizer": optimizer})

Names are imported on first use: the root service uses parts of this package (the persistent tier)
without paying for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_lib.checkpointer import Checkpointer, Restored
    from worker_lib.comm_timing import time_communication
    from worker_lib.dcp import CastorReader, CastorWriter
    from worker_lib.embedded import attach
    from worker_lib.errors import (
        CheckpointCorruptError,
        CheckpointError,
        CheckpointNotFoundError,
        ShmCapacityError,
        SlotsOnDiskWarning,
    )
    from worker_lib.export import export_dcp
    from worker_lib.restore import load_state
    from worker_lib.rng import restore_rng_state, rng_state

__version__ = "0.1.0"

__all__ = [
    "CastorReader",
    "CastorWriter",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "Restored",
    "ShmCapacityError",
    "SlotsOnDiskWarning",
    "__version__",
    "attach",
    "export_dcp",
    "load_state",
    "restore_rng_state",
    "rng_state",
    "time_communication",
]

_HOMES = {
    "CastorReader": "worker_lib.dcp",
    "CastorWriter": "worker_lib.dcp",
    "export_dcp": "worker_lib.export",
    "Checkpointer": "worker_lib.checkpointer",
    "Restored": "worker_lib.checkpointer",
    "time_communication": "worker_lib.comm_timing",
    "attach": "worker_lib.embedded",
    "load_state": "worker_lib.restore",
    "rng_state": "worker_lib.rng",
    "restore_rng_state": "worker_lib.rng",
    "CheckpointCorruptError": "worker_lib.errors",
    "CheckpointError": "worker_lib.errors",
    "CheckpointNotFoundError": "worker_lib.errors",
    "ShmCapacityError": "worker_lib.errors",
    "SlotsOnDiskWarning": "worker_lib.errors",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'worker_lib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
