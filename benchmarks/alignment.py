"""Aligned replication rounds through the real root (issue 11): how far the job's fully replicated iteration
trails training when every machine's rounds are aligned through the root's REST heartbeats
(the default), against free rounds (CASTOR_REPLICATION_ALIGN=0: each machine on its own).

    sudo .venv/bin/python benchmarks/alignment.py            # 4 machines, 0.1 Gbit/s, 160 iterations
    sudo .venv/bin/python benchmarks/alignment.py --quick    # 2 machines, 50 iterations, aligned only

On the emulated cluster (tests/netemu.py: each machine in its own network namespace behind a rate-limited
NIC), the root as in production (`python -m services.cli serve`, its default 1 s heartbeat period, on the
harness's Postgres) and one agent per machine running tests/e2e/workloads/train_ballast.py (a 16 MiB
ballast per rank, a checkpoint every iteration: one replica takes about 1.3 s on the 0.1 Gbit/s link,
several iterations). While training runs the job's API is read every 0.2 s. Figures per mode
(`_aligned`, `_free`):

* interval: the median of the job's `replication_interval` (iterations between a machine's last two fully
  replicated checkpoints, the largest over the machines) over the distinct fully replicated iterations seen;
* lag: the median of `replication_lag` (the newest iteration every rank committed minus the fully
  replicated one, the largest over the machines);
* iteration_s: the median iteration time of rank 0 (from its log);
* rounds: distinct fully replicated iterations seen.

An aligned round moves in steps (every machine done, the next proposal, every pin, the go), each a change in
one machine's summary that the others must hear of: heard only with each heartbeat, each step cost up to a
heartbeat period. The agents now heartbeat at once when their part changes and long-poll the job's
alignment (services/root/flows/alignment.py). Last line: JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import harness, netemu  # noqa: E402
from tests.e2e.cluster import read_events  # noqa: E402
from tests.e2e.netcluster import NetCluster  # noqa: E402
from tests.e2e.recovery_checks import newest_iteration  # noqa: E402

WORKLOAD = REPO / "tests" / "e2e" / "workloads" / "train_ballast.py"


def run(
    mode: str,
    database_url: str,
    machines: int,
    iterations: int,
    rate_gbit: float,
    ballast_mb: int,
    logs_to: Path | None = None,
) -> dict[str, Any]:
    """One job of `machines` machines trained for `iterations`, its rounds aligned or free."""
    agent_env = {"CASTOR_REPLICATION_ALIGN": "1" if mode == "aligned" else "0"}
    with (
        netemu.cluster(machines, rate_gbit=rate_gbit) as emu,
        tempfile.TemporaryDirectory(prefix=f"castor-bench-align-{mode}-") as scratch,
    ):
        cluster = NetCluster(Path(scratch))
        cluster.emu, cluster.agent_env = emu, agent_env
        try:
            # The product's heartbeat period; a timeout long enough that a late heartbeat is no loss here.
            cluster.start_root(database_url=database_url, heartbeat_interval_s="1.0", heartbeat_timeout_s="8")
            cluster.create_job(machines=machines, replicas=2)
            logs = Path(scratch) / "logs"
            command = [
                sys.executable,
                str(WORKLOAD),
                f"--iterations={iterations}",
                f"--ballast-mb={ballast_mb}",
                "--sleep=0.1",
                f"--log-dir={logs}",
            ]
            for index in range(machines):
                cluster.start_machine(index, command, rank=index)
            samples: list[tuple[int, int | None, int | None]] = []  # (replicated, interval, lag)
            deadline = time.monotonic() + 30 + iterations * 2.0
            while newest_iteration(logs) < iterations - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"training did not finish:\n{cluster.logs(tail=30)}")
                if any(m.process.poll() not in (None, 0) for m in cluster.machines):
                    raise RuntimeError(f"an agent failed:\n{cluster.logs(tail=30)}")
                job = cluster.job_state()
                replicated = job.get("replicated_iteration")
                if replicated is not None:
                    samples.append((replicated, job.get("replication_interval"), job.get("replication_lag")))
                time.sleep(0.2)
            events = [e for e in read_events(logs)[0] if e["event"] == "iteration"]
        finally:
            if logs_to is not None:
                logs_to.mkdir(parents=True, exist_ok=True)
                (logs_to / f"{mode}.log").write_text(cluster.logs(tail=100_000))
            cluster.close()
    # One figure per fully replicated iteration (the first two left out: the job's start), every lag seen.
    by_round: dict[int, int] = {}
    for replicated, interval, _ in samples:
        if interval is not None:
            by_round.setdefault(replicated, interval)
    intervals = list(by_round.values())[2:]
    lags = [lag for _, _, lag in samples if lag is not None]
    times = [b["time"] - a["time"] for a, b in itertools.pairwise(events)]
    return {
        f"interval_{mode}": statistics.median(intervals) if intervals else None,
        f"lag_{mode}": statistics.median(lags) if lags else None,
        f"iteration_s_{mode}": round(statistics.median(times), 4) if times else None,
        f"rounds_{mode}": len(by_round),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 machines, 50 iterations, aligned only")
    parser.add_argument("--iterations", type=int, help="training iterations (160; --quick 50)")
    parser.add_argument("--modes", default=None, help="aligned,free (--quick: aligned)")
    parser.add_argument("--logs", type=Path, help="write each mode's root and agent logs into this directory")
    args = parser.parse_args()
    reason = netemu.unavailable()
    if reason:
        print(f"benchmarks/alignment.py: the emulated cluster cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    machines = 2 if args.quick else 4
    iterations = args.iterations or (50 if args.quick else 160)
    modes = (args.modes or ("aligned" if args.quick else "aligned,free")).split(",")
    results: dict[str, Any] = {"machines": machines, "iterations": iterations, "rate_gbit": 0.1}
    with harness.postgres() as server:
        for mode in modes:
            database_url = server.create_database(f"castor_align_{mode}")
            results.update(
                run(mode, database_url, machines, iterations, 0.1, ballast_mb=16, logs_to=args.logs)
            )
    for key, value in results.items():
        print(f"{key:24s} {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
