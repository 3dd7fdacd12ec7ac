"""What checkpointing every iteration costs a real model's training; the last line printed is JSON.

    .venv/bin/python benchmarks/models.py            # a GPT-style decoder of ~110 M parameters, 6 rounds
    .venv/bin/python benchmarks/models.py --quick    # a tiny decoder, 2 rounds: checks that it runs
    .venv/bin/python benchmarks/models.py --only single|fsdp2    # one of the two parts

The model registers the buffers transformers have: a causal mask per block (persistent, in the state) and
the RoPE tables. One iteration is a forward, a backward and an AdamW step, in three variants:

- `none`: no checkpoint;
- `memcpy`: before the forward, a plain synchronous copy of the whole state (parameters, buffers, AdamW
  moments) into preallocated, touched memory, with torch's threads: the simplest checkpoint there is;
- `castor`: before the forward, `Checkpointer.save(i, {"model": model, "optimizer": optimizer})` with the
  default settings (asynchronous: the copy and its checksums run in background threads while forward and
  backward compute, and the optimizer step waits for them if they are not done).

The variants run interleaved in one process, one iteration each per round, in an order that rotates from
round to round (A B C, B C A, C A B, ...), so machine drift and noisy neighbours hit all three alike. The
overheads are the median of the per-round paired differences (variant minus `none`) over the median
iteration without checkpoints; `overhead_vs_memcpy_pct` is the median of `castor` minus `memcpy` in the same
round, with its quartiles: on a shared host whole iterations swing by tens of per cent, and the quartiles
say whether a gap of a few per cent between two overheads is there at all. `stall_pct` is the median share
of a `castor` iteration that the training thread spent blocked inside Castor (the save() call and every
wait for the copy: `stats.stalled_s`). `copy_cpu_s` is the CPU time the background threads used per save,
read from /proc: the cycles the copy and its checksums take from compute when no core is idle. `cpu_s_*`
are each variant's process CPU time per iteration (all threads), and the `*cpu_overhead_pct` their paired
differences: on a machine whose cores other work also wants, wall times swing with the neighbours and CPU
time is what a variant costs. `forward_extra_s_castor` is the median per-round lengthening of the forward that
runs beside the background copy (against `forward_s_none`), `forward_extra_s_memcpy` the same after the plain
copy (about 0), and `memcpy_s` the plain copy itself: what the background copy costs against what copying
alone takes. `omp_wait_policy` and `gomp_spincount` echo the environment (OMP_WAIT_POLICY, GOMP_SPINCOUNT),
which decides what torch's intra-op threads do while a copy thread holds one of their cores.

The FSDP2 part (`fsdp2_*`, see run_fsdp2) shards the same decoder over 4 ranks (gloo, one process each) and
times each rank's save (to the commit), restore (in place, into the sharded model) and a plain copy of its
local tensors (`memcpy_gbps`), interleaved in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from worker_lib import Checkpointer


@dataclass(frozen=True)
class Shape:
    vocab: int
    width: int
    layers: int
    heads: int
    context: int
    batch: int


FULL = Shape(vocab=32768, width=768, layers=12, heads=12, context=128, batch=2)
QUICK = Shape(vocab=256, width=64, layers=2, heads=4, context=16, batch=2)


class Block(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        width = shape.width
        self.heads = shape.heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        # A persistent buffer, as in nanoGPT: part of the state, read by every forward.
        causal = torch.tril(torch.ones(shape.context, shape.context, dtype=torch.bool))
        self.register_buffer("mask", causal.view(1, 1, shape.context, shape.context))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        mask = self.mask[:, :, :tokens, :tokens]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the last dimension (halves rotated)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    tokens = x.shape[-2]
    cos, sin = cos[:tokens], sin[:tokens]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class Decoder(nn.Module):
    def __init__(self, shape: Shape):
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.LayerNorm(shape.width)
        self.head = nn.Linear(shape.width, shape.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2
        head_width = shape.width // shape.heads
        frequencies = 1.0 / 10000 ** (torch.arange(0, head_width, 2, dtype=torch.float32) / head_width)
        angles = torch.outer(torch.arange(shape.context, dtype=torch.float32), frequencies)
        self.register_buffer("rope_cos", angles.cos())
        self.register_buffer("rope_sin", angles.sin())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny decoder and 2 rounds")
    parser.add_argument("--rounds", type=int, help="rounds of one iteration per variant (default 6, quick 2)")
    parser.add_argument("--dir", default="/dev/shm", help="where the temporary store goes (a tmpfs)")
    parser.add_argument("--only", choices=("single", "fsdp2"), help="run one part only")
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    rounds = args.rounds or (2 if args.quick else 6)
    directory = Path(tempfile.mkdtemp(prefix="castor-models-bench-", dir=args.dir))
    results: dict[str, object] = {}
    try:
        if args.only != "fsdp2":
            results.update(run(shape, rounds, directory / "single"))
        if args.only != "single":
            results.update(run_fsdp2(shape, max(rounds, 3), directory / "fsdp2"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(results)


def run(shape: Shape, rounds: int, directory: Path) -> dict[str, object]:
    torch.manual_seed(0)
    model = Decoder(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(shape.vocab, (shape.batch, shape.context + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    forwards: list[float] = []  # each iteration's forward (and loss), the phase a background copy runs beside

    def train_step() -> None:
        started = time.perf_counter()
        loss = F.cross_entropy(model(inputs).reshape(-1, shape.vocab), targets.reshape(-1))
        forwards.append(time.perf_counter() - started)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # AdamW's moments exist from here on: the state has its full size
    state = {"model": model, "optimizer": optimizer}
    sources = state_tensors(model, optimizer)
    copies = [torch.empty_like(source) for source in sources]
    for copy in copies:
        copy.zero_()  # touched: the copies measure a copy, not page faults

    checkpointer = Checkpointer(directory)
    iteration = iter(range(1, 1_000_000))
    copy_threads = ThreadClock("castor-")

    def none() -> None:
        train_step()

    plain_copies: list[float] = []

    def memcpy() -> None:
        started = time.perf_counter()
        for copy, source in zip(copies, sources, strict=True):
            copy.copy_(source)
        plain_copies.append(time.perf_counter() - started)
        train_step()

    def castor() -> None:
        checkpointer.save(next(iteration), state)
        train_step()

    variants: dict[str, Callable[[], None]] = {"none": none, "memcpy": memcpy, "castor": castor}
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # the process's CPU time, all threads
    forward: dict[str, list[float]] = {name: [] for name in variants}
    stalls: list[float] = []
    saves: list[float] = []
    copy_cpu: list[float] = []
    copy_wall: list[float] = []
    try:
        for name in variants:  # warm-up: the store's slots are mapped and touched by the first saves
            variants[name]()
        castor()
        names = list(variants)
        for round_ in range(rounds):
            order = names[round_ % 3 :] + names[: round_ % 3]
            for name in order:
                stalled_before, cpu_before = checkpointer.stats.stalled_s, copy_threads.cpu_s()
                started, cpu_started = time.perf_counter(), time.process_time()
                variants[name]()
                times[name].append(time.perf_counter() - started)
                # A castor iteration's copy is finished inside it (the optimizer step waits for it), so its
                # CPU is counted here.
                cpu[name].append(time.process_time() - cpu_started)
                forward[name].append(forwards[-1])
                if name == "castor":
                    stats = checkpointer.stats
                    stalls.append(stats.stalled_s - stalled_before)
                    saves.append(stats.last_save_s)
                    copy_wall.append(stats.last_copy_s)
                    copy_cpu.append(copy_threads.cpu_s() - cpu_before)
            measured = ", ".join(f"{n} {times[n][-1]:.3f} s" for n in order)
            print(f"round {round_ + 1}/{rounds}: {measured}", flush=True)
        checkpointer.wait()
    finally:
        checkpointer.close()

    median = {name: statistics.median(values) for name, values in times.items()}
    paired = {
        name: statistics.median(t - n for t, n in zip(times[name], times["none"], strict=True))
        for name in ("memcpy", "castor")
    }
    paired_cpu = {
        name: statistics.median(t - n for t, n in zip(cpu[name], cpu["none"], strict=True))
        for name in ("memcpy", "castor")
    }
    # Castor against the plain copy, round by round: both ran in the same round, so the drift and the
    # neighbours that move whole rounds cancel out. Its quartiles say how far apart the two really are.
    versus_memcpy = statistics.quantiles(
        [100 * (c - m) / median["none"] for c, m in zip(times["castor"], times["memcpy"], strict=True)], n=4
    )
    # What the background copy adds to the forward it runs beside, against what the plain copy takes on its
    # own: where the copy's cycles come from when compute keeps every core busy.
    forward_extra = {
        name: statistics.median(f - n for f, n in zip(forward[name], forward["none"], strict=True))
        for name in ("memcpy", "castor")
    }
    castor = times["castor"]
    state_bytes = sum(source.numel() * source.element_size() for source in sources)
    return {
        "transformer_params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "transformer_buffers": len(list(model.buffers())),
        "state_gb": round(state_bytes / 1e9, 3),
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "iteration_s_none": round(median["none"], 3),
        "iteration_s_memcpy": round(median["memcpy"], 3),
        "iteration_s_castor": round(median["castor"], 3),
        "memcpy_overhead_pct": round(100 * paired["memcpy"] / median["none"], 2),
        "overhead_pct": round(100 * paired["castor"] / median["none"], 2),
        "overhead_vs_memcpy_pct": round(versus_memcpy[1], 2),
        "overhead_vs_memcpy_quartiles_pct": [round(versus_memcpy[0], 2), round(versus_memcpy[2], 2)],
        "cpu_s_none": round(statistics.median(cpu["none"]), 3),
        "cpu_s_memcpy": round(statistics.median(cpu["memcpy"]), 3),
        "cpu_s_castor": round(statistics.median(cpu["castor"]), 3),
        "memcpy_cpu_overhead_pct": round(100 * paired_cpu["memcpy"] / statistics.median(cpu["none"]), 2),
        "cpu_overhead_pct": round(100 * paired_cpu["castor"] / statistics.median(cpu["none"]), 2),
        "stall_pct": round(100 * statistics.median(s / t for s, t in zip(stalls, castor, strict=True)), 3),
        "stall_ms": round(1e3 * statistics.median(stalls), 2),
        "save_call_ms": round(1e3 * statistics.median(saves), 2),
        "copy_s": round(statistics.median(copy_wall), 3),
        "copy_cpu_s": round(statistics.median(copy_cpu), 3),
        "memcpy_s": round(statistics.median(plain_copies), 3),
        "forward_s_none": round(statistics.median(forward["none"]), 3),
        "forward_extra_s_memcpy": round(forward_extra["memcpy"], 3),
        "forward_extra_s_castor": round(forward_extra["castor"], 3),
        # libgomp's wait policy decides what torch's intra-op threads do at a parallel region's end while a
        # copy thread holds one of their cores (README, "Measured figures").
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "iterations_s": {name: [round(t, 3) for t in values] for name, values in times.items()},
        "iterations_cpu_s": {name: [round(t, 3) for t in values] for name, values in cpu.items()},
    }


FSDP2_RANKS = 4


def run_fsdp2(shape: Shape, rounds: int, directory: Path) -> dict[str, object]:
    """FSDP2 on 4 ranks (gloo, one process each): each rank saves and restores its shards of the decoder
    and its AdamW state; `memcpy_gbps` copies the same local tensors into preallocated, touched memory.
    Rounds rotate the three operations (every rank runs the same one at once, between barriers); rates are
    per rank (its bytes over its time), medians over ranks and rounds, and the ratios are medians of the
    per-round, per-rank ratios to the same round's memcpy. `fsdp2_*_cpu_s` are each operation's CPU time
    per rank (all its threads, medians): steadier than the rates on shared cores. Each rank's copy engine
    gets its share of the cores (cores // ranks threads, at least one: `fsdp2_copy_threads`); the plain
    copy runs on torch's intra-op threads (`fsdp2_memcpy_threads`, torch's default). With the ranks alone
    on the machine both saturate the cores and the wall ratios should follow the CPU ratios; with other
    processes competing, the kernel shares the cores among runnable threads, so the side with more threads
    gets more of them and the wall ratios lean its way: compare the CPU ratios there (docs/store.md,
    "Sharded states")."""
    directory.mkdir(parents=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(fsdp2_rank, args=(port, shape, rounds, str(directory)), nprocs=FSDP2_RANKS, join=True)
    per_rank = [json.loads((directory / f"result-{rank}.json").read_text()) for rank in range(FSDP2_RANKS)]
    rates = {
        name: [rate for result in per_rank for rate in result[name]] for name in ("memcpy", "save", "restore")
    }

    def ratio(name: str) -> float:
        return statistics.median(
            r / m for result in per_rank for r, m in zip(result[name], result["memcpy"], strict=True)
        )

    return {
        "fsdp2_ranks": FSDP2_RANKS,
        "fsdp2_rank_state_gb": round(statistics.median(r["bytes"] for r in per_rank) / 1e9, 3),
        "fsdp2_save_gbps": round(statistics.median(rates["save"]), 3),
        "fsdp2_restore_gbps": round(statistics.median(rates["restore"]), 3),
        "memcpy_gbps": round(statistics.median(rates["memcpy"]), 3),
        "fsdp2_save_vs_memcpy": round(ratio("save"), 3),
        "fsdp2_restore_vs_memcpy": round(ratio("restore"), 3),
        "fsdp2_copy_threads": per_rank[0]["copy_threads"],
        "fsdp2_memcpy_threads": per_rank[0]["memcpy_threads"],
        # CPU seconds per operation and rank (all its threads): what each costs when the cores are the
        # bottleneck, whatever the neighbours do; memcpy's over save's is the best ratio the wall clock
        # could show on saturated cores.
        **{
            f"fsdp2_{name}_cpu_s": round(statistics.median(c for r in per_rank for c in r["cpu"][name]), 4)
            for name in ("memcpy", "save", "restore")
        },
    }


def fsdp2_rank(rank: int, port: int, shape: Shape, rounds: int, directory: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(FSDP2_RANKS)
    )
    dist.init_process_group("gloo", rank=rank, world_size=FSDP2_RANKS)
    try:
        mesh = init_device_mesh("cpu", (FSDP2_RANKS,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        model = Decoder(shape)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1 + rank)
        tokens = torch.randint(shape.vocab, (shape.batch, shape.context + 1))
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()  # AdamW's moments exist from here on
        optimizer.zero_grad(set_to_none=True)
        state = {"model": model, "optimizer": optimizer}

        sources = state_tensors(model, optimizer)
        copies = [torch.empty_like(source).zero_() for source in sources]
        nbytes = sum(source.numel() * source.element_size() for source in sources)
        # The ranks share the cores: each copies with its share of them (at least one thread), as a launcher
        # that narrows each rank's affinity would give it (more copy threads than cores per process only
        # queue behind one another and the other ranks).
        threads = max(1, len(os.sched_getaffinity(0)) // FSDP2_RANKS)
        checkpointer = Checkpointer(Path(directory) / f"rank-{rank}", threads=threads)
        iteration = iter(range(1, 1_000_000))

        def memcpy() -> int:
            for copy, source in zip(copies, sources, strict=True):
                copy.copy_(source)
            return nbytes

        saved = [0]

        def save() -> int:
            saved[0] = next(iteration)
            checkpointer.save(saved[0], state)
            checkpointer.wait()
            return checkpointer.stats.last_bytes

        def restore() -> int:
            # The iteration given: without it, the ranks would first agree on one (a collective).
            restored = checkpointer.restore(state, iteration=saved[0])
            assert restored is not None
            return checkpointer.stats.last_bytes

        operations: dict[str, Callable[[], int]] = {"memcpy": memcpy, "save": save, "restore": restore}
        rates: dict[str, list[float]] = {name: [] for name in operations}
        cpu: dict[str, list[float]] = {name: [] for name in operations}  # the rank's CPU seconds, all threads
        save(), save(), restore()  # both slots mapped and touched
        names = list(operations)
        for round_ in range(rounds):
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                dist.barrier()
                started, cpu_started = time.perf_counter(), time.process_time()
                moved = operations[name]()
                rates[name].append(moved / (time.perf_counter() - started) / 1e9)
                cpu[name].append(time.process_time() - cpu_started)
        checkpointer.close()
        result = {
            **rates,
            "bytes": nbytes,
            "cpu": cpu,
            "copy_threads": threads,
            "memcpy_threads": torch.get_num_threads(),
        }
    finally:
        dist.destroy_process_group()
    (Path(directory) / f"result-{rank}.json").write_text(json.dumps(result))


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint holds, each storage once (the tied head is the embedding)."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    candidates = list(model.state_dict().values()) + [
        value
        for per_parameter in optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    for tensor in candidates:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            tensors.append(tensor.detach())
    return tensors


class ThreadClock:
    """CPU time used so far by this process's threads whose name starts with a prefix (from /proc)."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._tick = os.sysconf("SC_CLK_TCK")
        self._dead: dict[int, float] = {}  # last reading of threads that may be gone by now

    def cpu_s(self) -> float:
        for thread in threading.enumerate():
            if thread.name.startswith(self._prefix) and thread.native_id is not None:
                try:
                    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1]
                except OSError:
                    continue
                utime, stime = fields.split()[11:13]
                self._dead[thread.native_id] = (int(utime) + int(stime)) / self._tick
        return math.fsum(self._dead.values())


def report(results: dict[str, object]) -> None:
    for key, value in results.items():
        if key not in ("iterations_s", "iterations_cpu_s"):
            print(f"{key:>22}: {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
