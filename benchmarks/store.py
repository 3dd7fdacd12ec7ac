"""Benchmark of the shared-memory checkpoint store (worker_lib.Checkpointer); the last line printed is JSON.

    .venv/bin/python benchmarks/store.py            # 1 GiB of fp32 tensors of mixed sizes, 5 repetitions
    .venv/bin/python benchmarks/store.py --quick    # 64 MiB, 2 repetitions: checks that it runs

Copy rates are the best of the repetitions (their median is printed too); the repetitions of the copy
measurements are interleaved so that a noisy neighbour slows all of them alike. stall_ms and
blocking_save_ms are medians.

The simulated forward/backward is a sleep: on a GPU machine the training thread mostly waits for the GPU
while forward and backward run, which leaves the CPU free for the background copy. A CPU-bound stand-in on
this 2-core machine would instead measure two copy threads and a compute thread fighting over two cores.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from worker_lib import Checkpointer

MiB = 1 << 20
# Tensor sizes in MiB for 1 GiB of state; --quick scales them down by 16.
SIZES_MIB = [128] * 2 + [64] * 8 + [16] * 8 + [4] * 16 + [1] * 64
SMALL_TENSORS = 64  # bias-like tensors of 1 KiB


class Model(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        sizes = [int(size * MiB * scale) // 4 for size in SIZES_MIB] + [256] * SMALL_TENSORS
        for i, numel in enumerate(sizes):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(numel)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB of state and 2 repetitions")
    parser.add_argument("--reps", type=int, help="repetitions of each copy measurement (default 5, quick 2)")
    parser.add_argument("--dir", default="/dev/shm", help="where the temporary store goes (a tmpfs)")
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    scale = 1 / 16 if args.quick else 1.0

    torch.manual_seed(0)
    model = Model(scale)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="castor-bench-", dir=args.dir) as scratch:
        results = run(model, Path(scratch), reps, stall_iterations=3 if args.quick else 10, rss_saves=100)
    results = {"state_bytes": state_bytes, "reps": reps, "statistic": "best", **results}
    report(results)


def run(model: Model, scratch: Path, reps: int, stall_iterations: int, rss_saves: int) -> dict[str, object]:
    tensors = [p.detach() for p in model.parameters()]
    state = {"model": model}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    times: dict[str, list[float]] = {"memcpy": [], "save": [], "restore": [], "torch_save": []}

    # The one-core limit: the same bytes copied by one thread into warm, pre-faulted shared memory.
    target = shared_memory(scratch / "memcpy", state_bytes)

    def memcpy() -> None:
        offset = 0
        for tensor in tensors:
            source = tensor.view(torch.uint8).numpy()
            np.copyto(target[offset : offset + source.size], source)
            offset += source.size

    with Checkpointer(scratch / "store", blocking=True) as checkpointer:
        checkpointer.save(0, state)  # sizes and pre-faults the slots: a one-time cost
        memcpy()
        for rep in range(reps):
            times["memcpy"].append(timed(memcpy))
            times["save"].append(timed(lambda rep=rep: checkpointer.save(rep + 1, state)))
            times["restore"].append(timed(lambda: checkpointer.restore(into=state)))
            if rep < 3:  # torch.save is slow: three tries are enough
                times["torch_save"].append(timed(lambda: torch_save(state, scratch / "torch.pt")))
    blocking_save_s = statistics.median(times["save"])

    with Checkpointer(scratch / "store") as checkpointer:
        stall_s, step_s = measure_stall(checkpointer, state, blocking_save_s, stall_iterations)
        rss_growth = measure_rss_growth(checkpointer, state, rss_saves)

    rates = {name: [state_bytes / t / 1e9 for t in values] for name, values in times.items()}
    best = {f"{name}_gbps": round(max(values), 2) for name, values in rates.items()}
    results: dict[str, object] = {
        **best,
        "stall_ms": round(stall_s * 1e3, 2),
        "blocking_save_ms": round(blocking_save_s * 1e3, 2),
        "rss_growth_mb": round(rss_growth / MiB, 1),
        "simulated_step_ms": round(step_s * 1e3, 1),
        "median": {f"{name}_gbps": round(statistics.median(values), 2) for name, values in rates.items()},
    }
    targets = {
        "save_gbps >= 0.8 x memcpy_gbps": best["save_gbps"] >= 0.8 * best["memcpy_gbps"],
        "save_gbps >= 5 x torch_save_gbps": best["save_gbps"] >= 5 * best["torch_save_gbps"],
        "restore_gbps >= 0.8 x memcpy_gbps": best["restore_gbps"] >= 0.8 * best["memcpy_gbps"],
        "stall_ms <= 10% of blocking_save_ms": stall_s <= 0.1 * blocking_save_s,
        "rss_growth_mb < 50": rss_growth / MiB < 50,
    }
    return {**results, "targets": targets, "targets_met": all(targets.values())}


def measure_stall(
    checkpointer: Checkpointer, state: dict[str, nn.Module], blocking_save_s: float, iterations: int
) -> tuple[float, float]:
    """Median time the training thread is blocked per checkpoint when save() overlaps the next step.

    Each iteration: save() (returns once the copy is handed to the background threads), a simulated
    forward/backward twice as long as a blocking save, then an optimizer step, whose pre-hook waits for
    the copy if it is still running. Blocked time = time in save() + time in step().
    """
    step_s = 2 * blocking_save_s
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(1)
    stalls = []
    for iteration in range(iterations):
        started = time.perf_counter()
        checkpointer.save(1000 + iteration, state)
        saved = time.perf_counter()
        time.sleep(step_s)  # forward + backward on the accelerator
        stepping = time.perf_counter()
        optimizer.step()
        stalls.append(saved - started + time.perf_counter() - stepping)
    return statistics.median(stalls), step_s


def measure_rss_growth(checkpointer: Checkpointer, state: dict[str, nn.Module], saves: int) -> int:
    """Resident memory growth over `saves` consecutive saves after the first (which sizes the slots)."""
    checkpointer.save(2000, state)
    checkpointer.wait()
    before = rss_bytes()
    for iteration in range(saves):
        checkpointer.save(2001 + iteration, state)
        checkpointer.wait()
    return rss_bytes() - before


def shared_memory(path: Path, nbytes: int) -> np.ndarray:
    with open(path, "wb+") as file:
        os.posix_fallocate(file.fileno(), 0, nbytes)
        mapping = mmap.mmap(file.fileno(), nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return np.frombuffer(mapping, dtype=np.uint8)


def torch_save(state: dict[str, nn.Module], path: Path) -> None:
    path.unlink(missing_ok=True)
    torch.save(state["model"].state_dict(), path)


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def report(results: dict[str, object]) -> None:
    median = results["median"]
    assert isinstance(median, dict)
    rows = [
        ("state", f"{results['state_bytes'] / MiB:.0f} MiB fp32", ""),
        ("memcpy_gbps", results["memcpy_gbps"], f"median {median['memcpy_gbps']}"),
        ("save_gbps", results["save_gbps"], f"median {median['save_gbps']}"),
        ("restore_gbps", results["restore_gbps"], f"median {median['restore_gbps']}"),
        ("torch_save_gbps", results["torch_save_gbps"], f"median {median['torch_save_gbps']}"),
        ("blocking_save_ms", results["blocking_save_ms"], "median"),
        ("stall_ms", results["stall_ms"], f"median, simulated step {results['simulated_step_ms']} ms"),
        ("rss_growth_mb", results["rss_growth_mb"], "over 100 saves"),
    ]
    for name, value, note in rows:
        print(f"{name:<18} {value!s:>14}  {note}")
    targets = results["targets"]
    assert isinstance(targets, dict)
    for target, met in targets.items():
        print(f"{'ok ' if met else 'MISS'} {target}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
