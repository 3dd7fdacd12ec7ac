"""A tiny GPT-style decoder trained with FSDP2 (`fully_shard` over gloo: on a 1-D CPU mesh; with --shard-group
on a 2-D HSDP mesh; with --tensor-parallel on a 2-D mesh whose second dimension splits the MLPs) and AdamW,
with the buffers real transformers register: a causal mask (saved in the state dict) and RoPE cos/sin
tables (non-persistent). Parameters and AdamW states are DTensors sharded on dim 0; Castor saves each rank's
shards every iteration and restores them in place.

Runs under `castor agent`, or standalone (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, CASTOR_SHM_DIR set
by the caller). Batches depend only on (iteration, rank), so a resumed run computes exactly what an
uninterrupted one computes. Each rank appends JSON events to --log-dir/rank-<r>.jsonl like train_ddp.py:
"start" (the restored iteration and the digest of its shards right after the restore), "iteration" (the
digest right after that iteration's optimizer step, before its save) and "done". With --holdable, while
--log-dir/hold exists every rank stops after the same iteration's save, or after the first at or past the
iteration the file names (event "paused"; the ranks agree with a tiny all-reduce; they go on once it is
removed or names a later iteration): a test strikes its fault there, however late a loaded host lets it
act, and the state is not changed by it."""

from __future__ import annotations

import argparse
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from e2e_workload import EventLog, state_digest  # a sibling module (see its docstring)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from worker_lib import Checkpointer
from worker_lib.examples.train_mlp import end_process

VOCAB, DIM, HEADS, LAYERS, CONTEXT = 96, 32, 2, 2, 16


def rope_tables(context: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inverse = 1.0 / (10_000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(context, dtype=torch.float32), inverse)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        mask = torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask)  # persistent: in the state dict, as in many GPT codes
        cos, sin = rope_tables(CONTEXT, DIM // HEADS)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, DIM // HEADS).unbind(2)
        cos, sin = self.rope_cos[:length, None], self.rope_sin[:length, None]  # over the heads
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(DIM // HEADS)
        attention = (scores + self.causal_mask[:length, :length]).softmax(-1)
        x = x + self.proj(torch.einsum("bhqk,bkhd->bqhd", attention, v).reshape(batch, length, DIM))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def holds(hold: Path, iteration: int) -> bool:
    """Whether `hold` stops this rank after `iteration`: it exists and is empty, or names an iteration at or
    before this one (a test that holds the ranks at an iteration ahead of them writes its number)."""
    try:
        at = hold.read_text().strip()
    except FileNotFoundError:
        return False
    return not at or iteration >= int(at)


def held(hold: Path, iteration: int) -> bool:
    """Whether any rank's `holds` says stop: every rank gets the same answer, so all stop after the same
    iteration."""
    flag = torch.tensor([1.0 if holds(hold, iteration) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per iteration")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument(
        "--shard-group",
        type=int,
        default=0,
        help="HSDP: shard over groups of this many consecutive ranks (one machine's), replicate across "
        "them (a 2-D mesh); 0: shard over every rank (1-D)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=0,
        help="split each block's MLP over groups of this many consecutive ranks (tensor parallel), and shard "
        "with FSDP2 across them (a 2-D mesh); 0: no tensor parallelism",
    )
    parser.add_argument(
        "--holdable",
        action="store_true",
        help="every rank stops after an iteration while <log-dir>/hold exists (if it names an iteration: "
        "after the first at or past it)",
    )
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    torch.manual_seed(0)  # the same initial model on every rank, before it is sharded
    model = Decoder()
    batch_seed = rank  # the ranks of a tensor-parallel group need the same batch
    if args.tensor_parallel:
        shape = (world_size // args.tensor_parallel, args.tensor_parallel)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh, batch_seed = mesh["dp"], rank // args.tensor_parallel
    elif args.shard_group:
        shape = (world_size // args.shard_group, args.shard_group)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    event = EventLog(args.log_dir, rank)
    with Checkpointer() as checkpointer:
        restored = checkpointer.restore(into={"model": model, "optimizer": optimizer})
        start = 0 if restored is None else restored.iteration + 1
        event(
            event="start",
            restored=None if restored is None else restored.iteration,
            digest=state_digest(model, optimizer),
        )
        for iteration in range(start, args.iterations):
            generator = torch.Generator().manual_seed(10_000 * iteration + batch_seed)
            tokens = torch.randint(VOCAB, (4, CONTEXT + 1), generator=generator)
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            event(event="iteration", iteration=iteration, digest=state_digest(model, optimizer))
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer, "iteration": iteration})
            if args.sleep:
                time.sleep(args.sleep)
            if args.holdable and held(args.log_dir / "hold", iteration):
                event(event="paused", iteration=iteration)
                while holds(args.log_dir / "hold", iteration):  # until removed, or moved to a later iteration
                    time.sleep(0.05)
        event(event="done", iteration=args.iterations - 1, digest=state_digest(model, optimizer))
    dist.barrier()
    dist.destroy_process_group()
    event.close()
    end_process()  # never lets go of the gloo group: a torch 2.13 deadlock at exit (see its docstring)


if __name__ == "__main__":
    main()
