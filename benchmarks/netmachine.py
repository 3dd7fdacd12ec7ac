"""One machine of benchmarks/network.py's interleaving run (and of tests/e2e/test_interleave.py), run
inside its network namespace (tests/netemu.py). Two roles, two processes, as on a real machine:

    netmachine.py train --rank R --world N --master ADDR --root DIR --out FILE [workload options]
    netmachine.py agent --rank R --peer ADDR --root DIR --out FILE [--policy P] [--nice N]

`train`: DDP over gloo (the namespace's NIC) on an MLP whose gradient all-reduce is most of the wire time,
`time_communication(model)` publishing its idle spans to the board in the rank's shm directory, a forward
"compute" emulated by a sleep (the GPU's time, which 2 shared cores cannot give four machines) and a
Checkpointer save of the model, the optimizer and a payload (the optimizer state of a larger model) every
iteration. The phase of each iteration (none | eager | interleaved, A/B/A/B in blocks) follows from its number
and is written where the agent reads it. At the end: iteration times, phases, comm spans, as JSON.

`agent`: a Castor data plane server (the group peer's replicas land here) and a Replicator sending this
rank's checkpoints to the peer under the phase's policy (none: nothing granted), its rounds aligned across
machines through files the benchmark's driver reads and writes (the root's part: the driver computes
services.root.domain.replication.replication_alignment over the agents' summaries). At the end: send
windows and rounds, as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PORT = 7100  # the data plane's, in every namespace (each has its own ports)
# How often an agent heartbeats (writes its summary, reads the driver's answer, looks for a new commit) and
# the driver answers. The root's answer to a heartbeat is immediate; these polls stand for its round trip.
# At 0.1 s, three of them (a machine's summary, the driver, the answer back) per step of an aligned round
# (the last machine done, the next proposal, its adoption, every pin, the go) were half an iteration.
POLL_S = 0.025
PHASES = ("none", "eager", "interleaved")


def phase_of(
    iteration: int, warmup: int, block: int, phases: tuple[str, ...], cycles: int, steady: int | None = None
) -> str:
    """warmup, then `cycles` rounds of the phases in blocks (A, B, C, A, B, C, ...), then "tail" (interleaved,
    `steady` iterations: the replication interval's), then "losses" (interleaved, machines lost)."""
    if iteration < warmup:
        return "warmup"
    past = iteration - warmup - block * cycles * len(phases)
    if past < 0:
        return phases[((iteration - warmup) // block) % len(phases)]
    return "tail" if steady is None or past < steady else "losses"


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def host_cpu_jiffies() -> tuple[int, int, int]:
    """The host's CPU time so far, in clock ticks over all cores: user (user, nice), kernel (system, irq,
    softirq: the emulated NICs' packet work lands here) and idle (idle, iowait), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:8]]
    user, nice, system, idle, iowait, irq, softirq = fields
    return user + nice, system + irq + softirq, idle + iowait


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from worker_lib import Checkpointer, time_communication

    os.environ.update(MASTER_ADDR=args.master, MASTER_PORT="29611", RANK=str(args.rank))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    width = args.width
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    directory = Path(args.root) / "local" / f"rank-{args.rank}"
    timer = time_communication(ddp, directory, window=args.profile_window, every=40)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    payload = torch.zeros(args.payload_mb * (1 << 20) // 4)
    phases = tuple(args.phases.split(","))
    phase_file = Path(args.root) / "phase"
    times: list[tuple[int, str, float]] = []
    # The host's CPU use (all cores, every machine's processes and the kernel's packet work for the emulated
    # NICs) from one iteration's start to the next: where an iteration's time goes on a host whose cores
    # every machine shares.
    host_cpu: list[tuple[float, ...]] = []
    x = torch.randn(8, width)
    with Checkpointer(directory, slots=4, threads=1) as checkpointer:
        for iteration in range(args.iterations):
            phase = phase_of(iteration, args.warmup, args.block, phases, args.cycles, args.steady)
            phase_file.write_text(phase)
            start, cpu_before = time.monotonic(), host_cpu_jiffies()
            loss = ddp(x).square().mean()  # the forward pre-hook marks the iteration's start
            time.sleep(args.compute_s)  # the accelerator's forward and backward compute
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            payload[iteration % payload.numel()] = iteration
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer, "payload": payload})
            times.append((iteration, phase, time.monotonic() - start))
            cpu_after = host_cpu_jiffies()
            host_cpu.append(tuple((b - a) / CLOCK_TICKS for a, b in zip(cpu_before, cpu_after, strict=True)))
    dist.barrier()
    Path(args.out).write_text(
        json.dumps(
            {"times": times, "spans": list(timer.spans), "starts": list(timer.starts), "host_cpu": host_cpu}
        )
    )
    dist.destroy_process_group()


def agent(args: argparse.Namespace) -> None:
    import logging

    from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
    from worker_lib.agent.holdings import Holdings
    from worker_lib.agent.pacing import Pacer
    from worker_lib.agent.priority import REPLICATION_NICE
    from worker_lib.agent.replication import Replicator

    root = Path(args.root)
    logging.basicConfig(
        filename=root / "agent.log",
        level=logging.INFO,
        format="%(asctime)s %(threadName)s %(name)s %(message)s",
    )
    logging.getLogger("worker_lib.agent.replication").setLevel(logging.DEBUG)  # the rounds' steps
    key = data_plane_key(args.token)
    holdings = Holdings(root)
    holdings.prepare_local([args.rank], 4)
    nice = REPLICATION_NICE if args.nice is None else args.nice  # as the agent does (agent/priority.py)
    server = DataPlaneServer(holdings, key, "bench", host=args.address, port=PORT, nice=nice).start()

    class PhasedPacer(Pacer):
        """The phase's policy; 'none' grants nothing (a transfer in flight waits for the next phase)."""

        phase = "warmup"

        def grant(self, wanted: int, unsent: Any) -> int:
            if self.phase == "none":
                time.sleep(0.05)
                return 0
            return super().grant(wanted, unsent)

    replicator = Replicator(
        holdings, key, "bench", [args.peer_rank], lambda machine: (args.peer, PORT), streams=1, nice=nice
    )
    pacer = PhasedPacer(args.policy, None, replicator.boards)
    replicator.pacer = pacer
    replicator.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    rounds: list[tuple[float, int | None, int | None, str, float | None]] = []
    seen: int | None = None
    noticed: int | None = None
    summary_file, alignment_file = root / "summary.json", root / "alignment.json"
    aligned_at = 0.0
    while not stop.is_set() and not (root / "stop").exists():
        phase_file = root / "phase"
        phase = phase_file.read_text() if phase_file.exists() else "warmup"
        if args.phased:
            pacer.phase = phase
            pacer.policy = "eager" if phase == "eager" else args.policy
        # The agent hears of each commit (worker_lib/agent/services.py, from the training process): here
        # from the rank's store. It pins an agreed iteration the moment it is committed, and the commit
        # rate lets a proposal's lead follow the pace (Replicator._needed_lead).
        newest = holdings.newest("local", args.rank)
        if newest is not None and newest.iteration != noticed:
            noticed = newest.iteration
            replicator.notice_commit(args.rank, noticed)
        stats = replicator.stats
        if stats.replicated_iteration != seen:
            seen = stats.replicated_iteration
            rounds.append((time.monotonic(), seen, stats.interval, phase, stats.last_round_s))
        if args.align:
            summary = {**replicator.summary(), "local": {str(args.rank): None}}
            temporary = summary_file.with_suffix(".tmp")
            temporary.write_text(json.dumps(summary))
            os.replace(temporary, summary_file)
            try:
                stat = alignment_file.stat()
                if stat.st_mtime > aligned_at:
                    aligned_at = stat.st_mtime
                    said = json.loads(alignment_file.read_text())
                    replicator.align(said["aligned_iteration"], said["target"], said["go"])
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(POLL_S)
    replicator.stop()
    server.stop()
    newest = holdings.newest("local", args.rank)
    Path(args.out).write_text(
        json.dumps(
            {
                "windows": list(pacer.windows),
                "rounds": rounds,
                "bandwidth": pacer.bandwidth,
                "bytes_sent": replicator.stats.bytes_sent,
                "aborted": replicator.stats.aborted,
                "checkpoint_bytes": newest.data_bytes if newest is not None else None,
            }
        )
    )
    holdings.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    t = sub.add_parser("train")
    t.add_argument("--rank", type=int, required=True)
    t.add_argument("--world", type=int, required=True)
    t.add_argument("--master", required=True)
    t.add_argument("--root", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--iterations", type=int, default=60)
    t.add_argument("--warmup", type=int, default=12)
    t.add_argument("--block", type=int, default=20)
    t.add_argument("--phases", default=",".join(PHASES))
    t.add_argument("--cycles", type=int, default=1)
    t.add_argument("--steady", type=int, default=None, help="tail iterations before the losses phase")
    t.add_argument("--profile-window", type=int, default=8)
    t.add_argument("--width", type=int, default=1448)  # two layers: 4.2 M parameters, 16 MiB of gradients
    t.add_argument("--bucket-mb", type=float, default=4.0)
    t.add_argument("--payload-mb", type=int, default=48)
    t.add_argument("--compute-s", type=float, default=0.15)
    a = sub.add_parser("agent")
    a.add_argument("--rank", type=int, required=True)
    a.add_argument("--peer-rank", type=int, required=True)
    a.add_argument("--address", required=True)
    a.add_argument("--peer", required=True)
    a.add_argument("--root", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--token", default="castor-job.bench.secret")
    a.add_argument("--policy", default="interleaved")
    a.add_argument("--phased", action="store_true", help="follow the training's phases")
    a.add_argument("--align", action="store_true", help="align rounds through the driver's files")
    a.add_argument(
        "--nice",
        type=int,
        default=None,
        help="replication's threads below the process (default: the agent's)",
    )
    args = parser.parse_args()
    train(args) if args.role == "train" else agent(args)


if __name__ == "__main__":
    main()


# -- the driver (in the root namespace) ----------------------------------------------------------------------


def drive(
    emu: Any,
    scratch: Path,
    *,
    train_args: list[str],
    agent_args: list[str],
    align: bool = True,
    losses: int = 0,
    loss_every_s: tuple[float, float] = (1.0, 3.0),
    seed: int = 0,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run one training process and one agent per machine of `emu` (netemu.NetEmu; machine i's group peer is
    i ^ 1), play the root's part in aligning rounds, and lose `losses` machines at random instants of the
    "losses" phase (train --steady; not in the "tail" before it, where the replication interval is measured: a
    loss's fetch takes the holder's uplink and cores from its replication while training goes on, which a real
    loss, training stopped for the recovery, never does): each loss is restored from its peer's memory when
    the survivors all hold the job's aligned iteration locally and the peer's replica of the lost rank at it
    comes over the data plane, verified, with the lost machine's own digest (bit-exact). The machine is not
    killed: the restore path is what is exercised. Returns the processes' JSON and the losses' outcomes."""
    import random
    import subprocess

    from services.root.domain.replication import replication_alignment
    from worker_lib.agent.dataplane import data_plane_key, fetch
    from worker_lib.agent.holdings import Holdings
    from worker_lib.store.slots import SlotStore

    machines = emu.machines
    n = len(machines)
    roots = [scratch / f"m{i}" for i in range(n)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    python = sys.executable
    agents: list[subprocess.Popen[Any]] = []
    trainers: list[subprocess.Popen[Any]] = []
    outcomes: list[dict[str, Any]] = []
    rng = random.Random(seed)
    key = data_plane_key("castor-job.bench.secret")

    def lose(index: int, lost: int, aligned: int | None, outcome: dict[str, Any]) -> None:
        """One machine loss: the lost rank's aligned iteration fetched from its peer's memory (in a thread,
        so the alignment the driver plays the root's part in goes on meanwhile, as the root's would)."""
        outcome["started"] = time.time()
        holder_log = roots[lost ^ 1] / "agent.log"
        log_offset = holder_log.stat().st_size if holder_log.exists() else 0
        try:
            if aligned is None:
                raise LookupError("no aligned iteration")
            for r in range(n):
                if r != lost:
                    held = Holdings(roots[r]).local_store(r).committed()
                    if aligned not in {m.iteration for m in held}:
                        raise LookupError(f"rank {r} no longer holds iteration {aligned}")
            own = {m.iteration: m.digest for m in Holdings(roots[lost]).local_store(lost).committed()}
            destination = SlotStore(scratch / "restored" / str(index), 2)
            peer = machines[lost ^ 1]
            # As the agent restores (worker_lib/agent/agent.py): a transport failure is tried
            # again on a new connection.
            retried: list[str] = outcome.setdefault("retried", [])

            def on_retry(exc: Exception, retried: list[str] = retried) -> None:
                retried.append(f"{type(exc).__name__}: {exc}")

            manifest = fetch(
                peer.address,
                PORT,
                key,
                "bench",
                lost,
                destination,
                aligned,
                "replica",
                on_retry=on_retry,
            )
            if aligned in own and own[aligned] != manifest.digest:
                raise ValueError("the peer's replica is not the lost machine's checkpoint")
            outcome.update(from_peer=True, digest_checked=aligned in own)
        except Exception as exc:  # a loss that found no copy in memory: reported
            outcome["error"] = f"{type(exc).__name__}: {exc}"
            outcome["at"] = time.time()
            with contextlib.suppress(Exception):
                replicas = Holdings(roots[lost ^ 1]).replica_store(lost).committed()
                outcome["peer_replicas_after"] = [m.iteration for m in replicas]
            with contextlib.suppress(OSError):  # what the holder's agent said meanwhile
                with holder_log.open() as file:
                    file.seek(log_offset)
                    said_lines = [line.rstrip() for line in file if "replication" not in line]
                outcome["holder_log"] = said_lines[-20:]

    try:
        for i, machine in enumerate(machines):
            roots[i].mkdir(parents=True, exist_ok=True)
            command = [python, __file__, "agent", "--rank", str(i), "--peer-rank", str(i ^ 1)]
            command += ["--address", machine.address, "--peer", machines[i ^ 1].address]
            command += ["--root", str(roots[i]), "--out", str(roots[i] / "agent.json"), *agent_args]
            agents.append(emu.popen(machine, command + (["--align"] if align else []), env=env, cwd=REPO))
        for i, machine in enumerate(machines):
            command = [python, __file__, "train", "--rank", str(i), "--world", str(n)]
            command += ["--master", machines[0].address, "--root", str(roots[i])]
            command += ["--out", str(roots[i] / "train.json"), *train_args]
            trainers.append(emu.popen(machine, command, env=env, cwd=REPO))
        deadline = time.monotonic() + timeout_s
        next_loss: float | None = None
        loss: threading.Thread | None = None
        while any(t.poll() is None for t in trainers):
            if time.monotonic() > deadline:
                raise TimeoutError("the training processes did not finish")
            if any(t.poll() not in (None, 0) for t in trainers):
                raise RuntimeError("a training process failed")
            said = None
            if align:
                summaries = []
                for root in roots:
                    with contextlib.suppress(OSError, ValueError):
                        summaries.append(json.loads((root / "summary.json").read_text()))
                said = replication_alignment(summaries) if len(summaries) == n else None
                if said is not None:
                    body = json.dumps(
                        {"aligned_iteration": said.aligned_iteration, "target": said.target, "go": said.go}
                    )
                    for root in roots:
                        temporary = root / "alignment.tmp"
                        temporary.write_text(body)
                        os.replace(temporary, root / "alignment.json")
            phase_file = roots[0] / "phase"
            losing = phase_file.exists() and phase_file.read_text() == "losses"
            if losing and len(outcomes) < losses and (loss is None or not loss.is_alive()):
                now = time.monotonic()
                if next_loss is None:
                    next_loss = now + rng.uniform(*loss_every_s)
                elif now >= next_loss:
                    lost = rng.randrange(n)
                    aligned = said.aligned_iteration if said is not None else None
                    outcome: dict[str, Any] = {"machine": lost, "iteration": aligned, "from_peer": False}
                    outcomes.append(outcome)
                    loss = threading.Thread(
                        target=lose, args=(len(outcomes) - 1, lost, aligned, outcome), daemon=True
                    )
                    loss.start()
                    next_loss = None  # drawn again once this loss is over
            time.sleep(POLL_S)
        if loss is not None:
            loss.join(120)
        for root in roots:
            (root / "stop").touch()
        for process in agents:
            process.wait(60)
        return {
            "train": [json.loads((root / "train.json").read_text()) for root in roots],
            "agents": [json.loads((root / "agent.json").read_text()) for root in roots],
            "losses": outcomes,
        }
    finally:
        for process in [*trainers, *agents]:
            if process.poll() is None:
                process.kill()
                process.wait()
