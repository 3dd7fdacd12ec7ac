"""The store benchmark runs (its figures are checked by hand on the full run, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[3] / "benchmarks" / "store.py"


def test_the_quick_benchmark_prints_its_figures_as_json_on_the_last_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    rates = ("memcpy_gbps", "save_gbps", "restore_gbps", "torch_save_gbps")
    for name in (*rates, "stall_ms", "blocking_save_ms"):
        assert figures[name] > 0, name
    assert figures["rss_growth_mb"] < 50
    assert set(figures["targets"]) == {
        "save_gbps >= 0.8 x memcpy_gbps",
        "save_gbps >= 5 x torch_save_gbps",
        "restore_gbps >= 0.8 x memcpy_gbps",
        "stall_ms <= 10% of blocking_save_ms",
        "rss_growth_mb < 50",
    }
    assert list(tmp_path.iterdir()) == []  # the benchmark removed its store
