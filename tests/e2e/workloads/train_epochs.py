"""Epochs over a DataLoader, resumable exactly (the README's "Resuming exactly" example, with logging): a
data-parallel model with dropout (torch's global RNG), inputs perturbed with numpy's and Python's global
RNGs, a sampler that reshuffles every epoch and can start in the middle of one. The checkpoint holds the
model, the optimizer, the epoch, the batch within it and the RNG states, so a run killed mid-epoch and
resumed computes bit for bit what an uninterrupted run computes.

Runs under `castor agent`, or standalone (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, CASTOR_SHM_DIR set
by the caller). Each rank appends JSON events to --log-dir/rank-<r>.jsonl like train_ddp.py: "start" (the
restored iteration and the state digest after the restore) and "iteration" (epoch, batch and the digest
of model and optimizer after the step), and "done" with the digest at the end. `--pause-at K,...`: after
iteration K's save every rank waits for --log-dir/go-K (e2e_workload.pause_if_asked)."""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from e2e_workload import EventLog, iterations_arg, pause_if_asked, state_digest  # a sibling module
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler, TensorDataset

from worker_lib import Checkpointer, restore_rng_state, rng_state
from worker_lib.examples.train_mlp import end_process


class ResumableSampler(Sampler[int]):
    """This rank's share of a permutation drawn from (seed, epoch), from position `start` on: the order of
    an epoch depends on the epoch alone, so a resumed run can skip what it already trained on."""

    def __init__(self, size: int, rank: int, world_size: int, seed: int = 0):
        self.size, self.rank, self.world_size, self.seed = size, rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start :])

    def __len__(self) -> int:
        return len(self._indices()) - self.start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)  # gradients over 1 MiB: several DDP buckets
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per iteration")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument(
        "--pause-at",
        type=iterations_arg,
        default=set(),
        help="comma-separated iterations after whose save every rank waits for <log-dir>/go-<iteration>",
    )
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    data = torch.Generator().manual_seed(1234)
    inputs = torch.randn(args.samples, args.width, generator=data)
    dataset = TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    sampler = ResumableSampler(len(dataset), rank, world_size)
    # The loader's own generator: creating an iterator draws a seed from it, and from the global generator
    # without one, which would shift the global stream when a resumed run creates its iterator mid-epoch.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator())

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    )
    # find_unused_parameters=True: buckets fixed at construction, so a DDP built after a restart sums
    # gradients in the same order as the long-running one (see the README).
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + rank)  # per-rank randomness from here on (dropout, noise)
    numpy.random.seed(200 + rank)
    random.seed(300 + rank)

    event = EventLog(args.log_dir, rank)

    with Checkpointer() as checkpointer:
        restored = checkpointer.restore(into={"model": model, "optimizer": optimizer})
        iteration, epoch, batch = 0, 0, 0
        if restored is not None:
            iteration = restored.iteration + 1
            epoch, batch = restored.state["epoch"], restored.state["batch"] + 1
            restore_rng_state(restored.state["rng"])
        event(
            event="start",
            restored=None if restored is None else restored.iteration,
            digest=state_digest(model, optimizer),
        )
        while epoch < args.epochs:
            sampler.set_epoch(epoch, start=batch * args.batch_size)
            for batch, (x, y) in enumerate(loader, start=batch):  # noqa: B020 (resumes the outer position)
                noise = torch.from_numpy(numpy.random.normal(0, 0.01, x.shape).astype(numpy.float32))
                scale = random.uniform(0.9, 1.1)
                loss = torch.nn.functional.mse_loss(ddp((x + noise) * scale), y * scale)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                event(
                    event="iteration",
                    iteration=iteration,
                    epoch=epoch,
                    batch=batch,
                    digest=state_digest(model, optimizer),
                )
                state = {
                    "model": model,
                    "optimizer": optimizer,
                    "epoch": epoch,
                    "batch": batch,
                    "rng": rng_state(),
                }
                checkpointer.save(iteration, state)
                pause_if_asked(args.log_dir, iteration, args.pause_at, event, checkpointer)
                iteration += 1
                if args.sleep:
                    time.sleep(args.sleep)
            epoch, batch = epoch + 1, 0
        event(event="done", iteration=iteration - 1, digest=state_digest(model, optimizer))
    dist.barrier()
    dist.destroy_process_group()
    event.close()
    end_process()  # never lets go of the gloo group: see its docstring (a torch 2.13 deadlock at exit)


if __name__ == "__main__":
    main()
