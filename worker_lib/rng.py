"""The states of a process's global random number generators, in a form `Checkpointer.save()` takes, and
back. A resumed run draws the same dropout masks, shuffles and augmentations as an uninterrupted one only
if these states are part of the checkpoint (each rank saves its own).

    checkpointer.save(iteration, {"model": model, ..., "rng": rng_state()})
    ...
    restore_rng_state(restored.state["rng"])

Generators you create yourself (`torch.Generator()`, `numpy.random.default_rng()`) are not global: save
their own states (`generator.get_state()`, a tensor) beside this.
"""

from __future__ import annotations

import importlib
import random
import sys
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """torch's CPU generator, every CUDA device's generator (once CUDA is initialized), numpy's global
    generator (when numpy is imported) and Python's `random`: tensors and plain values only."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(numpy.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators to a state `rng_state()` returned (and a checkpoint restored)."""
    torch.set_rng_state(state["torch"].to(torch.uint8))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"].tolist()), python["gauss_next"]))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy" in state:
        numpy = importlib.import_module("numpy")
        saved = state["numpy"]
        numpy.random.set_state(
            (
                saved["kind"],
                saved["keys"].numpy().astype(numpy.uint32),
                saved["position"],
                saved["has_gauss"],
                saved["cached_gaussian"],
            )
        )
