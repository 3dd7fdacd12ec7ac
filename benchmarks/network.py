"""Benchmark of replication over an emulated network link (tests/netemu.py); the last line printed is JSON.

    sudo .venv/bin/python benchmarks/network.py           # 512 MiB checkpoints, 1 and 10 Gbit/s NICs
    sudo .venv/bin/python benchmarks/network.py --quick   # 48 MiB at 1 Gbit/s, interleaving on 2 machines

It needs root or CAP_NET_ADMIN (network namespaces, veth pairs, tc); it exits with status 2 saying why
where those are missing. Two machines, each its own network namespace with a NIC limited to the rate in
both directions (tbf), on one bridge:

* link_gbps: raw TCP throughput from one machine to the other on that link, measured in the same run (one
  stream of plain blocking sockets, timed at the receiver): what the emulated NIC carries.
* replicate_gbps: a committed checkpoint in machine 0's shared memory pushed over Castor's data plane
  (worker_lib.agent.dataplane: authenticated, per-stripe checksums verified by the receiver, committed)
  into machine 1's replica slot, from commit to verified replica: the goodput of one replica transfer.
* replicate_vs_link: the ratio of the two (target >= 0.9).
* replicate_sender_cpu_s_per_gb / replicate_receiver_cpu_s_per_gb: CPU seconds (user and system) per GB
  replicated of the sending process (its transfers) and of the receiving one (checksums, copies into the
  replica slot, and the kernel's TCP work its system calls do). replicate_host_cpu_s_per_gb: the whole
  host's busy CPU (every core, /proc/stat) per GB during the same transfers: both processes and the
  kernel's packet work for the emulated NICs (veth, bridge, tbf) that neither process's time counts.

With the 10 Gbit/s rate as well (the default, not --quick) the same figures carry a `_10` suffix; at that
rate this host's CPU (the checksums, Python's copies) may be the bound rather than the link.

Interleaving (GEMINI's Algorithm 2), on 4 machines at 1 Gbit/s, m = 2 (machine i replicates to i ^ 1),
benchmarks/netmachine.py on each: DDP over gloo on an MLP of 4.2 M parameters (16 MiB of gradients, so
the ring all-reduce keeps each NIC busy for most of an iteration), a forward/backward "compute" of 0.15 s
emulated by a sleep (an accelerator's time; 2 shared cores cannot compute for four machines), and a
checkpoint of 80 MiB per rank (model, momentum and 48 MiB of payload standing for a larger optimizer
state) saved every iteration. One training run plays the policies in blocks, none, eager, interleaved,
none, eager, ... (paired: each cycle's blocks ran back to back under the same load), then a "tail" under
interleaved where the replication interval is measured, then a "losses" phase, also interleaved, where
machines are lost at random instants.

* iteration_s_<policy>: median iteration time of the policy's blocks of 6 iterations (the first 2 of a
  block left out: a piece sent under the previous policy may still be draining); slowdown_<policy>_pct:
  the median over cycles of that cycle's block median against its none block; `_spread`: min and max.
* host_cpu_s_<policy>, host_kernel_cpu_s_<policy>, host_busy_pct_<policy>: the host's CPU (all cores: every
  machine's processes, and the kernel's packet work for the emulated NICs) per iteration in the policy's
  blocks, its kernel part, and the share of the cores busy (medians of the blocks' means; /proc/stat at
  rank 0's iteration boundaries); replication_cpu_pct_of_capacity_<policy>: the CPU the policy adds over
  none, as a share of a none iteration's whole capacity (every core for its length). Where that share is
  not far below the slowdown target and the cores are busy, the target cannot be met on this host: the
  replica bytes' packet work competes for the cores that training's all-reduce needs.
* replication_nice: how many steps below training's CPU priority the agents' replication threads ran
  (`--replication-nice`; the agent's default unless given: worker_lib/agent/priority.py).
* replication_interval: median iterations between fully replicated checkpoints in the tail (rounds aligned
  across machines through the driver, which plays the root's part); replication_interval_losses: the same
  in the losses phase, where each loss's fetch takes the holder's uplink and the host's cores from the
  rounds while training goes on (a real loss stops training for the recovery, and the replication with
  it), so the slowest machine, whom every aligned round waits for, is slower; replication_interval_bound:
  checkpoint bytes / (idle fraction x link bandwidth x iteration time), rounded up, from the none blocks'
  measured idle fraction and iteration time and this run's link_gbps; checkpoint_vs_idle_capacity: the
  checkpoint over one iteration's idle capacity (3 to 10 by design).
* tail_iteration_s, round_transfer_s, round_period_s, interval_transfer_iterations,
  interval_wait_iterations: where an interval goes, from the agents' tail rounds: a round's transfer (its
  pins taken to the last verified replica; Replicator.stats.last_round_s), the time between two rounds'
  completions, and the two in tail iterations (the rest of a period is the wait for the next round: every
  machine done, a proposal led by the lead, every machine's pin, the go).
* profile_idle_fraction: the idle fraction of the profile the sender schedules by (a window of 8
  iterations, spans ending where 6 of them ended, worker_lib.interleave.profile: jitter between
  iterations makes it smaller than one iteration's idle fraction); replication_interval_profile_bound: the
  bound with that idle fraction, mu (0.8) of it, and the tail's iteration time: what the interleaved
  sender can achieve by design before any alignment wait.
* send_overlap_own_ms / send_overlap_any_ms / comm_start_spread_ms: per agent and interleaved iteration, how
  long its send windows overlapped its own rank's communication and any rank's (from the earliest first
  collective to the latest end), and how far apart the ranks' first collectives started (median): an agent
  schedules by its own rank's timing; the spread, on this host the ranks' optimizer steps and saves
  finishing tens of ms apart on shared cores, is what it cannot see (see send_overlaps).
* machine_losses / peer_restores: at random instants of the losses phase a machine is declared lost and its
  rank's checkpoint of the job's aligned iteration is fetched from its peer's memory over the data plane
  (verified, and bit-exact against the lost machine's own copy) while every survivor still holds that
  iteration locally. The machine is not killed (the recovery of a killed machine on this cluster is
  tests/e2e/test_netemu_recovery.py's): what is counted is that a common iteration was in memory and came back
  from the peer. A loss that failed records its error, the holder's replicas of the lost rank after it
  (`peer_replicas_after` in --raw) and what the holder's agent logged meanwhile (`holder_log`).

    sudo .venv/bin/python benchmarks/network.py --interleave-only --cycles 1 --tail 40 --losses 16 --logs DIR

runs only the interleaving part, sized by its flags, and keeps the agents' logs (the rounds' steps at DEBUG)
and JSON in DIR.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import harness, netemu  # noqa: E402

MiB = 1 << 20
JOB, TOKEN = "bench", "castor-job.bench.secret"

DATAPLANE_PEER = """
import sys, time
from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
from worker_lib.agent.holdings import Holdings
holdings, key, job = Holdings(sys.argv[1]), data_plane_key(sys.argv[2]), sys.argv[3]
server = DataPlaneServer(holdings, key, job, host=sys.argv[4]).start()
print(server.port, flush=True)
time.sleep(3600)
"""

SENDER = """
import json, resource, sys, time
from pathlib import Path
import torch
from worker_lib import Checkpointer
from worker_lib.agent.dataplane import PeerConnection, data_plane_key
from worker_lib.agent.holdings import Holdings
scratch, address, port, size, reps, token, job = sys.argv[1:8]
size, reps = int(size), int(reps)
# Transfers before the measured ones: both of the receiver's slots for the rank are mapped and touched
# (the first write into fresh shared memory faults every page in, many times slower than the copy).
WARMUP = 2
sender = Holdings(Path(scratch))
tensors = {f"t{i}": torch.randn(size // 4 // 16) for i in range(16)}
sys.path.insert(0, "benchmarks")
from netmachine import CLOCK_TICKS, host_cpu_jiffies
def host_busy_ticks():
    # Every core's busy time: the kernel's packet work for the emulated NICs (softirq) included.
    user, kernel, _ = host_cpu_jiffies()
    return user + kernel
best, sent, cpu, host_cpu = 0.0, 0, 0.0, 0.0
with (
    Checkpointer(sender.directory("local", 0), blocking=True) as checkpointer,
    PeerConnection(address, int(port), data_plane_key(token), job) as peer,
):
    for iteration in range(WARMUP + reps):
        if iteration == WARMUP:  # the measured ones: the driver reads the receiver's CPU, then says go
            best, sent, cpu, host_cpu = 0.0, 0, 0.0, 0.0
            print("warm", flush=True)
            sys.stdin.readline()
        # A new commit every repetition: the peer would refuse a checkpoint it already holds.
        checkpointer.save(iteration, tensors)
        with sender.open_read(0) as (manifest, data):
            start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            host_busy = host_busy_ticks()
            outcome = peer.send_put(0, manifest, data)
            assert outcome == "sent", f"the peer did not take the checkpoint: {outcome}"
            peer.finish_put()  # the peer verified and committed it
            seconds, now = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            host_busy = host_busy_ticks() - host_busy
        best = max(best, manifest.data_bytes * 8 / seconds / 1e9)
        sent += manifest.data_bytes
        cpu += now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime
        host_cpu += host_busy / CLOCK_TICKS
sender.close()
figures = {
    "replicate_gbps": best, "checkpoint_bytes": manifest.data_bytes, "sent": sent, "cpu_s": cpu,
    "host_cpu_s": host_cpu,
}
print(json.dumps(figures), flush=True)
"""


def replicate_gbps(emu: netemu.NetEmu, scratch: Path, size: int, reps: int) -> dict[str, float]:
    """The best goodput of `reps` replica transfers of `size` bytes (after two that warm the receiver's
    slots up), and the CPU seconds per GB replicated of the sending process (its transfers only) and of
    the receiving one (all of it during those transfers and the sender's saves between them: it does
    nothing else)."""
    sender, receiver = emu.machines[0], emu.machines[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peer = emu.popen(
        receiver,
        [sys.executable, "-c", DATAPLANE_PEER, str(scratch / "receiver"), TOKEN, JOB, receiver.address],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert peer.stdout is not None
        port = peer.stdout.readline().strip()
        args = [str(scratch / "sender"), receiver.address, port, str(size), str(reps), TOKEN, JOB]
        process = emu.popen(
            sender,
            [sys.executable, "-c", SENDER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        assert process.stdin is not None and process.stdout is not None
        warm = process.stdout.readline()
        receiver_cpu = harness.cpu_seconds(peer.pid)
        if warm.strip() == "warm":
            process.stdin.write("go\n")
            process.stdin.flush()
        stdout, stderr = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"the sender failed: {stderr[-3000:]}")
        receiver_cpu = harness.cpu_seconds(peer.pid) - receiver_cpu
        figures = json.loads(stdout.strip().splitlines()[-1])
        gigabytes = figures["sent"] / 1e9
        return {
            "replicate_gbps": float(figures["replicate_gbps"]),
            "checkpoint_bytes": int(figures["checkpoint_bytes"]),
            "replicate_sender_cpu_s_per_gb": round(figures["cpu_s"] / gigabytes, 3),
            "replicate_receiver_cpu_s_per_gb": round(receiver_cpu / gigabytes, 3),
            "replicate_host_cpu_s_per_gb": round(figures["host_cpu_s"] / gigabytes, 3),
        }
    finally:
        peer.kill()
        peer.wait()


def measure(rate_gbit: float, size: int, reps: int) -> dict[str, float | int]:
    with (
        netemu.cluster(2, rate_gbit=rate_gbit) as emu,
        tempfile.TemporaryDirectory(prefix="castor-bench-net-", dir="/dev/shm") as scratch,
    ):
        a, b = emu.machines
        link = max(netemu.measure_gbps(emu, a, b, megabytes=size // MiB) for _ in range(reps))
        replica = replicate_gbps(emu, Path(scratch), size, reps)
    return {
        "link_gbps": link,
        **replica,
        "replicate_vs_link": replica["replicate_gbps"] / link,
    }


SETTLE = 2  # iterations of each block left out: the previous policy's last piece may still be draining


def comm_periods(train: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """Each iteration's communication, from its first collective's start to its last one's end (the
    training process's monotonic clock, which every namespace shares)."""
    starts, spans = train["starts"], train["spans"]
    periods = {}
    for index in range(len(starts) - 1):
        inside = [span for span in spans if starts[index] <= span[0] < starts[index + 1]]
        if inside:
            periods[index] = (min(s for s, _ in inside), max(e for _, e in inside))
    return periods


def send_overlaps(out: dict[str, Any]) -> dict[str, float]:
    """How well the interleaved senders kept off training's wire, over the interleaved blocks: per agent
    and iteration, the milliseconds its send windows overlapped its own rank's communication
    (`send_overlap_own_ms`) and the communication of any rank, from the earliest start to the latest end
    (`send_overlap_any_ms`); and the median spread of the ranks' first-collective starts
    (`comm_start_spread_ms`). Each agent schedules by its own rank's timing only, so the spread is what it
    cannot see. Empty with one machine."""
    trains = out["train"]
    if len(trains) < 2:
        return {}
    phases = {iteration: phase for iteration, phase, _ in trains[0]["times"]}
    periods = [comm_periods(train) for train in trains]
    shared = [
        i for i in sorted(periods[0]) if phases.get(i) == "interleaved" and all(i in p for p in periods)
    ]
    if not shared:
        return {}

    def overlap(windows: list[list[float]], begin: float, end: float) -> float:
        return sum(max(0.0, min(w[1], end) - max(w[0], begin)) for w in windows)

    own, any_rank, spread = [], [], []
    for i in shared:
        begins = [p[i][0] for p in periods]
        spread.append(max(begins) - min(begins))
        first, last = min(begins), max(p[i][1] for p in periods)
        for agent, rank_periods in zip(out["agents"], periods, strict=True):
            own.append(overlap(agent["windows"], *rank_periods[i]))
            any_rank.append(overlap(agent["windows"], first, last))
    return {
        "send_overlap_own_ms": round(1000 * statistics.fmean(own), 2),
        "send_overlap_any_ms": round(1000 * statistics.fmean(any_rank), 2),
        "comm_start_spread_ms": round(1000 * statistics.median(spread), 1),
    }


def interleaving(
    quick: bool,
    raw: str | None = None,
    *,
    cycles: int | None = None,
    tail: int | None = None,
    losses: int | None = None,
    loss_tail: int | None = None,
    machines: int | None = None,
    logs: str | None = None,
    replication_nice: int | None = None,
) -> dict[str, object]:
    import math
    import random

    sys.path.insert(0, str(REPO / "benchmarks"))
    import netmachine

    from worker_lib.agent.priority import REPLICATION_NICE
    from worker_lib.interleave import MU, IterationComm, interval_bound, merge, profile

    nice = REPLICATION_NICE if replication_nice is None else replication_nice  # what a user's agent runs at

    # Short blocks, many cycles: this host's load drifts over minutes, and a pair of blocks seconds apart
    # sees about the same load. A policy switch takes effect at the sender's next piece (2 MiB). One cycle's
    # interleaved slowdown spreads over -5 to +13 % here: 20 cycles make the median a few points steadier
    # than 10 (whose runs ranged +1.1 to +3.6 % around +2.2).
    # The tail measures the replication interval with no machine lost; the losses phase after it loses
    # machines (about one per 2.7 s at 1 Gbit/s: a fetch of 80 MiB, then a pause of 0.5-2 s).
    block, default_cycles, default_tail, default_losses = (6, 1, 8, 2) if quick else (6, 20, 60, 12)
    cycles = default_cycles if cycles is None else cycles
    tail = default_tail if tail is None else tail
    losses = default_losses if losses is None else losses
    loss_tail = loss_tail if loss_tail is not None else (14 if quick else 80)
    if machines is None:
        machines = 2 if quick else 4  # --quick checks that it runs: half the processes to start
    warmup = 12
    iterations = warmup + block * cycles * 3 + tail + loss_tail
    train_args = ["--iterations", str(iterations), "--warmup", str(warmup), "--block", str(block)]
    train_args += ["--cycles", str(cycles), "--steady", str(tail)]
    with (
        netemu.cluster(machines, rate_gbit=1.0) as emu,
        tempfile.TemporaryDirectory(prefix="castor-bench-interleave-", dir="/dev/shm") as scratch,
    ):
        link = netemu.measure_gbps(emu, emu.machines[0], emu.machines[1], megabytes=64)
        out = netmachine.drive(
            emu,
            Path(scratch),
            train_args=train_args,
            agent_args=["--phased", "--nice", str(nice)],
            losses=losses,
            loss_every_s=(0.5, 2.0),
            seed=random.randrange(1 << 30),
        )
        if logs:  # the agents' logs (and their JSON), kept for a look at what went wrong
            Path(logs).mkdir(parents=True, exist_ok=True)
            for index in range(machines):
                for name in ("agent.log", "agent.json", "train.json"):
                    source = Path(scratch) / f"m{index}" / name
                    if source.exists():
                        (Path(logs) / f"m{index}-{name}").write_bytes(source.read_bytes())
    if raw:
        Path(raw).write_text(json.dumps(out))
    times = out["train"][0]["times"]  # every rank waits for the same all-reduces: rank 0's will do
    blocks: dict[tuple[int, str], list[float]] = {}
    # The host's CPU per iteration (user, kernel, idle over all cores, from /proc/stat at rank 0's iteration
    # boundaries), grouped as the times are.
    host_cpu = out["train"][0].get("host_cpu") or []
    cpu_blocks: dict[tuple[int, str], list[list[float]]] = {}
    for index, (iteration, phase, seconds) in enumerate(times):
        if phase in netmachine.PHASES and (iteration - warmup) % block >= SETTLE:
            key = ((iteration - warmup) // (block * 3), phase)
            blocks.setdefault(key, []).append(seconds)
            if index < len(host_cpu):
                cpu_blocks.setdefault(key, []).append(host_cpu[index])
    figures: dict[str, object] = {"interleave_link_gbps": round(link, 4), "replication_nice": nice}
    for phase in netmachine.PHASES:
        every = [t for (c, p), values in blocks.items() if p == phase for t in values]
        figures[f"iteration_s_{phase}"] = round(statistics.median(every), 4)
    for phase in ("eager", "interleaved"):
        per_cycle = [
            (statistics.median(blocks[(c, phase)]) / statistics.median(blocks[(c, "none")]) - 1) * 100
            for c in range(cycles)
        ]
        figures[f"slowdown_{phase}_pct"] = round(statistics.median(per_cycle), 2)
        figures[f"slowdown_{phase}_pct_spread"] = [round(min(per_cycle), 2), round(max(per_cycle), 2)]
    # What replication costs the cores training shares with it here, where the emulated NICs' packet work is
    # kernel CPU on the same two cores (a real NIC does it in hardware).
    if cpu_blocks:
        for phase in netmachine.PHASES:
            block_means = [
                [sum(column) / len(rows) for column in zip(*rows, strict=True)]
                for (_, p), rows in cpu_blocks.items()
                if p == phase
            ]
            user, kernel, idle = (statistics.median(column) for column in zip(*block_means, strict=True))
            figures[f"host_cpu_s_{phase}"] = round(user + kernel, 4)
            figures[f"host_kernel_cpu_s_{phase}"] = round(kernel, 4)
            figures[f"host_busy_pct_{phase}"] = round(100 * (user + kernel) / (user + kernel + idle), 1)
        for phase in ("eager", "interleaved"):
            extra = float(figures[f"host_cpu_s_{phase}"]) - float(figures["host_cpu_s_none"])  # type: ignore[arg-type]
            # The extra CPU as a share of the none iteration's whole capacity (every core for its length).
            capacity = float(figures["iteration_s_none"]) * (os.cpu_count() or 1)  # type: ignore[arg-type]
            figures[f"replication_cpu_pct_of_capacity_{phase}"] = round(100 * extra / capacity, 2)
    figures.update(send_overlaps(out))
    # The idle time training leaves, from the none blocks: each iteration's length less its busy spans.
    train = out["train"][0]
    starts, spans = train["starts"], train["spans"]
    idle_fractions = []
    for index, (_, phase, _) in enumerate(times[:-1]):
        if phase != "none" or index + 1 >= len(starts):
            continue
        begin, end = starts[index], starts[index + 1]
        # Buckets queue behind each other (their spans overlap): merged before summing.
        busy = sum(e - s for s, e in merge([(max(s, begin), min(e, end)) for s, e in spans]))
        idle_fractions.append(max(0.0, 1 - busy / (end - begin)))
    idle_fraction = statistics.median(idle_fractions)
    checkpoint_bytes = max(int(a["checkpoint_bytes"] or 0) for a in out["agents"])
    bandwidth = link * 1e9 / 8
    iteration_s = float(figures["iteration_s_none"])  # type: ignore[arg-type]
    intervals, intervals_losing = [], []
    for agent in out["agents"]:
        rounds = agent["rounds"]
        for previous, current in itertools.pairwise(rounds):
            if previous[3] == current[3] == "tail" and current[2]:
                intervals.append(current[2])
            elif previous[3] == current[3] == "losses" and current[2]:
                intervals_losing.append(current[2])
    figures["replication_interval"] = statistics.median(intervals) if intervals else None
    # The same while machines are lost: each loss's fetch shares the holder's uplink and the host's cores with
    # the rounds, which a real loss (training stopped for the recovery) does not.
    figures["replication_interval_losses"] = statistics.median(intervals_losing) if intervals_losing else None
    # Where an interval's time goes: the rounds' transfers (start to the last verified replica) and the
    # wait between one round's end and the next one's start (every machine done, a proposal, its lead).
    transfers, periods = [], []
    for agent in out["agents"]:
        tail_rounds = [r for r in agent["rounds"] if r[3] == "tail" and r[1] is not None]
        transfers += [r[4] for r in tail_rounds if len(r) > 4 and r[4] is not None]
        periods += [b[0] - a[0] for a, b in itertools.pairwise(tail_rounds)]
    tail_iteration_s = statistics.median(t for _, phase, t in times if phase == "tail")
    figures["tail_iteration_s"] = round(tail_iteration_s, 4)
    if transfers and periods:
        transfer_s, period_s = statistics.median(transfers), statistics.median(periods)
        figures["round_transfer_s"] = round(transfer_s, 3)
        figures["round_period_s"] = round(period_s, 3)
        figures["interval_transfer_iterations"] = round(transfer_s / tail_iteration_s, 2)
        figures["interval_wait_iterations"] = round(max(0.0, period_s - transfer_s) / tail_iteration_s, 2)
    # The idle time the sender schedules by: the profile training publishes (worker_lib.interleave.profile
    # over a window of iterations), which jitter between iterations shrinks below one iteration's.
    window = 8  # netmachine.py train --profile-window
    history = []
    for index in range(len(starts) - 1):
        begin, end = starts[index], starts[index + 1]
        window_busy = tuple(
            (max(s, begin) - begin, min(e, end) - begin) for s, e in spans if e > begin and s < end
        )
        history.append(IterationComm(end - begin, window_busy))
    profiled = [
        found.idle_fraction
        for index in range(window, len(history))
        if index < len(times)
        and times[index][1] == "tail"
        and (found := profile(history[index - window : index])) is not None
    ]
    if profiled:
        profile_idle = statistics.median(profiled)
        figures["profile_idle_fraction"] = round(profile_idle, 3)
        figures["replication_interval_profile_bound"] = interval_bound(
            checkpoint_bytes, MU * profile_idle, bandwidth, tail_iteration_s
        )
    figures["replication_intervals"] = sorted(intervals)
    figures["replication_interval_bound"] = interval_bound(
        checkpoint_bytes, idle_fraction, bandwidth, iteration_s
    )
    figures["idle_fraction"] = round(idle_fraction, 3)
    figures["interleave_checkpoint_bytes"] = checkpoint_bytes
    figures["checkpoint_vs_idle_capacity"] = round(
        checkpoint_bytes / (idle_fraction * bandwidth * iteration_s), 2
    )
    figures["machine_losses"] = len(out["losses"])
    figures["peer_restores"] = sum(1 for loss in out["losses"] if loss["from_peer"])
    figures["loss_errors"] = [loss["error"] for loss in out["losses"] if "error" in loss]
    # Fetches that succeeded on a second connection (as the agent's restore does: a transport failure such
    # as a handshake the peer dropped after its deadline on a loaded host is tried again), with why.
    figures["loss_retries"] = [error for loss in out["losses"] for error in loss.get("retried", [])]
    windows = [w for agent in out["agents"] for w in agent["windows"]]
    figures["interleave_chunks"] = len(windows)
    if not math.isfinite(idle_fraction):
        raise RuntimeError("no idle fraction measured")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="48 MiB checkpoints at 1 Gbit/s only")
    parser.add_argument("--raw", help="write the interleaving run's raw JSON (times, spans, windows) here")
    parser.add_argument(
        "--interleave-only", action="store_true", help="skip the link and replica-transfer measurements"
    )
    parser.add_argument("--cycles", type=int, help="cycles of none/eager/interleaved blocks (20; --quick 1)")
    parser.add_argument(
        "--tail",
        type=int,
        help="iterations under interleaved, no machine lost, after the blocks (60; --quick 8)",
    )
    parser.add_argument(
        "--loss-tail",
        type=int,
        help="iterations under interleaved after the tail, machines lost (80; --quick 14)",
    )
    parser.add_argument("--losses", type=int, help="machine losses in them (12; --quick 2)")
    parser.add_argument("--machines", type=int, help="machines of the interleaving run (4; --quick 2)")
    parser.add_argument("--logs", help="copy the agents' logs and JSON into this directory")
    parser.add_argument(
        "--replication-nice",
        type=int,
        help="the agents' replication threads run this many steps below training (the agent's default; "
        "0: training's priority)",
    )
    args = parser.parse_args()
    reason = netemu.unavailable()
    if reason:
        print(f"benchmarks/network.py: the emulated cluster cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    size = 48 * MiB if args.quick else 512 * MiB
    reps = 2
    results: dict[str, object] = {"rate_gbit": 1.0, "reps": reps, "statistic": "best"}
    if not args.interleave_only:
        results.update(measure(1.0, size, reps))
        if not args.quick:
            results.update({f"{k}_10": v for k, v in measure(10.0, size, reps).items()})
    results.update(
        interleaving(
            args.quick,
            args.raw,
            cycles=args.cycles,
            tail=args.tail,
            losses=args.losses,
            loss_tail=args.loss_tail,
            machines=args.machines,
            logs=args.logs,
            replication_nice=args.replication_nice,
        )
    )
    for key, value in results.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    results.pop("replication_intervals", None)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))


if __name__ == "__main__":
    main()
