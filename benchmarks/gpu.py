"""What checkpointing every iteration costs a model trained on a GPU; the last line printed is JSON.

    python benchmarks/gpu.py            # a GPT-style decoder of ~340 M parameters on the current CUDA device
    python benchmarks/gpu.py --quick    # a small decoder, 3 rounds: checks that it runs

Without a CUDA device it prints {"skipped": ...} and exits 0 (the development machine and CI have none).

The decoder is benchmarks/models.py's (a causal mask per block as a registered buffer, RoPE tables), in
fp32 with bf16 autocast, trained by AdamW (its `step` counters on the host, the default). One iteration is a
forward, a backward and an AdamW step, ending in `torch.cuda.synchronize()`, in four variants run interleaved
one iteration each per round, in an order that rotates from round to round:

- `none`: no checkpoint;
- `memcpy`: before the forward, a plain synchronous copy of every state tensor into preallocated pinned
  host memory (`copy_(non_blocking=True)`, then a synchronize): the simplest checkpoint to host memory;
- `castor_direct`: before the forward, `Checkpointer.save(i, {"model": model, "optimizer": optimizer})`
  with the default settings: the device tensors are copied straight into the slot (registered with the
  CUDA host allocator), and the optimizer step waits for those copies on the device;
- `castor_staged`: the same with CASTOR_CUDA_DIRECT=0: the device tensors are copied into a pinned staging
  buffer, the background thread copies that into the shared-memory slot, and the optimizer step waits for
  the save on the host.

Overheads are the median per-round difference from `none` over the median `none` iteration; `stall_pct` the
median share of an iteration the training thread spent blocked inside Castor (`stats.stalled_s`: save()
calls and fences). `staging_bytes_*` is the pinned host memory each castor variant holds besides the slots.
The `d2h_gbps_*` figures are single device-to-host copies of 1 GiB into pageable, pinned, and registered
shared memory (the slot's kind of memory), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from models import Decoder, Shape, report, state_tensors

from worker_lib import Checkpointer
from worker_lib.checkpointer import fenced_save_threads
from worker_lib.store.copy import default_threads
from worker_lib.store.cuda import DIRECT_ENV, HostRegistration

FULL = Shape(vocab=32768, width=1024, layers=24, heads=16, context=1024, batch=16)
QUICK = Shape(vocab=1024, width=256, layers=2, heads=4, context=128, batch=4)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small decoder and 3 rounds")
    parser.add_argument("--rounds", type=int, help="rounds of one iteration per variant (default 8)")
    parser.add_argument("--dir", default="/dev/shm", help="where the temporary store goes (a tmpfs)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return
    directory = Path(tempfile.mkdtemp(prefix="castor-gpu-bench-", dir=args.dir))
    try:
        results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        results.update(copy_rates(directory, (64 << 20) if args.quick else (1 << 30)))
        results.update(run(QUICK if args.quick else FULL, args.rounds or (3 if args.quick else 8), directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(results)


def copy_rates(directory: Path, nbytes: int) -> dict[str, float]:
    """One device-to-host copy of `nbytes` into pageable, pinned and registered shared memory (best of 3)."""
    source = torch.randn(nbytes // 4, device="cuda")

    def rate(target: torch.Tensor) -> float:
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            best = max(best, nbytes / (time.perf_counter() - started) / 1e9)
        return round(best, 1)

    rates = {"d2h_gbps_pageable": rate(torch.zeros(nbytes // 4))}
    rates["d2h_gbps_pinned"] = rate(torch.empty(nbytes // 4, pin_memory=True))
    path = directory / "rates.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        shared = torch.frombuffer(mapping, dtype=torch.float32)
        rates["d2h_gbps_shm_unregistered"] = rate(shared)
        started = time.perf_counter()
        with HostRegistration(shared.data_ptr(), nbytes):
            rates["register_ms_per_gib"] = round(1e3 * (time.perf_counter() - started) / (nbytes / 2**30), 1)
            rates["d2h_gbps_shm_registered"] = rate(shared)
        del shared
        mapping.close()
    finally:
        os.close(fd)
        path.unlink()
    return rates


def run(shape: Shape, rounds: int, directory: Path) -> dict[str, object]:
    torch.manual_seed(0)
    model = Decoder(shape).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(shape.vocab, (shape.batch, shape.context + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def train_step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs)
        F.cross_entropy(logits.float().reshape(-1, shape.vocab), targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    train_step()  # AdamW's moments exist from here on: the state has its full size
    state = {"model": model, "optimizer": optimizer}
    sources = state_tensors(model, optimizer)
    copies = [torch.empty_like(source, device="cpu", pin_memory=True) for source in sources]
    checkpointer = Checkpointer(directory / "store")
    iteration = iter(range(1, 1_000_000))

    def none() -> None:
        train_step()

    def memcpy() -> None:
        for copy, source in zip(copies, sources, strict=True):
            copy.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        train_step()

    def castor(direct: bool) -> Callable[[], None]:
        def variant() -> None:
            os.environ[DIRECT_ENV] = "1" if direct else "0"
            checkpointer.save(next(iteration), state)
            train_step()

        return variant

    variants: dict[str, Callable[[], None]] = {
        "none": none,
        "memcpy": memcpy,
        "castor_direct": castor(True),
        "castor_staged": castor(False),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    stalls: dict[str, list[float]] = {"castor_direct": [], "castor_staged": []}
    copy_s: dict[str, list[float]] = {"castor_direct": [], "castor_staged": []}
    save_calls: dict[str, list[float]] = {"castor_direct": [], "castor_staged": []}
    direct_bytes = 0
    fenced_before = 0
    consecutive: dict[str, list[float]] = {"none": [], "castor_direct": []}
    consecutive_stalls: list[float] = []
    try:
        # Warm-up: the slots are mapped, registered and touched by the first saves; the direct variant
        # first, so what it pinned for staging (nothing, when every device tensor went to the slot) shows.
        variants["castor_direct"]()
        variants["castor_direct"]()
        direct_staging_bytes = checkpointer.stats.staging_bytes
        for name in variants:
            variants[name]()
        fenced_before = checkpointer.stats.steps_fenced_on_device
        names = list(variants)
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                stalled_before = checkpointer.stats.stalled_s
                started = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - started)
                if name in stalls:
                    stalls[name].append(checkpointer.stats.stalled_s - stalled_before)
                    save_calls[name].append(checkpointer.stats.last_save_s)
                    checkpointer.wait()  # the copy's own time, from its background start to the commit
                    copy_s[name].append(checkpointer.stats.last_copy_s)
                    if name == "castor_direct":
                        direct_bytes = checkpointer.stats.last_direct_bytes
            measured = ", ".join(f"{n} {times[n][-1]:.3f} s" for n in order)
            print(f"round {round_ + 1}/{rounds}: {measured}", flush=True)
        staged_bytes = checkpointer.stats.staging_bytes
        fenced = checkpointer.stats.steps_fenced_on_device - fenced_before
        # Every iteration checkpointed, back to back: the next save also waits for the previous one's
        # checksums and commit if they take longer than an iteration.
        for name in ("none", "castor_direct"):
            for _ in range(rounds):
                stalled_before = checkpointer.stats.stalled_s
                started = time.perf_counter()
                variants[name]()
                consecutive[name].append(time.perf_counter() - started)
                if name == "castor_direct":
                    consecutive_stalls.append(checkpointer.stats.stalled_s - stalled_before)
    finally:
        checkpointer.close()
        os.environ.pop(DIRECT_ENV, None)

    median = {name: statistics.median(values) for name, values in times.items()}
    state_bytes = sum(source.numel() * source.element_size() for source in sources)
    results: dict[str, object] = {
        "transformer_params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "state_gb": round(state_bytes / 1e9, 3),
        "rounds": rounds,
        "copy_threads": default_threads(),
        "copy_threads_fenced_save": fenced_save_threads(default_threads()),
        "iteration_s_none": round(median["none"], 4),
    }
    for name in ("memcpy", "castor_direct", "castor_staged"):
        paired = statistics.median(t - n for t, n in zip(times[name], times["none"], strict=True))
        results[f"iteration_s_{name}"] = round(median[name], 4)
        results[f"overhead_pct_{name}"] = round(100 * paired / median["none"], 2)
    for name in ("castor_direct", "castor_staged"):
        shares = [s / t for s, t in zip(stalls[name], times[name], strict=True)]
        results[f"stall_pct_{name}"] = round(100 * statistics.median(shares), 3)
        results[f"copy_s_{name}"] = round(statistics.median(copy_s[name]), 3)
        results[f"save_call_ms_{name}"] = round(1e3 * statistics.median(save_calls[name]), 3)
    back_to_back = {name: statistics.median(values) for name, values in consecutive.items()}
    results["iteration_s_castor_direct_every_iteration"] = round(back_to_back["castor_direct"], 4)
    results["overhead_pct_castor_direct_every_iteration"] = round(
        100 * (back_to_back["castor_direct"] - back_to_back["none"]) / back_to_back["none"], 2
    )
    results["stall_pct_castor_direct_every_iteration"] = round(
        100
        * statistics.median(
            s / t for s, t in zip(consecutive_stalls, consecutive["castor_direct"], strict=True)
        ),
        3,
    )
    results["direct_bytes_gb"] = round(direct_bytes / 1e9, 3)
    results["staging_bytes_gb_castor_direct"] = round(direct_staging_bytes / 1e9, 3)
    results["staging_bytes_gb_castor_staged"] = round(staged_bytes / 1e9, 3)
    results["steps_fenced_on_device"] = fenced
    results["iterations_s"] = {name: [round(t, 4) for t in values] for name, values in times.items()}
    return results


if __name__ == "__main__":
    main()
