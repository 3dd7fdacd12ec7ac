"""What the e2e training workloads share (train_ddp.py, train_fsdp2.py, train_ballast.py, train_epochs.py):
the digest of a rank's state, the per-rank JSON event log the tests read (tests/e2e/cluster.py's
read_events) and pause points. Imported as a sibling module: a workload runs as a script, cold or in a warm
spare, with its own directory first on sys.path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import xxhash
from torch.distributed.tensor import DTensor

from worker_lib import Checkpointer


def _bytes(value: torch.Tensor) -> bytes:
    local = value.to_local() if isinstance(value, DTensor) else value  # a rank's own shard, no all-gather
    return local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """xxh3 over this rank's bytes of every tensor in the model's state dict (parameters, persistent
    buffers) and every optimizer state tensor: equal iff bit-exact."""
    hasher = xxhash.xxh3_64()
    for tensor in model.state_dict().values():
        hasher.update(_bytes(tensor))
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                hasher.update(_bytes(value))
    return hasher.hexdigest()


class EventLog:
    """Appends one JSON object a line to `log_dir`/rank-<rank>.jsonl, line-buffered: a process killed at
    any instant has written every event it logged."""

    def __init__(self, log_dir: Path, rank: int):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._file = (log_dir / f"rank-{rank}.jsonl").open("a", buffering=1)

    def __call__(self, **fields: object) -> None:
        record = {"rank": self.rank, "time": time.time(), "pid": os.getpid(), **fields}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def iterations_arg(text: str) -> set[int]:
    """`--pause-at`'s value: comma-separated iterations."""
    return {int(i) for i in text.split(",")}


def pause_if_asked(
    log_dir: Path, iteration: int, pause_at: set[int], event: EventLog, checkpointer: Checkpointer
) -> None:
    """After `iteration`'s save, if it is in `pause_at`: wait for the save to commit, log "paused" and wait
    for `log_dir`/go-<iteration>.
    A test strikes its fault while every rank waits at the same known iteration, on a host of any speed
    (tests/e2e/recovery_checks.py's wait_for_pause); the state does not depend on the wait. A run resumed
    from before that iteration passes it again without waiting once the test has let it go."""
    if iteration not in pause_at:
        return
    checkpointer.wait()
    event(event="paused", iteration=iteration)
    while not (log_dir / f"go-{iteration}").exists():
        time.sleep(0.05)
