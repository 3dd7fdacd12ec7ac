"""What Castor itself costs per training iteration on the agent side; the last line printed is JSON.

    .venv/bin/python benchmarks/agent_cost.py            # 4 machines, ~13 MB of model and Adam state per rank
    .venv/bin/python benchmarks/agent_cost.py --quick    # 2 machines, fewer iterations: checks that it runs

A data-parallel job (an MLP under DistributedDataParallel over gloo, this file in --worker mode) runs on 4
local machines started by the root's local cloud operator, m = 2, REST heartbeats, persisted every 100
iterations; each iteration computes, then sleeps --sleep seconds (the span a GPU would compute while the
host CPUs are free), then saves a checkpoint. Measured over --iterations iterations after a warm-up:

* agent_cpu_s_per_iteration: CPU seconds (user + system, /proc/<pid>/stat) of each machine's agent per
  training iteration: receiving commit notices, replicating every checkpoint to its group peer and
  receiving the peer's (verify, commit), heartbeats, uploads; the mean over the 4 agents, and the max;
* save_blocked_ms: how long save() blocked the training loop (median, p95), and save_copy_ms, how long
  the background copy took (copy + checksums + commit, median; CPU work of the training process's copy
  threads while the next iteration runs);
* training_cpu_s_per_iteration with and without checkpoints (a second run, the same job without save()),
  and the iteration time of both: the training process's own extra CPU and the slowdown;
* root_cpu_s_per_iteration: the root service's CPU per iteration (heartbeats of 4 machines).

Every process runs on this one host: with 2 cores, 4 machines' training, agents and the root compete for
them, and other work on the host shows up in the figures (they are noisy; run it twice).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness import cpu_seconds  # noqa: E402

# -- the training process (--worker) -----------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from worker_lib import Checkpointer

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = (args.log_dir / f"rank-{rank}.jsonl").open("a", buffering=1)
    end = args.warmup + args.iterations
    blocked: list[float] = []
    copies: list[float] = []
    wall: list[float] = []
    cpu_start = wall_start = 0.0
    with Checkpointer() as checkpointer:
        restored = checkpointer.restore(into={"model": model, "optimizer": optimizer})
        for iteration in range(0 if restored is None else restored.iteration + 1, end + 5):
            if iteration == args.warmup:
                cpu_start, wall_start = time.process_time(), time.perf_counter()
            started = time.perf_counter()
            inputs = torch.randn(32, args.width)
            loss = torch.nn.functional.mse_loss(ddp(inputs), inputs.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            time.sleep(args.sleep)
            if args.save:
                before = time.perf_counter()
                checkpointer.save(iteration, {"model": model, "optimizer": optimizer, "iteration": iteration})
                if args.warmup <= iteration < end:
                    blocked.append(time.perf_counter() - before)
                    copies.append(checkpointer.stats.last_copy_s)
            if args.warmup <= iteration < end:
                wall.append(time.perf_counter() - started)
            if iteration == end - 1:
                cpu = time.process_time() - cpu_start
                elapsed = time.perf_counter() - wall_start
            log.write(json.dumps({"event": "iteration", "iteration": iteration, "time": time.time()}) + "\n")
    summary = {
        "rank": rank,
        "cpu_s_per_iteration": cpu / args.iterations,
        "iteration_s": elapsed / args.iterations,
        "iteration_s_median": statistics.median(wall),
        "save_blocked_s": blocked,
        "save_copy_s": copies,
    }
    (args.log_dir / f"summary-{rank}.json").write_text(json.dumps(summary))
    dist.destroy_process_group()


# -- the driver --------------------------------------------------------------------------------------------


def run(save: bool, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tests.e2e.cluster import LocalCluster
    from tests.e2e.recovery_checks import wait_for_iteration

    workdir.mkdir(parents=True)
    logs = workdir / "logs"
    cluster = LocalCluster(workdir)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        f"--log-dir={logs}",
        f"--width={args.width}",
        f"--iterations={args.iterations}",
        f"--warmup={args.warmup}",
        f"--sleep={args.sleep}",
        *([] if save else ["--no-save"]),
    ]
    try:
        # A long heartbeat timeout: this measures steady state, and a starved agent must not be replaced.
        root = cluster.start_root(heartbeat_timeout_s="30")
        cluster.launch_job(command, machines=args.machines, replicas=2, persist_every=100)
        wait_for_iteration(logs, args.warmup, timeout=600)
        agents = [cluster.root_machine(rank).process.pid for rank in range(args.machines)]
        agents_before = [cpu_seconds(pid) for pid in agents]
        root_before = cpu_seconds(root.process.pid)
        wait_for_iteration(logs, args.warmup + args.iterations, timeout=600)
        agents_cpu = [cpu_seconds(pid) - before for pid, before in zip(agents, agents_before, strict=True)]
        root_cpu = cpu_seconds(root.process.pid) - root_before
        cluster.wait_for_job("completed", timeout=600)
        summaries = [json.loads(p.read_text()) for p in sorted(logs.glob("summary-*.json"))]
    finally:
        cluster.close()
    per_agent = [cpu / args.iterations for cpu in agents_cpu]
    blocked = sorted(s for summary in summaries for s in summary["save_blocked_s"])
    copies = [s for summary in summaries for s in summary["save_copy_s"]]
    result: dict[str, Any] = {
        "training_cpu_s_per_iteration": round(
            statistics.mean(s["cpu_s_per_iteration"] for s in summaries), 4
        ),
        "iteration_s": round(statistics.mean(s["iteration_s"] for s in summaries), 4),
        "agent_cpu_s_per_iteration": round(statistics.mean(per_agent), 4),
        "agent_cpu_s_per_iteration_max": round(max(per_agent), 4),
        "root_cpu_s_per_iteration": round(root_cpu / args.iterations, 4),
    }
    if blocked:
        result["save_blocked_ms"] = round(1000 * statistics.median(blocked), 2)
        result["save_blocked_ms_p95"] = round(1000 * blocked[int(0.95 * (len(blocked) - 1))], 2)
        result["save_copy_ms"] = round(1000 * statistics.median(copies), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-save", dest="save", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 machines, 20 iterations: checks that it runs")
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024, help="MLP width (1024: ~13 MB of state per rank)")
    parser.add_argument("--iterations", type=int, default=200, help="measured iterations")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.1, help="seconds per iteration the CPU is free")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        # Two machines (one placement group: each replicates to the other) start in half the time.
        args.iterations, args.warmup, args.width, args.machines = 20, 5, 256, 2
    with tempfile.TemporaryDirectory(prefix="castor-agent-cost-") as tmp:
        with_saves = run(True, args, Path(tmp) / "save")
        print("with checkpoints:", json.dumps(with_saves), flush=True)
        without = run(False, args, Path(tmp) / "nosave")
        print("without save():", json.dumps(without), flush=True)
    state_mb = (args.width * args.width + 2 * args.width + 1) * 4 * 3 / 1e6  # params + Adam's two moments
    figures = {
        "machines": args.machines,
        "state_mb_per_rank": round(state_mb, 1),
        "iterations": args.iterations,
        "sleep_s": args.sleep,
        "agent_cpu_s_per_iteration": with_saves["agent_cpu_s_per_iteration"],
        "agent_cpu_s_per_iteration_max": with_saves["agent_cpu_s_per_iteration_max"],
        "agent_cpu_s_per_iteration_without_saves": without["agent_cpu_s_per_iteration"],
        "save_blocked_ms": with_saves.get("save_blocked_ms"),
        "save_blocked_ms_p95": with_saves.get("save_blocked_ms_p95"),
        "save_copy_ms": with_saves.get("save_copy_ms"),
        "training_cpu_s_per_iteration": with_saves["training_cpu_s_per_iteration"],
        "training_cpu_s_per_iteration_without_saves": without["training_cpu_s_per_iteration"],
        "iteration_s": with_saves["iteration_s"],
        "iteration_s_without_saves": without["iteration_s"],
        "root_cpu_s_per_iteration": with_saves["root_cpu_s_per_iteration"],
        "host_cpus": os.cpu_count(),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
