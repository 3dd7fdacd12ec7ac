"""Benchmark of failure recovery on this machine; the last line printed is JSON.

    .venv/bin/python benchmarks/recovery.py            # model of ~50 MB of state per rank, 4 machines
    .venv/bin/python benchmarks/recovery.py --quick    # small model, 2 machines: checks that it runs

A real data-parallel job (tests/e2e/workloads/train_ddp.py: torch.distributed with gloo on CPU, a
checkpoint every iteration) runs on 4 local machines started by the root's local cloud operator, m = 2,
REST heartbeats (timeout 3 s). For each case a fresh cluster; the fault is injected once every machine's warm
interpreters are ready:
* software: SIGKILL of one training process; restored from local memory;
* hardware: one machine lost (agent, processes and shared memory); a new agent replaces it and restores
  from its group peer;
* group_loss: both machines of a placement group lost; every rank restores the newest persisted checkpoint
  (persist every 5 iterations, local directory; the other cases persist every 1,000);
* hang: rank 1 stops in an endless wait after a commit (alive, silent; the other ranks block in the next
  all-reduce); the agents' hang watchdog (`--hang-timeout 10` here, through CASTOR_HANG_TIMEOUT) collects
  its stacks and kills it; restored from local memory.
detect_s is from the fault to the failure event's detection; resume_s from the fault to the moment every
rank completed its first iteration after the restore; restore_s the slowest rank's restore in that case.
etcd_detect_s: a root with etcd (1 s lease TTL) and 2 machines; one machine's agent is killed; time to the
failure event.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import harness  # noqa: E402
from tests.e2e.cluster import LocalCluster, read_events, wait_until  # noqa: E402
from tests.e2e.recovery_checks import kill_training_process, newest_iteration, wait_for_iteration  # noqa: E402

PERSIST_RARELY = 1000  # iterations: past every case's fault
HANG_TIMEOUT_S = 10  # fixed; well above an iteration here even on a loaded host, unlike `auto`'s 300 s


def timestamp(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def first_iteration_after_restart(log_dir: Path) -> float:
    """When every rank completed its first iteration after its newest restart."""
    finished = []
    for events in read_events(log_dir).values():
        last_start = max(i for i, e in enumerate(events) if e["event"] == "start")
        after = [e for e in events[last_start:] if e["event"] == "iteration"]
        if not after:
            return 0.0
        finished.append(after[0]["time"])
    return max(finished)


def run_case(case: str, width: int, workdir: Path, machines: int = 4) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    cluster = LocalCluster(workdir)
    logs = workdir / "logs"
    try:
        hang_file = workdir / "hang-now"
        cluster.start_root(**({"hang_timeout": str(HANG_TIMEOUT_S)} if case == "hang" else {}))
        command = cluster.training_command(
            logs, iterations=100_000, sleep=0.1, width=width, hang_file=hang_file
        )
        # The group loss needs a persisted iteration newer than what memory still holds; the other cases
        # persist rarely, as jobs do: a persisted iteration newer than the replicas (which trail training by
        # a few iterations) would win the recovery over the peer's copy (the planner takes the newest).
        persist_every = 5 if case == "group_loss" else PERSIST_RARELY
        cluster.launch_job(command, machines=machines, replicas=2, persist_every=persist_every)
        cluster.wait_until_warm(timeout=300)
        wait_for_iteration(logs, 6, timeout=300)
        if case == "group_loss":  # the newest persisted checkpoint is no longer in anybody's memory
            wait_until(lambda: newest_iteration(logs) % 5 == 2, 60, "iteration 5k+2", 0.01)
        victims = {"software": [], "hang": [], "hardware": [2], "group_loss": [2, 3]}[case]
        lost = [cluster.root_machine(rank) for rank in victims]
        faulted = time.time()
        if case == "software":
            kill_training_process(logs, rank=1)
        if case == "hang":
            hang_file.touch()
        for machine in lost:
            cluster.kill_machine(machine)
        events = cluster.wait_for_recoveries(len(victims) or 1, timeout=180)
        wait_until(lambda: first_iteration_after_restart(logs) > faulted, 60, "training to resume", 0.1)
        resumed = first_iteration_after_restart(logs)
        early = [e for e in cluster.failures() if timestamp(e["detected_at"]) < faulted]
        if early:  # a failure before the fault would be timed instead of the fault's: say so, never hide it
            raise RuntimeError(f"{case}: failures before the fault: {[e['cause'] for e in early]}")
        event = events[0]
        restores = [
            detail["seconds"]
            for per_machine in event["details"].get("restore", {}).values()
            for detail in per_machine.values()
            if isinstance(detail, dict) and "seconds" in detail
        ]
        return {
            "detect_s": round(min(timestamp(e["detected_at"]) for e in events) - faulted, 3),
            "resume_s": round(resumed - faulted, 3),
            "iterations_lost": max(e["iterations_lost"] or 0 for e in events),
            "tier": event["tier"],
            "restore_s": round(max(restores, default=0.0), 3),
            "phases_s": {
                phase: round(timestamp(event[f"{phase}_at"]) - timestamp(event["detected_at"]), 3)
                for phase in ("classified", "replaced", "restored", "resumed")
                if event[f"{phase}_at"]
            },
        }
    finally:
        cluster.close()


def etcd_detection(workdir: Path) -> float:
    workdir.mkdir(parents=True)
    with harness.etcd() as etcd:
        cluster = LocalCluster(workdir)
        logs = workdir / "logs"
        try:
            cluster.start_root(etcd_endpoints=etcd.endpoint, lease_ttl_s="1")
            cluster.launch_job(
                cluster.training_command(logs, iterations=100_000, sleep=0.1), machines=2, replicas=2
            )
            wait_for_iteration(logs, 3, timeout=300)
            killed = time.time()
            cluster.kill_machine(cluster.root_machine(1))
            event = wait_until(
                lambda: next((e for e in cluster.failures() if e["kind"] == "hardware"), None),
                30,
                "detection",
                0.05,
            )
            return round(timestamp(event["detected_at"]) - killed, 3)
        finally:
            cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small model on 2 machines, the software case and etcd only"
    )
    parser.add_argument(
        "--cases",
        default=None,
        help="comma-separated subset of software,hang,hardware,group_loss (default: all; --quick: software)",
    )
    args = parser.parse_args()
    width = 256 if args.quick else 2048  # 2048: about 17 MB of parameters, 50 MB with Adam's state per rank
    cases = ["software"] if args.quick else ["software", "hang", "hardware", "group_loss"]
    if args.cases:
        cases = args.cases.split(",")
        unknown = set(cases) - {"software", "hang", "hardware", "group_loss"}
        if unknown:
            parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="castor-bench-") as scratch:
        for case in cases:
            # --quick: 2 machines (one placement group), which start in half the time.
            results[case] = run_case(case, width, Path(scratch) / case, machines=2 if args.quick else 4)
            print(f"{case:12s} {results[case]}", flush=True)
        results["etcd_detect_s"] = etcd_detection(Path(scratch) / "etcd")
        print(f"{'etcd_detect_s':12s} {results['etcd_detect_s']}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
