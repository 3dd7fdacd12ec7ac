"""What a DCP save through CastorWriter commits is the state at the time of the save.

- `dcp.save` on the training thread: the copy runs in the background (it is held back here until the next
  forward has run), so the buffers among DCP's detached tensors, which that forward changes in place
  (BatchNorm's running statistics), are snapshotted inside the save; parameters and optimizer states are
  not (the optimizer step waits for the copy).
- `dcp.async_save`: DCP's future completes only once Castor's copy of the staged state is committed, so a
  stager that reuses its buffers (torchtitan's) cannot overwrite them while the copy reads them.

Single process, no process group (DCP saves "in a single process").
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib import Checkpointer
from worker_lib.dcp import CastorReader, CastorWriter


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        yield


@contextmanager
def copies_held(checkpointer: Checkpointer) -> Iterator[threading.Event]:
    """Hold the checkpointer's background copies until the event is set (or the block ends): the copy of
    a save made meanwhile runs after whatever the test does next, as a slow copy would."""
    release = threading.Event()
    checkpointer._background.submit(release.wait, 60)
    try:
        yield release
    finally:
        release.set()


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.Linear(256, 4))


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def clone(state: dict[str, Any]) -> dict[str, Any]:
    return {
        key: clone(value) if isinstance(value, dict) else value.clone() if torch.is_tensor(value) else value
        for key, value in state.items()
    }


def zeroed(state: dict[str, Any]) -> dict[str, Any]:
    return {
        key: zeroed(value)
        if isinstance(value, dict)
        else value.clone().zero_()
        if torch.is_tensor(value)
        else value
        for key, value in state.items()
    }


def load(checkpointer: Checkpointer, iteration: int) -> dict[str, Any]:
    model = nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optimizer, 99)  # optimizer states exist, with other values
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state}
    dcp.load(state, storage_reader=CastorReader(checkpointer, iteration=iteration))
    return state


def test_dcp_save_keeps_the_buffers_of_save_time_and_copies_the_rest_in_the_background(
    shm_dir: Path,
) -> None:
    model = bn_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    with Checkpointer(shm_dir) as checkpointer:
        for iteration in range(3):
            step(model, optimizer, iteration)  # the checkpointer sees the optimizer step
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optimizer_state}
            expected = clone(state)
            committed = checkpointer.stats.saves_committed
            with copies_held(checkpointer) as release:
                dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=iteration))
                # Still copying in the background: dcp.save returned before the commit.
                assert checkpointer.stats.saves_committed == committed
                model(torch.randn(8, 16))  # the next forward: BatchNorm statistics change in place
                release.set()
                checkpointer.wait()
            assert checkpointer.stats.saves_committed == committed + 1
            assert not torch.equal(model[1].running_mean, expected["model"]["1.running_mean"])
            assert_bit_equal(load(checkpointer, iteration), expected)
            # What was snapshotted: the buffers (and AdamW's 0-d `step` counters are not even that), not
            # the parameters and the optimizer's moments.
            snapshotted = sum(side.numel() for side in checkpointer._buffers._side)
            assert buffer_bytes <= snapshotted < buffer_bytes + 64


@pytest.mark.parametrize("named", [True, False], ids=["iteration-named", "newest"])
def test_a_load_right_after_a_save_loads_that_save(
    shm_dir: Path, named: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dcp.load straight after dcp.save (a NaN rollback to the last in-memory checkpoint) while the save
    still copies in the background. Before, the reader chose and looked up the iteration without waiting for
    it: named, it raised CheckpointNotFoundError; not named, it chose the iteration before (the other slot
    still holds it) and loaded that without a word, where Checkpointer.restore() waits and loads the save."""
    model = bn_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with Checkpointer(shm_dir) as checkpointer:
        for iteration in (1, 2):
            step(model, optimizer, iteration)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optimizer_state}
            expected = clone(state)
            with copies_held(checkpointer) as release:
                dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=iteration))
                if iteration == 1:
                    continue
                assert checkpointer.stats.saves_committed == 1, "iteration 2 is still being copied"
                # The copy finishes once the reader has listed what is committed (a reader that did not
                # wait has chosen by then), or after a second (one that waits gets there only then).
                listed = checkpointer._store.committed

                def committed_then_released(listed: Any = listed, release: Any = release) -> Any:
                    manifests = listed()
                    release.set()
                    return manifests

                monkeypatch.setattr(checkpointer._store, "committed", committed_then_released)
                timer = threading.Timer(1.0, release.set)
                timer.start()
                # Loaded into zeroed copies: no optimizer steps meanwhile (its step would wait for the copy).
                loaded = zeroed(expected)
                try:
                    reader = CastorReader(checkpointer, iteration=2 if named else None)
                    dcp.load(loaded, storage_reader=reader)
                finally:
                    timer.cancel()
        assert checkpointer.stats.saves_committed == 2
    assert_bit_equal(loaded, expected)


def test_dcp_save_before_any_optimizer_step_commits_before_it_returns(shm_dir: Path) -> None:
    """Without an optimizer seen stepping nothing tells the parameters from the buffers: the save waits
    for its copy (a save that would snapshot most of the state anyway)."""
    model = bn_model()
    with Checkpointer(shm_dir) as checkpointer:
        state = {"model": get_model_state_dict(model)}
        expected = clone(state)
        with copies_held(checkpointer):
            dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=0))
            assert checkpointer.stats.saves_committed == 1
            model(torch.randn(8, 16))
        fresh = {
            "model": get_model_state_dict(
                nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.Linear(256, 4))
            )
        }
        dcp.load(fresh, storage_reader=CastorReader(checkpointer, iteration=0))
        assert_bit_equal(fresh, expected)


def test_a_frozen_part_named_through_modules_is_copied_in_the_background(shm_dir: Path) -> None:
    """A LoRA-style model: a large frozen base no optimizer owns. Without `modules`, every dcp.save copied
    the base aside (or, over half the state, waited for its copy); named through `modules`, only the
    buffers are snapshotted and the save returns before its copy, as for a plain save()."""
    model = bn_model()
    model[0].requires_grad_(False)  # the frozen base
    model[0].weight.data = torch.randn(256, 16)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    with Checkpointer(shm_dir) as checkpointer:
        step(model, optimizer, 0)
        state = {"model": get_model_state_dict(model)}
        expected = clone(state)
        with copies_held(checkpointer) as release:
            dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=1, modules=[model]))
            assert checkpointer.stats.saves_committed == 0, "returned before its copy"
            model(torch.randn(8, 16))
            release.set()
            checkpointer.wait()
        snapshotted = sum(side.numel() for side in checkpointer._buffers._side)
        assert buffer_bytes <= snapshotted < buffer_bytes + 64, "the frozen weights were not copied aside"
        fresh = {"model": get_model_state_dict(bn_model())}
        dcp.load(fresh, storage_reader=CastorReader(checkpointer, iteration=1))
        assert_bit_equal(fresh, expected)


def test_async_save_result_means_committed_with_a_reused_stager(shm_dir: Path) -> None:
    """torchtitan's loop: one DefaultStager that caches its staging buffers, and `.result()` of the last
    save before the next async_save. The staged buffers are overwritten by the next staging as soon as
    `.result()` has returned: Castor's copy must have read them by then."""
    parameter = nn.Parameter(torch.zeros(1 << 16))
    parameter.grad = torch.full_like(parameter, -1.0)
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    saves = 3
    try:
        with Checkpointer(shm_dir, slots=saves + 1) as checkpointer:
            future = None
            for iteration in range(saves):
                optimizer.step()  # the parameter holds iteration + 1
                if future is not None:
                    future.result()
                with copies_held(checkpointer) as release:
                    future = dcp.async_save(
                        {"p": parameter.detach()},
                        storage_writer=CastorWriter(checkpointer, iteration=iteration),
                        async_stager=stager,
                    )
                    deadline = time.monotonic() + 1.0
                    while not future.done() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert not future.done(), "async_save's future completed before Castor's copy ran"
                    release.set()
                    future.result(timeout=60)
                    committed = [m.iteration for m in checkpointer._store.committed()]
                    assert iteration in committed, ".result() returned before the commit"
            future.result()
            for iteration in range(saves):
                loaded = {"p": torch.empty(1 << 16)}
                dcp.load(loaded, storage_reader=CastorReader(checkpointer, iteration=iteration))
                assert bool((loaded["p"] == iteration + 1).all()), f"iteration {iteration} torn"
    finally:
        stager.close()
