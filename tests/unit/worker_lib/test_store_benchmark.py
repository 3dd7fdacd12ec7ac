"""The store benchmark runs (its figures are checked by hand on the full run, not here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "store.py"


def test_the_quick_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    rates = ("memcpy_gbps", "memcpy_1thread_gbps", "save_gbps", "restore_gbps", "torch_save_gbps")
    for name in (*rates, "restore_in_process_s", "restore_fresh_process_s", "blocking_save_ms", "step_ms"):
        assert figures[name] > 0, name
    # The limit is the faster of the two all-core copies measured in the same run.
    assert figures["memcpy_gbps"] == max(figures["memcpy_torch_gbps"], figures["memcpy_threads_gbps"])
    assert figures["cores"] == len(os.sched_getaffinity(0))
    assert {"stall_ms", "iteration_delta_ms", "matmuls_per_step"} <= figures.keys()
    assert set(figures["paired_median"]) == {"save_vs_memcpy", "restore_vs_memcpy"}
    # Where the time goes: CPU time of every copy and what the checksum costs on its own.
    assert set(figures["paired_cpu_median"]) == {"save_vs_memcpy", "restore_vs_memcpy"}
    assert all(figures["cpu_ms_per_gib"][name] > 0 for name in ("memcpy_threads", "save", "restore"))
    assert figures["xxh3_from_cache_cpu_ms_per_gib"] > 0 and figures["xxh3_from_memory_cpu_ms_per_gib"] > 0
    assert figures["rss_growth_mb"] < 50
    assert set(figures["targets"]) == {
        "save_gbps >= 1.0 x memcpy_gbps",
        "restore_gbps >= 1.0 x memcpy_gbps",
        "restore_fresh_process_s <= 2 x restore_in_process_s",
        "save_gbps >= 5 x torch_save_gbps",
        "stall_ms <= 10% of blocking_save_ms",
        "rss_growth_mb < 50",
    }
    assert list(tmp_path.iterdir()) == []  # the benchmark removed its store
