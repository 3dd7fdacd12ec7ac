"""CUDA tensors through pinned host memory. Skipped without a GPU (the development machine has none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib import Checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.cpu() for key, value in state.items()}


def test_cuda_tensors_round_trip_back_to_the_gpu(shm_dir: Path) -> None:
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
    assert restored is not None
    assert all(tensor.is_cuda for tensor in restored.state.values())
    assert restored.state["weight"].data_ptr() == restored.state["tied"].data_ptr()
    assert_bit_equal(cpu_copy(restored.state), cpu_copy(state))


def test_restore_fills_cuda_targets_in_place(shm_dir: Path) -> None:
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


def test_an_optimizer_step_after_an_async_save_does_not_race_the_device_copy(shm_dir: Path) -> None:
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
