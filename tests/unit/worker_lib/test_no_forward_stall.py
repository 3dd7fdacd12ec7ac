"""No forward waits for the background copy (issue 12, item 3): the buffers of modules saved as objects are
captured inside save(), so a forward that reads or changes them runs while the copy is still under way, and
the checkpoint holds the buffers' values at save time, bit for bit. Only the optimizer step waits.

The copy is held inside the copy engine by an event that the test opens itself: a forward that waited for
the copy would find it still held (the gate's long timeout ends the wait only on a regression), and every
assertion is about order and values, never about time."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib import Checkpointer
from worker_lib.store import copy as copy_module

REGRESSION_TIMEOUT_S = 10.0  # only a forward that wrongly waits for the copy ever runs into it


@dataclass
class Gate:
    """Holds every background copy inside the copy engine until `release` is set."""

    entered: threading.Event
    release: threading.Event


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate(threading.Event(), threading.Event())
    copy = copy_module.FlatTransfer.copy

    def held_copy(self: copy_module.FlatTransfer, lo: int, hi: int) -> None:
        held.entered.set()
        held.release.wait(REGRESSION_TIMEOUT_S)
        copy(self, lo, hi)

    monkeypatch.setattr(copy_module.FlatTransfer, "copy", held_copy)
    yield held
    held.release.set()


class Decoder(nn.Module):
    """A tiny GPT-style block with the buffers transformers register: a causal mask shared by two layers
    (one storage, two state_dict entries), RoPE tables, and a counter that forward bumps in place."""

    def __init__(self, width: int = 16, context: int = 8):
        super().__init__()
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)
        self.first.register_buffer("mask", mask)
        self.second.register_buffer("mask", mask)
        angles = torch.outer(torch.arange(context, dtype=torch.float32), torch.rand(width // 2))
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, context, width)
        self.calls += 1
        half = x.shape[-1] // 2
        rotated = torch.cat(
            (
                x[..., :half] * self.cos - x[..., half:] * self.sin,
                x[..., :half] * self.sin + x[..., half:] * self.cos,
            ),
            dim=-1,
        )
        scores = self.first(rotated) @ self.second(rotated).transpose(1, 2) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~self.first.mask, float("-inf"))
        out = scores.softmax(-1) @ x
        return self.norm(out.transpose(1, 2)).transpose(1, 2)  # training mode: running statistics change


def test_a_forward_runs_while_the_copy_is_held_and_the_buffers_keep_their_saved_values(
    shm_dir: Path, gate: Gate
) -> None:
    torch.manual_seed(0)
    model = Decoder()
    model(torch.randn(4, 8, 16))  # statistics that are not the initial ones
    at_save = {key: value.clone() for key, value in model.state_dict().items()}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        assert gate.entered.wait(REGRESSION_TIMEOUT_S)  # the background copy is under way, held
        stalled = checkpointer.stats.stalled_s
        model(torch.randn(4, 8, 16))  # changes running_mean, running_var, num_batches_tracked, calls
        pending = checkpointer._pending
        # The forward ran to its end while the copy was still held: it did not wait for it.
        assert pending is not None and not pending.done() and not gate.release.is_set()
        assert checkpointer.stats.stalled_s == stalled and checkpointer.stats.saves_committed == 0
        assert not torch.equal(model.norm.running_mean, at_save["norm.running_mean"])
        assert int(model.calls) == int(at_save["calls"]) + 1
        gate.release.set()
        restored = checkpointer.restore()
    assert restored is not None and restored.iteration == 1
    assert_bit_equal(restored.state["model"], at_save)
    # One storage saved once and restored as one storage, as without the snapshot.
    masks = restored.state["model"]["first.mask"], restored.state["model"]["second.mask"]
    assert masks[0].untyped_storage().data_ptr() == masks[1].untyped_storage().data_ptr()


def test_every_save_captures_the_buffers_at_its_own_call(shm_dir: Path, gate: Gate) -> None:
    """The side copies are reused from save to save: each save still holds its own values."""
    gate.release.set()
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(shm_dir, slots=3) as checkpointer:
        for iteration in range(1, 4):
            model(torch.randn(16, 8))
            saved[iteration] = {key: value.clone() for key, value in model.state_dict().items()}
            checkpointer.save(iteration, {"model": model})
            model(torch.randn(16, 8))  # right after save(), before the copy can have run
        for iteration in (2, 3):
            restored = checkpointer.restore(iteration=iteration)
            assert restored is not None
            assert_bit_equal(restored.state["model"], saved[iteration])


def test_a_buffer_replaced_or_transposed_between_saves_is_saved_as_it_is_then(
    shm_dir: Path, gate: Gate
) -> None:
    """The snapshot keeps its views of a buffer from save to save only while the buffer keeps its storage
    and layout: another tensor, or the same one transposed in place, is captured as it is at its save."""
    gate.release.set()
    model = nn.Linear(4, 4)
    model.register_buffer("table", torch.arange(12, dtype=torch.float32).reshape(3, 4))
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(shm_dir, slots=4) as checkpointer:
        for iteration in range(1, 5):
            if iteration == 3:
                model.table = torch.arange(100, 112, dtype=torch.float32).reshape(4, 3)
            if iteration == 4:
                model.table.t_()  # the same tensor and storage, its strides swapped
            saved[iteration] = {key: value.clone() for key, value in model.state_dict().items()}
            checkpointer.save(iteration, {"model": model})
            checkpointer.wait()
            model.table.add_(1000)  # after the save: not in it
        for iteration in range(1, 5):
            restored = checkpointer.restore(iteration=iteration)
            assert restored is not None
            assert_bit_equal(restored.state["model"], saved[iteration])


def test_the_optimizer_step_still_waits_for_the_copy(shm_dir: Path, gate: Gate) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(16, 8)).sum().backward()
    at_save = {key: value.clone() for key, value in model.state_dict().items()}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        assert gate.entered.wait(REGRESSION_TIMEOUT_S)
        threading.Timer(0.05, gate.release.set).start()
        optimizer.step()  # the step pre-hook waits until the copy is committed
        assert checkpointer.stats.saves_committed == 1
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(restored.state["model"], at_save)


def test_a_distributed_data_parallel_saved_as_the_object_is_not_held_up_and_round_trips(
    shm_dir: Path, gate: Gate, tmp_path: Path
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
        ddp(torch.randn(16, 8)).sum().backward()
        optimizer.step()
        at_save = {key: value.clone() for key, value in ddp.state_dict().items()}
        assert all(key.startswith("module.") for key in at_save)
        with Checkpointer(shm_dir) as checkpointer:
            checkpointer.save(1, {"model": ddp, "optimizer": optimizer})
            assert gate.entered.wait(REGRESSION_TIMEOUT_S)
            ddp(torch.randn(16, 8)).sum().backward()  # buffer sync and statistics, with the copy held
            pending = checkpointer._pending
            assert pending is not None and not pending.done()
            gate.release.set()
            optimizer.step()
            assert not torch.equal(ddp.module[1].running_mean, at_save["module.1.running_mean"])
            restored = checkpointer.restore(into={"model": ddp, "optimizer": optimizer})
        assert restored is not None
        assert_bit_equal(ddp.state_dict(), at_save)
    finally:
        dist.destroy_process_group()


def test_no_forward_hook_is_installed(shm_dir: Path, gate: Gate) -> None:
    gate.release.set()
    model = Decoder()
    global_hooks = len(nn.modules.module._global_forward_pre_hooks)
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        assert not any(module._forward_pre_hooks for module in model.modules())
        assert len(nn.modules.module._global_forward_pre_hooks) == global_hooks


def test_a_host_snapshot_holds_the_values_at_capture_and_reuses_its_side_tensors() -> None:
    """The host tensors of a GPU job's save (AdamW's `step` counters) are copied inside save(), so the
    optimizer step may change them while the background copy runs; the copies are reused from save to save
    (the same addresses keep the background copy's compiled plans)."""
    from worker_lib.fences import HostSnapshot

    snapshot = HostSnapshot()
    step, moment = torch.tensor(3.0), torch.randn(4, 6).t()  # a scalar and a strided host tensor
    device_stand_in = torch.zeros(2)
    sources = [device_stand_in, step, moment]
    captured = snapshot.capture(sources, [1, 2])
    assert captured[0] is device_stand_in and captured[1] is not step and captured[2] is not moment
    expected_moment = moment.clone()
    step += 1  # the optimizer step, after save() returned
    moment.mul_(2)
    assert captured[1].item() == 3.0 and torch.equal(captured[2], expected_moment)
    again = snapshot.capture(sources, [1, 2])
    assert again[1].data_ptr() == captured[1].data_ptr() and again[1].item() == 4.0
    assert again[2].data_ptr() == captured[2].data_ptr() and torch.equal(again[2], moment)
    resized = snapshot.capture([device_stand_in, torch.tensor([1.0, 2.0]), moment], [1])
    assert resized[1].tolist() == [1.0, 2.0] and resized[2] is moment
    # A state wholly on the device (no `step` counters on the host): nothing to copy, nothing replaced.
    assert snapshot.capture([device_stand_in], []) == [device_stand_in]
