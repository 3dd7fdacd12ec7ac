"""Shared helpers of the worker_lib tests (the e2e crash test imports them too)."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
from multiprocessing.context import ForkServerContext
from typing import Any

import numpy as np
import torch

from worker_lib.store.copy import CopyEngine, Extent, plan_stripes
from worker_lib.store.manifest import Manifest, Stripe, content_digest
from worker_lib.store.slots import SlotStore


def forkserver() -> ForkServerContext:
    """Child processes forked from a server that has torch and worker_lib imported: ~50 ms to start one,
    instead of ~2 s for a fresh interpreter, and no fork of a multi-threaded parent."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "worker_lib", "tests.unit.worker_lib.helpers"])
    return context


def assert_bit_equal(actual: Any, expected: Any, path: str = "state") -> None:
    """Same structure, same container types, tensors with the same dtype, shape and bytes (NaN-safe)."""
    assert type(actual) is type(expected) or (isinstance(actual, dict) and isinstance(expected, dict)), (
        f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(raw_bytes(actual), raw_bytes(expected)), f"{path}: bytes differ"
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), path
        for key in expected:
            assert_bit_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bit_equal(a, e, f"{path}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual), path
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
        if isinstance(expected, float):
            assert math.copysign(1, actual) == math.copysign(1, expected), f"{path}: sign of zero"


_BIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes, whatever its strides (through a same-size integer dtype: some dtypes
    have no copy kernel) and conjugate or negative bits."""
    tensor = tensor.resolve_conj().resolve_neg()
    bits = _BIT_DTYPES.get(tensor.element_size())
    if bits is not None:
        tensor = tensor.view(bits)
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def write_raw(store: SlotStore, iteration: int, payload: bytes, engine: CopyEngine) -> Manifest:
    """Commit `payload` as the data of a checkpoint with no tensors (store-level tests)."""
    writer = store.open_write(iteration, len(payload))
    assert writer is not None
    writer.buffer[:] = payload
    stripes = plan_stripes([Extent(0, len(payload), 1, len(payload))], len(payload), stripe_bytes=64)
    digests = engine.hash(np.frombuffer(writer.buffer, dtype=np.uint8), [(s.start, s.end) for s in stripes])
    manifest = Manifest(
        iteration=iteration,
        data_bytes=len(payload),
        tensors=(),
        stripes=tuple(Stripe(s.start, s.end, d) for s, d in zip(stripes, digests, strict=True)),
        digest=content_digest(digests),
    )
    writer.commit(manifest)
    return manifest


async def until(condition: Any, timeout_s: float = 5.0) -> None:
    """Wait (on the running loop) until `condition()` holds; fail after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)
