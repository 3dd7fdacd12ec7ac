"""Two-dimensional meshes (issue 12, item 1): HSDP (FSDP2 replicated over one mesh dimension, sharded over
the other) and FSDP2 over tensor parallelism (`_StridedShard`), each on a real 2 x 2 mesh of four
processes over gloo. Every rank's shard comes back bit-exact in place and into a fresh model, training
goes on from it exactly as from the original, a checkpoint of one mesh is refused on the other with the
difference named, and the four ranks' checkpoints exported to DCP by one process load whole into an
unsharded model (test_sharded.py covers the 1-D meshes and the degenerate 2-D one)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.worker_lib.test_dcp import bit_differences, load_alone
from tests.unit.worker_lib.test_sharded import Tiny, differences, ranks_ran, restored_both_ways, snapshot
from worker_lib.export import export_shards
from worker_lib.store.slots import SlotStore

WORLD = 4
MESH = (2, 2)
SAVED = 2  # the iteration exported


def build_hsdp(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny(hidden=8)
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def build_fsdp_tp(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Tensor parallel inside ("tp"), FSDP2 across ("dp"): a.weight is sharded on dim 0 twice over."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Tiny(hidden=8)
    parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    fully_shard(model.a, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


LAYOUTS: dict[str, tuple[Callable[[Any], tuple[nn.Module, torch.optim.Optimizer]], tuple[str, str]]] = {
    "hsdp": (build_hsdp, ("replicate", "shard")),
    "fsdp_tp": (build_fsdp_tp, ("dp", "tp")),
}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)  # one batch for every rank: tensor parallelism needs the same input
    model(torch.randn(5, 6)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor whole (all-gathered: a collective), keyed as an unsharded model's state dicts are."""
    from torch.distributed.tensor import DTensor

    def full(value: Any) -> Any:
        return value.full_tensor().detach().clone() if isinstance(value, DTensor) else value

    out = {f"model.{key}": full(value) for key, value in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"optimizer.{index}.{key}"] = full(value)
    return out


def scenarios(rank: int, shm: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from worker_lib import Checkpointer

    results: dict[str, Any] = {}
    for name, (builder, dims) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", MESH, mesh_dim_names=dims)
        model, optimizer = builder(mesh)
        with Checkpointer(shm / f"{name}-{rank}") as checkpointer:
            for step in (1, SAVED):
                train_step(model, optimizer, step)
                checkpointer.save(step, {"model": model, "optimizer": optimizer})
            expected = snapshot(model, optimizer)
            if rank == 0:
                torch.save(whole_state(model, optimizer), shm / f"{name}-whole.pt")
            else:
                whole_state(model, optimizer)  # the all-gathers need every rank
            in_place, fresh_model, fresh_optimizer = restored_both_ways(
                checkpointer, model, optimizer, lambda b=builder, m=mesh: b(m)
            )
            fresh = snapshot(fresh_model, fresh_optimizer)
            train_step(model, optimizer, SAVED + 1)
            train_step(fresh_model, fresh_optimizer, SAVED + 1)
            results[name] = {
                "placements": sorted({str(p.placements) for p in model.parameters()}),  # type: ignore[attr-defined]
                "in_place": differences(expected, in_place),
                "fresh": differences(expected, fresh),
                "trained_on": differences(snapshot(model, optimizer), snapshot(fresh_model, fresh_optimizer)),
            }

    # A checkpoint of one 2-D mesh restored into a model on the other: refused, nothing changed.
    other_model, other_optimizer = build_fsdp_tp(init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp")))
    train_step(other_model, other_optimizer, 1)
    before = snapshot(other_model, other_optimizer)
    with Checkpointer(shm / f"hsdp-{rank}") as checkpointer:
        try:
            checkpointer.restore({"model": other_model, "optimizer": other_optimizer})
            results["other_mesh"] = "no error"
        except Exception as exc:
            results["other_mesh"] = f"{type(exc).__name__}: {exc}"
    results["other_mesh_untouched"] = differences(before, snapshot(other_model, other_optimizer))
    return results


@pytest.fixture(scope="module")
def outcome() -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    with ranks_ran(scenarios, WORLD, "sharded-2d") as ran:
        yield ran


@pytest.mark.parametrize(
    ("layout", "placements"),
    [
        ("hsdp", ["(Replicate(), Shard(dim=0))"]),
        (
            "fsdp_tp",
            [
                "(Shard(dim=0), Replicate())",
                "(Shard(dim=0), Shard(dim=1))",
                "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
            ],
        ),
    ],
)
def test_two_dimensional_shards_restore_bit_exact_and_train_on_alike(
    outcome: tuple[Path, list[dict[str, Any]]], layout: str, placements: list[str]
) -> None:
    _, results = outcome
    for result in results:
        assert result[layout] == {"placements": placements, "in_place": [], "fresh": [], "trained_on": []}


def test_a_checkpoint_of_another_two_dimensional_mesh_is_refused_naming_it(
    outcome: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = outcome
    for result in results:
        assert "ShardingMismatchError" in result["other_mesh"], result["other_mesh"]
        assert "checkpoint mesh (2, 2) replicate,shard vs this process (2, 2) dp,tp" in result["other_mesh"]
        assert result["other_mesh_untouched"] == []


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_four_ranks_exported_by_one_process_load_whole_into_an_unsharded_model(
    outcome: tuple[Path, list[dict[str, Any]]], layout: str
) -> None:
    shm, _ = outcome
    directory = shm / f"{layout}-export"
    with contextlib.ExitStack() as stack:
        shards = [
            stack.enter_context(SlotStore(shm / f"{layout}-{rank}").open_read(SAVED)) for rank in range(WORLD)
        ]
        export_shards(shards, directory)
    torch.manual_seed(1)
    model = Tiny(hidden=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(torch.randn(5, 6)).sum().backward()
    optimizer.step()  # optimizer states exist, with other values
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    load_alone(directory, state)
    optimizer.load_state_dict(state["optimizer"])
    actual = {f"model.{key}": value for key, value in model.state_dict().items()}
    for index, values in optimizer.state_dict()["state"].items():
        actual.update({f"optimizer.{index}.{key}": value for key, value in values.items()})
    assert bit_differences(torch.load(shm / f"{layout}-whole.pt"), actual) == []
