"""CUDA tensors, straight into the slot and through pinned memory. Skipped without a GPU (the development
machine has none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib import Checkpointer
from worker_lib.checkpointer import CheckpointerStats, fenced_save_threads
from worker_lib.store.copy import CopyEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["staged", "direct"])
def direct(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both device paths: straight into the slot (the default) and pinned staging (CASTOR_CUDA_DIRECT=0)."""
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "1" if request.param == "direct" else "0")
    return bool(request.param == "direct")


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.cpu() for key, value in state.items()}


def test_cuda_tensors_round_trip_back_to_the_gpu(shm_dir: Path, direct: bool) -> None:
    weight = torch.randn(300, 500, device="cuda")
    state = {
        "weight": weight,
        "strided": torch.randn(64, 64, device="cuda")[:, ::2],
        "tied": weight,
        "half": torch.randn(1000, device="cuda", dtype=torch.bfloat16),
        "flags": torch.rand(77, device="cuda") > 0.5,
        "scalar": torch.tensor(3.0, device="cuda"),
    }
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, state)
        restored = checkpointer.restore()
        stats = checkpointer.stats
    assert restored is not None
    # Direct: the strided tensor goes through pinned memory, the others straight into the slot (the tied
    # one once). Staged: all of them through pinned memory.
    sizes = {key: tensor.numel() * tensor.element_size() for key, tensor in state.items()}
    if direct:
        assert stats.last_direct_bytes == sum(sizes.values()) - sizes["tied"] - sizes["strided"]
        assert stats.staging_bytes >= sizes["strided"]
    else:
        assert stats.last_direct_bytes == 0
        assert stats.staging_bytes >= sum(sizes.values()) - sizes["tied"]
    assert all(tensor.is_cuda for tensor in restored.state.values())
    assert restored.state["weight"].data_ptr() == restored.state["tied"].data_ptr()
    assert_bit_equal(cpu_copy(restored.state), cpu_copy(state))


def test_restore_fills_cuda_targets_in_place(shm_dir: Path, direct: bool) -> None:
    model = nn.Linear(256, 256).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        other = nn.Linear(256, 256).cuda()
        other_optimizer = torch.optim.Adam(other.parameters())
        pointer = other.weight.data_ptr()
        checkpointer.restore(into={"model": other, "optimizer": other_optimizer})
    assert other.weight.data_ptr() == pointer
    assert_bit_equal(cpu_copy(other.state_dict()), cpu_copy(model.state_dict()))
    assert other_optimizer.state_dict()["state"][0]["exp_avg"].is_cuda


def test_an_optimizer_step_after_an_async_save_does_not_race_the_device_copy(
    shm_dir: Path, direct: bool
) -> None:
    model = nn.Linear(4096, 4096).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(64, 4096, device="cuda")).sum().backward()
    before = cpu_copy(model.state_dict())
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        optimizer.step()
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(cpu_copy(restored.state["model"]), before)


def trained_pair(width: int = 2048) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model on the GPU with AdamW's state (moments on the device, `step` counters on the host) and
    fresh gradients: the next optimizer step changes every saved tensor."""
    model = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(64, width, device="cuda")).sum().backward()
        optimizer.step()
    model(torch.randn(64, width, device="cuda")).sum().backward()
    return model, optimizer


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """The state's values now, on the host (AdamW's host `step` counters copied too)."""
    state = optimizer.state_dict()
    return {
        "model": cpu_copy(model.state_dict()),
        "optimizer": {
            index: {key: value.cpu().clone() for key, value in per_parameter.items()}
            for index, per_parameter in state["state"].items()
        },
    }


def restored_values(shm_dir: Path, width: int = 2048) -> dict[str, object]:
    model, optimizer = trained_pair(width)
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.restore(into={"model": model, "optimizer": optimizer})
    return snapshot(model, optimizer)


def device_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.state_dict().values()] + [
        value for per_parameter in optimizer.state.values() for value in per_parameter.values()
    ]
    return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)


def save_then_step(shm_dir: Path) -> tuple[CheckpointerStats, int, dict[str, object], int]:
    """Save a trained model and its AdamW state, then step the optimizer at once (it changes every saved
    tensor). Returns the stats once the save is committed, how many steps had been fenced on the device
    right after the step, the state's values at save(), and its bytes on the device."""
    model, optimizer = trained_pair()
    expected = snapshot(model, optimizer)
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        optimizer.step()  # queued at once: it changes every tensor the copies read
        fenced = checkpointer.stats.steps_fenced_on_device
        checkpointer.wait()
        stats = checkpointer.stats
    return stats, fenced, expected, device_bytes(model, optimizer)


def test_device_tensors_go_straight_into_the_slot_and_the_step_waits_on_the_device(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default every device tensor is copied into the shared-memory slot with no pinned staging
    buffer, and the optimizer step right after save() waits for those copies on the device, not the host;
    what is saved is the state at save(), AdamW's host `step` counters included."""
    monkeypatch.delenv("CASTOR_CUDA_DIRECT", raising=False)
    stats, fenced, expected, on_device = save_then_step(shm_dir)
    assert fenced == 1
    assert stats.last_direct_bytes == on_device > 0
    assert stats.staging_bytes == 0  # no third copy of the state in host memory
    assert_bit_equal(restored_values(shm_dir), expected)


def test_with_direct_copies_off_device_tensors_are_staged_and_the_step_waits_on_the_host(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "0")
    stats, fenced, expected, on_device = save_then_step(shm_dir)
    assert fenced == 0
    assert stats.last_direct_bytes == 0
    assert stats.staging_bytes >= on_device
    assert_bit_equal(restored_values(shm_dir), expected)


def test_a_large_host_part_of_the_state_keeps_the_host_wait(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host tensors too large to snapshot inside save() are read by the background thread from the live
    state: then the optimizer step blocks the host until the copy is done, as on a CPU job."""
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "1")
    monkeypatch.setattr("worker_lib.checkpointer.HOST_SNAPSHOT_BYTES", 0)
    stats, fenced, expected, on_device = save_then_step(shm_dir)
    assert fenced == 0
    assert stats.last_direct_bytes == on_device
    assert_bit_equal(restored_values(shm_dir), expected)


def test_slots_that_grow_are_registered_again_and_saves_keep_going_direct(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A larger state maps each slot anew: the old mapping's registration goes, the new one is made."""
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "1")
    with Checkpointer(shm_dir) as checkpointer:
        for iteration, width in enumerate((256, 256, 1024, 1024), start=1):
            model, optimizer = trained_pair(width)
            expected = snapshot(model, optimizer)
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer})
            optimizer.step()
            checkpointer.wait()
            assert checkpointer.stats.last_direct_bytes == device_bytes(model, optimizer)
    assert_bit_equal(restored_values(shm_dir, 1024), expected)


@pytest.mark.parametrize("direct", ["1", "0"], ids=["fenced-on-device", "host-wait"])
def test_a_save_beside_training_hashes_on_half_the_copy_threads(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, direct: str
) -> None:
    """A save the step waits for on the device runs beside training's launches: it leaves half the copy
    threads idle. One the step waits for on the host uses them all (training is waiting anyway)."""
    used: list[tuple[int, int | None]] = []
    original = CopyEngine.copy

    def recording(self: CopyEngine, *args: Any, **kwargs: Any) -> list[str]:
        used.append((self.threads, kwargs.get("workers")))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CopyEngine, "copy", recording)
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", direct)
    _, fenced, expected, _ = save_then_step(shm_dir)
    ((threads, workers),) = used
    assert fenced == (1 if direct == "1" else 0)
    assert workers == (fenced_save_threads(threads) if direct == "1" else None)
    assert_bit_equal(restored_values(shm_dir), expected)
