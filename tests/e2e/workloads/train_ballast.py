"""A data-parallel job (gloo on CPU, torchrun's environment) whose checkpoint is large but whose step is
cheap: a small model and Adam, plus a `--ballast-mb` tensor saved with them that each iteration changes in
one row. Training's all-reduce carries only the small model's gradients, so on an emulated 1 Gbit/s NIC a
checkpoint takes several iterations to replicate while an iteration stays short. Batches and the ballast's
update depend only on (iteration, rank): a run resumed from iteration I computes bit for bit what an
uninterrupted run computes. Each rank appends JSON events to --log-dir/rank-<r>.jsonl like train_ddp.py:
"start" (restored iteration, state digest after the restore), "iteration" (digest right after the step,
before its save) and "done" (digest at the end).

`--pause-at K,...` (e2e_workload.pause_if_asked): after iteration K's save every rank logs "paused" and
waits for --log-dir/go-K, so a test strikes its faults where it means to on a host of any speed (the state
does not depend on the wait)."""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash
from e2e_workload import EventLog, iterations_arg, pause_if_asked  # a sibling module (see its docstring)
from torch.nn.parallel import DistributedDataParallel

from worker_lib import Checkpointer

ROWS = 16  # the ballast changes one row an iteration


def _digest(*tensors: torch.Tensor) -> str:
    hasher = xxhash.xxh3_64()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
    return hasher.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--ballast-mb", type=int, default=32)
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
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    # find_unused_parameters=True: buckets fixed at construction, so a DDP built after a restart sums
    # gradients in the same order as the long-running one (as train_epochs.py).
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ballast = torch.zeros(ROWS, args.ballast_mb * 2**20 // 4 // ROWS)

    def digest() -> str:
        optimizer_state = [
            v
            for s in optimizer.state_dict()["state"].values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        return _digest(*model.state_dict().values(), *optimizer_state, ballast)

    event = EventLog(args.log_dir, rank)
    state = {"model": model, "optimizer": optimizer, "ballast": ballast}
    with Checkpointer() as checkpointer:
        restored = checkpointer.restore(into=state)
        start = 0 if restored is None else restored.iteration + 1
        event(event="start", restored=None if restored is None else restored.iteration, digest=digest())
        for iteration in range(start, args.iterations):
            generator = torch.Generator().manual_seed(10_000 * iteration + rank)
            inputs = torch.randn(32, args.width, generator=generator)
            loss = torch.nn.functional.mse_loss(ddp(inputs), inputs.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ballast[iteration % ROWS] += float(iteration + 1 + rank)
            # Logged before the save, as train_ddp.py says why.
            event(event="iteration", iteration=iteration, digest=digest())
            checkpointer.save(iteration, {**state, "iteration": iteration})
            checkpointer.wait()
            if args.sleep:
                time.sleep(args.sleep)
            pause_if_asked(args.log_dir, iteration, args.pause_at, event, checkpointer)
        event(event="done", digest=digest())
    dist.barrier()
    # As train_ddp.py (which says why): end without letting go of the process group.
    event.close()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
