"""DCP through Castor with the state on a GPU: `dcp.save` through CastorWriter, `dcp.load` through
CastorReader into CUDA tensors, in one process (DCP's no-process-group mode). Skipped without a GPU (the
development machine has none); `./scripts/gpu-check` runs it where one is lent."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib import Checkpointer
from worker_lib.dcp import CastorReader, CastorWriter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 96)
        self.out = nn.Linear(96, 8)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.proj(x)))


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Block().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 64, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def on_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}


@pytest.mark.parametrize("direct", ["0", "1"], ids=["staged", "direct"])
def test_dcp_round_trip_of_cuda_tensors_is_bit_exact_and_stays_on_the_gpu(
    shm_dir: Path, direct: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", direct)
    model, optimizer = trained(1)
    saved = on_host(model.state_dict())
    saved_moments = on_host(
        {
            f"{index}.{name}": value
            for index, s in optimizer.state_dict()["state"].items()
            for name, value in s.items()
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        with Checkpointer(shm_dir) as checkpointer:
            dcp.save(
                {"model": model.state_dict(), "optim": optimizer.state_dict()},
                storage_writer=CastorWriter(checkpointer, iteration=7),
            )
            checkpointer.wait()
            # Change everything in place: the load must bring back the saved bytes, into the same memory.
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)
            fresh, fresh_optimizer = trained(2)
            target = {"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict()}
            pointer = target["model"]["proj.weight"].data_ptr()
            reader = CastorReader(checkpointer)
            dcp.load(target, storage_reader=reader)
    assert reader.iteration == 7
    assert target["model"]["proj.weight"].is_cuda and target["model"]["proj.weight"].data_ptr() == pointer
    assert_bit_equal(on_host(target["model"]), saved)
    loaded_moments = {
        f"{index}.{name}": value for index, s in target["optim"]["state"].items() for name, value in s.items()
    }
    assert_bit_equal(on_host(loaded_moments), saved_moments)
