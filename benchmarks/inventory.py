"""What a recovery's inventory report costs a machine that holds a lot; the last line printed is JSON.

    .venv/bin/python benchmarks/inventory.py            # 8 local ranks + 8 replicas, 2 x 128 MiB each: 4 GiB
    .venv/bin/python benchmarks/inventory.py --quick    # 2 + 2 ranks, 2 x 8 MiB: checks that it runs

Every agent reports what it holds before the recovery plan can be made, and the plan waits for the last
report. `report_s` is the report as the agent makes it now (`Holdings.inventory()`: manifests only, no
byte read); `hashed_report_s` is the report with every copy's checksums verified first, as the agent made
it before (and as `inventory(verify_checksums=True)` still does); `background_check_s` is the check the
agent now runs after the report, newest iterations first, until the plan arrives. Each is measured on a
fresh `Holdings` (nothing remembered from an earlier check), the best of `--repeat` runs; `held_gib` is
what the machine holds, and `hashed_gib_per_s` the rate the hashed report ran at.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_lib import Checkpointer
from worker_lib.agent.holdings import Holdings


def fill(root: Path, ranks: int, checkpoints: int, mib: int) -> int:
    """`ranks` local ranks and as many replica ranks, each with `checkpoints` committed checkpoints of
    `mib` MiB; returns the bytes held."""
    holdings = Holdings(root)
    numel = mib << 18  # fp32
    held = 0
    for rank in range(ranks):
        for directory in (holdings.directory("local", rank), holdings.directory("replica", ranks + rank)):
            with Checkpointer(directory, blocking=True) as checkpointer:
                for iteration in range(1, checkpoints + 1):
                    checkpointer.save(iteration, {"w": torch.full((numel,), float(iteration))})
                    held += numel * 4
    holdings.close()
    return held


def best_of(repeat: int, root: Path, measure: str) -> float:
    times = []
    for _ in range(repeat):
        holdings = Holdings(root)  # nothing remembered from the previous run
        started = time.perf_counter()
        if measure == "report":
            found = holdings.inventory()
            assert all(h.verified is None for h in found)
        elif measure == "hashed":
            found = holdings.inventory(verify_checksums=True)
            assert all(h.verified for h in found)
        else:
            assert holdings.check_unverified() == []
        times.append(time.perf_counter() - started)
        holdings.close()
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8, help="local ranks (and as many replica ranks)")
    parser.add_argument("--checkpoints", type=int, default=2, help="committed checkpoints per rank")
    parser.add_argument("--mib", type=int, default=128, help="MiB per checkpoint")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 + 2 ranks of 2 x 8 MiB, 2 runs")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.mib, args.repeat = 2, 8, 2
    root = Path("/dev/shm") / f"castor-inventory-bench-{uuid.uuid4().hex[:8]}"
    try:
        held = fill(root, args.ranks, args.checkpoints, args.mib)
        figures = {
            "held_gib": round(held / 2**30, 3),
            "copies": 2 * args.ranks * args.checkpoints,
            "report_s": round(best_of(args.repeat, root, "report"), 4),
            "hashed_report_s": round(best_of(args.repeat, root, "hashed"), 3),
            "background_check_s": round(best_of(args.repeat, root, "background"), 3),
        }
        figures["hashed_gib_per_s"] = round(figures["held_gib"] / figures["hashed_report_s"], 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for name, value in figures.items():
        print(f"{name:>20}: {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
