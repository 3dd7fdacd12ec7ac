"""What lowering replication's threads (worker_lib/agent/priority.py) costs the agent's event loop; the last
line printed is JSON.

    .venv/bin/python benchmarks/replication_priority.py           # nice 0, 5 and 10, 30 s each, 3 burners
    .venv/bin/python benchmarks/replication_priority.py --quick   # 3 s each: checks that it runs

The agent's event loop (its lease refreshes, its answers to the root) keeps the process's priority, but it
shares Python's interpreter lock with the lowered threads: one preempted while it holds the lock holds the
loop up until the scheduler runs it again. This measures that in the worst case: a Replicator and a
DataPlaneServer in one process replicate 80 MiB checkpoints over loopback back to back (eager, no
interleaving), while `--burners` processes at nice 0 spin on every core (training that keeps the host's
cores busy), and an asyncio loop in the same process sleeps 50 ms at a time and records how late it wakes.
Each nice value runs in a fresh process. Figures per nice value N:

* loop_lag_p50_ms_N, loop_lag_p99_ms_N, loop_lag_max_ms_N: how late the loop woke;
* replicas_per_s_N: replicas completed a second (the lowered threads get what the burners leave).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SLEEP_S = 0.05
CHECKPOINT_FLOATS = 20 << 20  # 80 MiB


def measure(nice: int, seconds: float, burners: int) -> dict[str, float]:
    import torch

    from worker_lib import Checkpointer
    from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
    from worker_lib.agent.holdings import Holdings
    from worker_lib.agent.pacing import Pacer
    from worker_lib.agent.replication import Replicator

    shm = Path("/dev/shm") / f"castor-bench-priority-{uuid.uuid4().hex[:8]}"
    key = data_plane_key("castor-job.bench.secret")
    receiver = DataPlaneServer(Holdings(shm / "receiver"), key, "bench", host="127.0.0.1", nice=nice)
    receiver.start()
    holdings = Holdings(shm / "sender")
    replicator = Replicator(
        holdings,
        key,
        "bench",
        [1],
        lambda machine: ("127.0.0.1", receiver.port),
        streams=1,
        pacer=Pacer("eager", None, list),
        nice=nice,
    ).start()
    stop = threading.Event()
    replicas = [0]

    def commit_and_replicate() -> None:
        state = {"w": torch.zeros(CHECKPOINT_FLOATS)}
        with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
            iteration = 0
            while not stop.is_set():
                iteration += 1
                state["w"].fill_(float(iteration))
                checkpointer.save(iteration, state)
                replicator.notice_commit(0, iteration)
                if replicator.flush([0], timeout_s=60):
                    replicas[0] += 1

    async def loop_lags() -> list[float]:
        lags, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.monotonic()
            await asyncio.sleep(SLEEP_S)
            lags.append((time.monotonic() - started - SLEEP_S) * 1000)
        return lags

    committer = threading.Thread(target=commit_and_replicate, daemon=True)
    spinners: list[subprocess.Popen[bytes]] = []
    try:
        committer.start()
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
        started = time.monotonic()
        lags = sorted(asyncio.run(loop_lags()))
        elapsed = time.monotonic() - started
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        stop.set()
        committer.join(60)
        replicator.stop()
        receiver.stop()
        holdings.close()
        receiver.holdings.close()
        shutil.rmtree(shm, ignore_errors=True)
    return {
        f"loop_lag_p50_ms_{nice}": round(statistics.median(lags), 2),
        f"loop_lag_p99_ms_{nice}": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))], 2),
        f"loop_lag_max_ms_{nice}": round(lags[-1], 2),
        f"replicas_per_s_{nice}": round(replicas[0] / elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 s per nice value")
    parser.add_argument("--seconds", type=float, help="per nice value (30; --quick 3)")
    parser.add_argument("--burners", type=int, default=3, help="nice-0 processes spinning meanwhile")
    parser.add_argument("--nices", default="0,5,10", help="comma-separated nice values")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure this nice value
    args = parser.parse_args()
    seconds = args.seconds or (3.0 if args.quick else 30.0)
    if args.one is not None:
        print(json.dumps(measure(args.one, seconds, args.burners)))
        return
    figures: dict[str, float | int] = {"seconds": seconds, "burners": args.burners}
    for nice in (int(n) for n in args.nices.split(",")):
        # A fresh process per value: a thread's lowered priority is inherited by the threads it starts.
        command = [sys.executable, __file__, "--one", str(nice), "--seconds", str(seconds)]
        command += ["--burners", str(args.burners)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        figures.update(json.loads(output.strip().splitlines()[-1]))
    for key, value in figures.items():
        print(f"{key:24s} {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
