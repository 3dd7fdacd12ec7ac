"""Benchmark of the shared-memory checkpoint store (worker_lib.Checkpointer); the last line printed is JSON.

    .venv/bin/python benchmarks/store.py            # 1 GiB of fp32 tensors of mixed sizes, 5 repetitions
    .venv/bin/python benchmarks/store.py --quick    # 64 MiB, 2 repetitions: checks that it runs

The limit is measured in the same run, on the same bytes: `memcpy_gbps` is the best copy into preallocated,
touched shared memory with every core (torch copy_ on the process's intra-op threads, or one numpy memmove
thread per core over 8 MiB chunks, whichever is faster), `memcpy_1thread_gbps` one numpy thread. Every
measurement is repeated in interleaved rounds (memcpy, save, restore, memcpy, save, restore, ...) so that a
noisy neighbour slows all of them alike; rates are the best round (medians printed too) and the ratios
to the limit are also given as the median of the per-round ratios.

Beside the rates, `cpu_ms_per_gib` gives the CPU time (every thread of the process) of the all-core memmove,
the save and the restore, and `paired_cpu_median` their per-round ratios: on a machine shared with other
work CPU time moves far less than wall time. `xxh3_from_cache_cpu_ms_per_gib` and
`xxh3_from_memory_cpu_ms_per_gib` are what the checksum costs one thread per GiB, over bytes in its L2
cache (as a save and a restore hash them) and as a pass of its own over memory.

`restore_fresh_process_s` times only the restore() call in a new interpreter (torch and the model already
there, the model's tensors touched) that has never mapped the store: the software-failure path, where the
process was killed and its replacement maps the slot the agent kept.

The stall is measured with real compute on the cores: each iteration is a matmul-bound step (about twice
a blocking save long), and iterations with and without an asynchronous save alternate (A B, B A, ...):
`stall_ms` is the median time the training thread was blocked in save() and in the optimizer step's wait
for the copy, `iteration_delta_ms` the median of the paired differences of whole iterations (what the
copy's use of the cores cost the computation as well), so drift of the machine cancels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash
from torch import nn

from worker_lib import Checkpointer

MiB = 1 << 20
GiB = 1 << 30
# Tensor sizes in MiB for 1 GiB of state; --quick scales them down by 16.
SIZES_MIB = [128] * 2 + [64] * 8 + [16] * 8 + [4] * 16 + [1] * 64
SMALL_TENSORS = 64  # bias-like tensors of 1 KiB
CHUNK = 8 * MiB  # the unit of work of the multi-threaded memmove


class Model(nn.Module):
    def __init__(self, scale: float, random: bool = True):
        super().__init__()
        sizes = [int(size * MiB * scale) // 4 for size in SIZES_MIB] + [256] * SMALL_TENSORS
        for i, numel in enumerate(sizes):
            # zeros are written too (memset): the tensors are touched either way.
            values = torch.randn(numel) if random else torch.zeros(numel)
            self.register_parameter(f"p{i}", nn.Parameter(values))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="64 MiB of state and 2 repetitions")
    parser.add_argument("--reps", type=int, help="repetitions of each copy measurement (default 5, quick 2)")
    parser.add_argument("--dir", default="/dev/shm", help="where the temporary store goes (a tmpfs)")
    parser.add_argument("--restore-child", help=argparse.SUPPRESS)  # internal: the fresh process
    args = parser.parse_args()
    scale = 1 / 16 if args.quick else 1.0
    if args.restore_child:
        restore_child(Path(args.restore_child), scale)
        return
    reps = args.reps or (2 if args.quick else 5)

    torch.manual_seed(0)
    model = Model(scale)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="castor-bench-", dir=args.dir) as scratch:
        results = run(
            model,
            Path(scratch),
            reps,
            quick=args.quick,
            stall_pairs=4 if args.quick else 12,
            rss_saves=100,
        )
    results = {"state_bytes": state_bytes, "reps": reps, "statistic": "best", **results}
    report(results)


def restore_child(directory: Path, scale: float) -> None:
    """In a fresh interpreter: time one restore() of the newest checkpoint into a touched model."""
    model = Model(scale, random=False)
    state = {"model": model}
    with Checkpointer(directory, blocking=True) as checkpointer:
        started = time.perf_counter()
        restored = checkpointer.restore(into=state)
        elapsed = time.perf_counter() - started
    assert restored is not None
    print(json.dumps({"restore_s": elapsed, "iteration": restored.iteration}))


def fresh_process_restore(directory: Path, quick: bool) -> float:
    command = [sys.executable, str(Path(__file__).resolve()), "--restore-child", str(directory)]
    if quick:
        command.append("--quick")
    output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600).stdout
    return float(json.loads(output.strip().splitlines()[-1])["restore_s"])


def run(
    model: Model, scratch: Path, reps: int, *, quick: bool, stall_pairs: int, rss_saves: int
) -> dict[str, object]:
    tensors = [p.detach() for p in model.parameters()]
    state = {"model": model}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    names = ("memcpy_1thread", "memcpy_torch", "memcpy_threads", "save", "restore", "torch_save")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # CPU seconds of every thread of the process
    fresh: list[float] = []

    def timed(name: str, action: Callable[[], object]) -> None:
        cpu_started, started = time.process_time(), time.perf_counter()
        action()
        times[name].append(time.perf_counter() - started)
        cpu[name].append(time.process_time() - cpu_started)

    # The limit: the same bytes copied into warm, pre-faulted shared memory.
    target = shared_memory(scratch / "memcpy", state_bytes)
    target_tensor = torch.from_numpy(target)
    sources = [tensor.reshape(-1).view(torch.uint8) for tensor in tensors]
    offsets = list(itertools.accumulate((s.numel() for s in sources), initial=0))
    chunks = [
        (source.numpy()[lo : lo + CHUNK], target[offset + lo : offset + min(lo + CHUNK, source.numel())])
        for source, offset in zip(sources, offsets, strict=False)
        for lo in range(0, source.numel(), CHUNK)
    ]
    cores = len(os.sched_getaffinity(0))

    def memcpy_1thread() -> None:
        for source, offset in zip(sources, offsets, strict=False):
            np.copyto(target[offset : offset + source.numel()], source.numpy())

    def memcpy_torch() -> None:  # torch's own threads (torch.get_num_threads())
        for source, offset in zip(sources, offsets, strict=False):
            target_tensor[offset : offset + source.numel()].copy_(source)

    def memcpy_threads() -> None:  # one memmove thread per core, one queue of 8 MiB chunks
        cursor = itertools.count()

        def worker() -> None:
            while (i := next(cursor)) < len(chunks):
                np.copyto(chunks[i][1], chunks[i][0])

        threads = [threading.Thread(target=worker) for _ in range(cores - 1)]
        for thread in threads:
            thread.start()
        worker()
        for thread in threads:
            thread.join()

    with Checkpointer(scratch / "store", blocking=True) as checkpointer:
        checkpointer.save(0, state)  # sizes and pre-faults the slots: a one-time cost
        memcpy_1thread()
        memcpy_threads()
        for rep in range(reps):
            timed("memcpy_1thread", memcpy_1thread)
            timed("memcpy_torch", memcpy_torch)
            timed("memcpy_threads", memcpy_threads)
            timed("save", lambda rep=rep: checkpointer.save(rep + 1, state))
            timed("restore", lambda: checkpointer.restore(into=state))
            if rep < (1 if quick else 3):  # a new interpreter and torch.save are slow: a few tries do
                fresh.append(fresh_process_restore(scratch / "store", quick))
                timed("torch_save", lambda: torch_save(state, scratch / "torch.pt"))
    blocking_save_s = statistics.median(times["save"])
    checksum = checksum_cost(tensors)

    with Checkpointer(scratch / "store") as checkpointer:
        stall = measure_stall(checkpointer, state, blocking_save_s, stall_pairs)
        rss_growth = measure_rss_growth(checkpointer, state, rss_saves)

    rates = {name: [state_bytes / t / 1e9 for t in values] for name, values in times.items()}
    # The limit of each round: the faster of the two all-core copies.
    limit = [max(a, b) for a, b in zip(rates["memcpy_torch"], rates["memcpy_threads"], strict=True)]
    best = {f"{name}_gbps": round(max(values), 2) for name, values in rates.items()}
    memcpy_gbps = max(best["memcpy_torch_gbps"], best["memcpy_threads_gbps"])
    restore_in_process_s = statistics.median(times["restore"])
    restore_fresh_process_s = statistics.median(fresh)
    paired = {
        "save_vs_memcpy": round(
            statistics.median(s / m for s, m in zip(rates["save"], limit, strict=True)), 3
        ),
        "restore_vs_memcpy": round(
            statistics.median(r / m for r, m in zip(rates["restore"], limit, strict=True)), 3
        ),
    }
    results: dict[str, object] = {
        "memcpy_gbps": memcpy_gbps,
        "memcpy_method": "torch copy_"
        if best["memcpy_torch_gbps"] >= best["memcpy_threads_gbps"]
        else (f"numpy memmove x {cores} threads"),
        "memcpy_1thread_gbps": best["memcpy_1thread_gbps"],
        "memcpy_torch_gbps": best["memcpy_torch_gbps"],
        "memcpy_threads_gbps": best["memcpy_threads_gbps"],
        "cores": cores,
        "save_gbps": best["save_gbps"],
        "restore_gbps": best["restore_gbps"],
        "torch_save_gbps": best["torch_save_gbps"],
        "paired_median": paired,
        # What the copies cost in CPU time (all threads), per GiB: on a machine whose cores are shared with
        # other work, CPU time moves far less than wall time, and it shows where the time goes.
        "cpu_ms_per_gib": {
            name: round(statistics.median(cpu[name]) * 1e3 * GiB / state_bytes, 1)
            for name in ("memcpy_threads", "memcpy_torch", "save", "restore")
        },
        "paired_cpu_median": {
            "save_vs_memcpy": round(
                statistics.median(m / s for m, s in zip(cpu["memcpy_threads"], cpu["save"], strict=True)), 3
            ),
            "restore_vs_memcpy": round(
                statistics.median(m / r for m, r in zip(cpu["memcpy_threads"], cpu["restore"], strict=True)),
                3,
            ),
        },
        **checksum,
        "restore_in_process_s": round(restore_in_process_s, 4),
        "restore_fresh_process_s": round(restore_fresh_process_s, 4),
        "blocking_save_ms": round(blocking_save_s * 1e3, 2),
        **stall,
        "rss_growth_mb": round(rss_growth / MiB, 1),
        "median": {f"{name}_gbps": round(statistics.median(values), 2) for name, values in rates.items()},
    }
    targets = {
        "save_gbps >= 1.0 x memcpy_gbps": best["save_gbps"] >= memcpy_gbps,
        "restore_gbps >= 1.0 x memcpy_gbps": best["restore_gbps"] >= memcpy_gbps,
        "restore_fresh_process_s <= 2 x restore_in_process_s": restore_fresh_process_s
        <= 2 * restore_in_process_s,
        "save_gbps >= 5 x torch_save_gbps": best["save_gbps"] >= 5 * best["torch_save_gbps"],
        "stall_ms <= 10% of blocking_save_ms": float(stall["stall_ms"]) <= 0.1 * blocking_save_s * 1e3,
        "rss_growth_mb < 50": rss_growth / MiB < 50,
    }
    return {**results, "targets": targets, "targets_met": all(targets.values())}


def checksum_cost(tensors: list[torch.Tensor]) -> dict[str, float]:
    """xxh3-64 on one thread, in CPU ms per GiB: over the state's bytes as they lie in memory (a pass of
    its own), and over 256 KiB that are in the core's L2 cache (what a save pays: each piece is hashed
    right after its copy)."""
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    arrays = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors]
    started = time.thread_time()
    for array in arrays:
        xxhash.xxh3_64_intdigest(array.data)
    from_memory = (time.thread_time() - started) * GiB / state_bytes
    piece = arrays[0][: 256 << 10].data
    rounds = max(1, state_bytes // len(piece))
    started = time.thread_time()
    for _ in range(rounds):
        xxhash.xxh3_64_intdigest(piece)
    from_cache = (time.thread_time() - started) * GiB / (rounds * len(piece))
    return {
        "xxh3_from_memory_cpu_ms_per_gib": round(from_memory * 1e3, 1),
        "xxh3_from_cache_cpu_ms_per_gib": round(from_cache * 1e3, 1),
    }


def measure_stall(
    checkpointer: Checkpointer, state: dict[str, nn.Module], blocking_save_s: float, pairs: int
) -> dict[str, float]:
    """The training thread's stall per checkpoint, with a matmul-bound step computing on the cores.

    An iteration: save() (asynchronous: it returns once the copy is handed to the copy threads), a step
    of matmuls on torch's threads (about twice a blocking save long), then an optimizer step, whose
    pre-hook waits for the copy if it is still running. Iterations without the save alternate with them,
    in pairs A B, B A, ..., and the pairs' differences give what checkpointing added to an iteration.
    """
    size = 512
    a, b, out = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
    started = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b, out=out)
    per_matmul = (time.perf_counter() - started) / 5
    matmuls = max(1, round(2 * blocking_save_s / per_matmul))
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(1)
    iteration = itertools.count(1000)

    def one(checkpoint: bool) -> tuple[float, float]:
        started = time.perf_counter()
        if checkpoint:
            checkpointer.save(next(iteration), state)
        saved = time.perf_counter()
        for _ in range(matmuls):  # forward + backward, computed on the cores
            torch.mm(a, b, out=out)
        stepping = time.perf_counter()
        optimizer.step()
        ended = time.perf_counter()
        return ended - started, saved - started + ended - stepping

    one(False), one(True)  # warm-up
    stalls: list[float] = []
    deltas: list[float] = []
    plain: list[float] = []
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        measured = {checkpoint: one(checkpoint) for checkpoint in order}
        stalls.append(measured[True][1])
        deltas.append(measured[True][0] - measured[False][0])
        plain.append(measured[False][0])
    checkpointer.wait()
    return {
        "stall_ms": round(statistics.median(stalls) * 1e3, 2),
        "step_ms": round(statistics.median(plain) * 1e3, 1),
        "iteration_delta_ms": round(statistics.median(deltas) * 1e3, 2),
        "matmuls_per_step": matmuls,
    }


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


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def report(results: dict[str, object]) -> None:
    median = results["median"]
    paired = results["paired_median"]
    paired_cpu = results["paired_cpu_median"]
    cpu = results["cpu_ms_per_gib"]
    assert isinstance(median, dict) and isinstance(paired, dict)
    assert isinstance(paired_cpu, dict) and isinstance(cpu, dict)
    cpu_ms = f"{cpu['memcpy_threads']} / {cpu['save']} / {cpu['restore']}"
    rows = [
        ("state", f"{results['state_bytes'] / MiB:.0f} MiB fp32", ""),
        ("memcpy_gbps", results["memcpy_gbps"], f"{results['memcpy_method']}, {results['cores']} cores"),
        ("memcpy_torch_gbps", results["memcpy_torch_gbps"], f"median {median['memcpy_torch_gbps']}"),
        ("memcpy_threads_gbps", results["memcpy_threads_gbps"], f"median {median['memcpy_threads_gbps']}"),
        ("memcpy_1thread_gbps", results["memcpy_1thread_gbps"], f"median {median['memcpy_1thread_gbps']}"),
        ("save_gbps", results["save_gbps"], f"median {median['save_gbps']}, {paired['save_vs_memcpy']} x"),
        (
            "restore_gbps",
            results["restore_gbps"],
            f"median {median['restore_gbps']}, {paired['restore_vs_memcpy']} x",
        ),
        ("torch_save_gbps", results["torch_save_gbps"], f"median {median['torch_save_gbps']}"),
        (
            "cpu_ms_per_gib",
            cpu_ms,
            f"paired save {paired_cpu['save_vs_memcpy']} x, restore {paired_cpu['restore_vs_memcpy']} x",
        ),
        (
            "xxh3_cpu_ms_per_gib",
            f"{results['xxh3_from_cache_cpu_ms_per_gib']} / {results['xxh3_from_memory_cpu_ms_per_gib']}",
            "one thread, from cache / from memory",
        ),
        ("restore_in_process_s", results["restore_in_process_s"], "median"),
        ("restore_fresh_process_s", results["restore_fresh_process_s"], "median, restore() call only"),
        ("blocking_save_ms", results["blocking_save_ms"], "median"),
        ("stall_ms", results["stall_ms"], f"median, matmul step {results['step_ms']} ms"),
        ("iteration_delta_ms", results["iteration_delta_ms"], "median of paired differences"),
        ("rss_growth_mb", results["rss_growth_mb"], "over 100 saves"),
    ]
    for name, value, note in rows:
        print(f"{name:<24} {value!s:>14}  {note}")
    targets = results["targets"]
    assert isinstance(targets, dict)
    for target, met in targets.items():
        print(f"{'ok ' if met else 'MISS'} {target}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
