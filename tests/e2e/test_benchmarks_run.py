"""The replication and recovery benchmarks run (in their quick modes) and end with their JSON line; their
figures are for the README, not for assertions here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "keys"),
    [
        ("replication.py", {"raw_socket_gbps", "replicate_gbps", "peer_fetch_gbps", "training_slowdown_pct"}),
        ("recovery.py", {"software", "etcd_detect_s"}),
        ("agent_cost.py", {"agent_cpu_s_per_iteration", "save_blocked_ms", "training_cpu_s_per_iteration"}),
        (
            "scale.py",
            {"machines", "register_all_s", "heartbeat_p99_ms", "false_positives", "detect_s", "job_page_ms"},
        ),
        (
            "models.py",
            {
                "transformer_params_m",
                "iteration_s_none",
                "iteration_s_memcpy",
                "iteration_s_castor",
                "memcpy_overhead_pct",
                "overhead_pct",
                "stall_pct",
                "fsdp2_save_gbps",
                "fsdp2_restore_gbps",
                "memcpy_gbps",
            },
        ),
    ],
)
def test_benchmark_runs(script: str, keys: set[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick"], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert keys <= set(figures)


def test_network_benchmark_runs() -> None:
    """benchmarks/network.py on the emulated cluster (namespaces: skips or, under ./scripts/test, fails
    where they cannot be made)."""
    from tests import netemu

    netemu.require()
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "network.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"link_gbps", "replicate_gbps", "replicate_vs_link"} <= set(figures)
