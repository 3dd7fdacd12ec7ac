"""FSDP2 over gloo: a DCP save keeps the buffers of save time beside DTensor shards copied in the background,
and a job restarted with more ranks is refused instead of starting fresh over its checkpoints.

Two processes train an FSDP2 model with a BatchNorm layer and save it through `dcp.save(...,
CastorWriter)` (the copy held back until the next forward has changed the running statistics) and through
`Checkpointer.save`; three new processes (the job restarted with one more rank, which holds nothing) then
restore: every rank must raise ShardingMismatchError pointing to the export, none may hang, and the old
checkpoints stay.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn

from tests.unit.worker_lib.helpers import forkserver
from tests.unit.worker_lib.test_dcp import App, bit_differences, flat, free_port
from worker_lib import Checkpointer
from worker_lib.checkpointer import RESTORE_ITERATION_ENV
from worker_lib.dcp import CastorReader, CastorWriter
from worker_lib.sharded import RESHARD_HINT, ShardingMismatchError


def build(mesh: Any, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 9), nn.BatchNorm1d(9), nn.Linear(9, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def forward(model: nn.Module, seed: int) -> torch.Tensor:
    return model(torch.randn(5, 6, generator=torch.Generator().manual_seed(seed)))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    forward(model, step).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def rank_main(rank: int, world: int, phase: str, port: int, root: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    out = Path(root) / f"{phase}-{rank}.json"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        result = (save_phase if phase == "save" else restart_phase)(rank, mesh, Path(root))
        out.write_text(json.dumps(result))
        dist.barrier()
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        os._exit(0)  # never release the gloo group at exit (torch 2.13 can deadlock there, see test_dcp)


def save_phase(rank: int, mesh: Any, root: Path) -> dict[str, Any]:
    model, optimizer = build(mesh)
    result: dict[str, Any] = {}
    with Checkpointer(root / f"dcp-{rank}") as checkpointer:
        train(model, optimizer, 0)
        state = {"app": App(model, optimizer)}
        expected = flat(App(model, optimizer).state_dict())
        release = threading.Event()
        checkpointer._background.submit(release.wait, 60)  # the copy runs after the next forward
        dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=1))
        result["committed_on_return"] = checkpointer.stats.saves_committed
        forward(model, 1)  # BatchNorm's running statistics change in place
        release.set()
        checkpointer.wait()
        result["buffers_changed"] = not torch.equal(model[1].running_mean, expected["model.1.running_mean"])
        # Only the buffers were snapshotted, not the DTensor shards (parameters, AdamW moments).
        result["snapshotted"] = sum(side.numel() for side in checkpointer._buffers._side)
        result["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model[1].buffers())
        fresh, fresh_optimizer = build(mesh, seed=5)
        train(fresh, fresh_optimizer, 9)
        dcp.load({"app": App(fresh, fresh_optimizer)}, storage_reader=CastorReader(checkpointer, iteration=1))
        result["differences"] = bit_differences(expected, flat(App(fresh, fresh_optimizer).state_dict()))
        dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=2))
        checkpointer.wait()
    with Checkpointer(root / f"native-{rank}") as checkpointer:
        for iteration in (1, 2):
            train(model, optimizer, iteration)
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer})
        checkpointer.wait()
    return result


def restart_phase(rank: int, mesh: Any, root: Path) -> dict[str, Any]:
    model, optimizer = build(mesh, seed=3)
    result: dict[str, Any] = {}
    for kind in ("native", "dcp"):
        with Checkpointer(root / f"{kind}-{rank}") as checkpointer:
            held = sorted(m.iteration for m in checkpointer._store.committed())
            try:
                if kind == "native":
                    checkpointer.restore(into={"model": model, "optimizer": optimizer})
                else:
                    CastorReader(checkpointer).select()
                outcome = "returned"
            except ShardingMismatchError as exc:
                outcome = str(exc)
            # Starting fresh deliberately: the recovery plan's (or the user's) `none`.
            os.environ[RESTORE_ITERATION_ENV] = "none"
            fresh = (checkpointer.restore(), CastorReader(checkpointer).select())
            del os.environ[RESTORE_ITERATION_ENV]
            result[kind] = {"held": held, "outcome": outcome, "fresh": list(fresh)}
    return result


def run_phase(phase: str, world: int, root: Path) -> list[dict[str, Any]]:
    forkserver()
    context = mp.start_processes(
        rank_main,
        args=(world, phase, free_port(), str(root)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    assert context is not None
    deadline = time.monotonic() + 300
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, f"{phase}: the ranks did not finish within 300 s (a hang)"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [json.loads((root / f"{phase}-{rank}.json").read_text()) for rank in range(world)]
    for result in results:
        assert "error" not in result, result["error"]
    return results


@pytest.fixture(scope="module")
def job() -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    root = Path(tempfile.mkdtemp(prefix="castor-dcp-world-", dir="/dev/shm"))
    try:
        saved = run_phase("save", 2, root)
        restarted = run_phase("restart", 3, root)
        yield saved, restarted
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_fsdp2_dcp_save_keeps_buffers_of_save_time_and_copies_shards_in_the_background(job: Any) -> None:
    saved, _ = job
    for result in saved:
        assert result["committed_on_return"] == 0  # dcp.save returned before its copy ran
        assert result["buffers_changed"]
        assert result["differences"] == []
        assert result["buffer_bytes"] <= result["snapshotted"] < result["buffer_bytes"] + 64


def test_restart_with_more_ranks_is_refused_on_every_rank_instead_of_starting_fresh(job: Any) -> None:
    _, restarted = job
    for rank, result in enumerate(restarted):
        for kind in ("native", "dcp"):
            outcome = result[kind]
            assert outcome["held"] == ([1, 2] if rank < 2 else []), (rank, kind)
            assert "saved by 2 ranks" in outcome["outcome"] and RESHARD_HINT in outcome["outcome"], (
                rank,
                kind,
                outcome["outcome"],
            )
            assert outcome["fresh"] == [None, None]
