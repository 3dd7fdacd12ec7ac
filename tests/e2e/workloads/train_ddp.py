"""A small data-parallel training job written for torchrun (reads RANK/WORLD_SIZE, gloo on CPU) that
checkpoints every iteration with Castor. Batches depend only on (iteration, rank), so a run resumed from
iteration I computes exactly what an uninterrupted run computes. Each rank appends JSON events to
--log-dir/rank-<r>.jsonl: "start" (with the restored iteration and the state digest right after the
restore) and "iteration" (the state digest right after that iteration's optimizer step, before its save)."""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from e2e_workload import EventLog, iterations_arg, pause_if_asked, state_digest  # a sibling module
from torch.nn.parallel import DistributedDataParallel

from worker_lib import Checkpointer, attach


def _stuck_in_a_deadlock() -> None:
    while True:
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per iteration")
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--embedded", action="store_true", help="plain torchrun: attach to Castor here")
    parser.add_argument("--crash-at", type=int, default=None, help="rank 1 exits once at this iteration")
    parser.add_argument(
        "--hang-at", type=int, default=None, help="rank 1 hangs once after committing this iteration"
    )
    parser.add_argument(
        "--hang-file", type=Path, default=None, help="rank 1 hangs once after a commit once this file exists"
    )
    parser.add_argument(
        "--pause-at",
        type=iterations_arg,
        default=set(),
        help="every rank waits after these iterations' saves for --log-dir/go-<iteration>",
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=None,
        help="gloo's timeout of training's all-reduce (torch's default: 30 min): a rank cut off fails sooner",
    )
    parser.add_argument(
        "--print-environ", action="store_true", help="print the environment to stdout (the agent's log)"
    )
    args = parser.parse_args()
    if args.print_environ:  # what a tracker recording the environment would see
        print("environ:", json.dumps(dict(os.environ), sort_keys=True), flush=True)
    if args.embedded:
        env = os.environ
        attach(env["CASTOR_ROOT_URL"], env["CASTOR_JOB_ID"], env["CASTOR_WORKER_TOKEN"])

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
    group = None
    if args.collective_timeout_s is not None:
        # Training's all-reduce only: the rendezvous keeps torch's timeout (restarted ranks join late).
        timeout = timedelta(seconds=args.collective_timeout_s)
        group = dist.new_group(backend="gloo", timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    ddp = DistributedDataParallel(model, process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    event = EventLog(args.log_dir, rank)
    with Checkpointer() as checkpointer:
        restored = checkpointer.restore(into={"model": model, "optimizer": optimizer})
        start = 0 if restored is None else restored.iteration + 1
        event(
            event="start",
            restored=None if restored is None else restored.iteration,
            digest=state_digest(model, optimizer),
            generation=os.environ.get("CASTOR_GENERATION"),
        )
        for iteration in range(start, args.iterations):
            generator = torch.Generator().manual_seed(10_000 * iteration + rank)
            inputs = torch.randn(32, args.width, generator=generator)
            targets = inputs.sum(dim=1, keepdim=True)
            loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            # Logged before the save: a process killed at any instant has logged every iteration it may
            # have committed, so a restored iteration can always be checked against its logged digest.
            event(
                event="iteration",
                iteration=iteration,
                digest=state_digest(model, optimizer),
                loss=loss.item(),
            )
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer, "iteration": iteration})
            checkpointer.wait()
            pause_if_asked(args.log_dir, iteration, args.pause_at, event, checkpointer)
            if args.sleep:
                time.sleep(args.sleep)
            crash_marker = args.log_dir / "crashed"
            if args.crash_at == iteration and rank == 1 and not crash_marker.exists():
                crash_marker.touch()
                os._exit(17)  # a software failure, once
            hang_marker = args.log_dir / "hung"
            hang_now = args.hang_at == iteration or (args.hang_file is not None and args.hang_file.exists())
            if hang_now and rank == 1 and not hang_marker.exists():
                hang_marker.touch()
                _stuck_in_a_deadlock()  # alive, silent: only a hang watchdog ends it (the others block in
                # the next all-reduce)
    # A rank still here a minute later (a hang at the end) dumps every thread's stack into its log.
    faulthandler.dump_traceback_later(60)
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    # torch 2.13 can deadlock here, when main()'s frame lets go of `ddp` (seen in about 1 of 10 runs on a
    # saturated host, any rank): the gloo process group's destructor, run by that release with the GIL held,
    # joins its worker threads, while a worker deleting the barrier's work (which holds the last reference to
    # a DDP allreduce work, whose thread-local state keeps the contextvars.Context that backward() stashes)
    # waits for the GIL. End the process without letting go of the group, after what a normal exit runs
    # (the embedded mode's exit handler: last replicas, `finished`, serving peers until the job completes).
    event.close()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
