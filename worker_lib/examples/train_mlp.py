"""A small data-parallel training job with Castor checkpoints, written for torchrun or `castor agent`.

    castor agent --root URL --job ID --token-file worker-token -- \\
        python -m worker_lib.examples.train_mlp --iterations 200

It reads the torchrun environment, trains an MLP with DistributedDataParallel over gloo (CPU), checkpoints
every iteration into shared memory and, after a failure, resumes from the iteration the recovery plan
chose. The data of an iteration depends only on the iteration and the rank, so a resumed run computes
exactly what an uninterrupted one would.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from worker_lib import Checkpointer


@record  # an uncaught exception goes to TORCHELASTIC_ERROR_FILE: the failure page shows it
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="extra seconds per iteration (a bigger model)"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    with Checkpointer() as checkpointer:
        restored = checkpointer.restore(into={"model": model, "optimizer": optimizer})
        start = 0 if restored is None else restored.iteration + 1
        if rank == 0:
            print(
                f"generation {os.environ.get('CASTOR_GENERATION', '?')}: starting at iteration {start}",
                flush=True,
            )
        for iteration in range(start, args.iterations):
            generator = torch.Generator().manual_seed(10_000 * iteration + rank)
            inputs = torch.randn(64, args.width, generator=generator)
            loss = torch.nn.functional.mse_loss(ddp(inputs), inputs.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer})
            if rank == 0 and iteration % 20 == 0:
                print(f"iteration {iteration}: loss {loss.item():.4f}", flush=True)
            if args.sleep:
                time.sleep(args.sleep)
    dist.destroy_process_group()
    end_process()


def end_process() -> None:
    """Exit without letting go of the gloo process group. torch 2.13 can deadlock when the last reference
    to a DDP model goes at the end of main() (seen in about 1 of 25 runs, any rank): the group's destructor
    joins its worker threads with the GIL held, while a worker freeing a finished allreduce (whose
    thread-local state keeps the contextvars.Context that backward() stores) waits for the GIL. The exit
    handlers run first (the embedded mode's: last replicas, `finished`)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
