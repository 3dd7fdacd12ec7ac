"""The replication and recovery benchmarks run (in their quick modes) and end with their JSON line; their
figures are for the README, not for assertions here."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The subprocess's own deadline comes first, so the test reports it (pytest-timeout's would interrupt the
# test mid-wait).
BENCHMARK_TIMEOUT_S = 540
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BENCHMARK_TIMEOUT_S + 60)]
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(script: str) -> Any:
    """Run a benchmark's --quick mode in its own process group, killed whole on every exit path: a benchmark
    killed alone leaves the root service, etcd or agents it started running (seen after a timeout)."""
    process = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / script), "--quick"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=BENCHMARK_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("script", "keys"),
    [
        ("replication.py", {"raw_socket_gbps", "replicate_gbps", "peer_fetch_gbps", "training_slowdown_pct"}),
        ("recovery.py", {"software", "etcd_detect_s"}),
        ("inventory.py", {"report_s", "hashed_report_s", "background_check_s", "held_gib"}),
        ("agent_cost.py", {"agent_cpu_s_per_iteration", "save_blocked_ms", "training_cpu_s_per_iteration"}),
        ("pages.py", {"job_page_ms", "metrics_ms", "job_api_ms", "leader_machines_ms", "leader_progress_ms"}),
        ("http_stack.py", {"asyncio_h11_directive_cpu_us", "uvloop_httptools_directive_cpu_us"}),
        (
            "scale.py",
            {
                "machines",
                "register_all_s",
                "heartbeat_p99_ms",
                "directive_requests_per_s",
                "false_positives",
                "detect_s",
                "job_page_ms",
            },
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
                "overhead_vs_memcpy_pct",
                "overhead_vs_memcpy_quartiles_pct",
                "memcpy_s",
                "forward_extra_s_castor",
                "stall_pct",
                "fsdp2_save_gbps",
                "fsdp2_restore_gbps",
                "memcpy_gbps",
            },
        ),
    ],
)
def test_benchmark_runs(script: str, keys: set[str]) -> None:
    figures = run_benchmark(script)
    assert keys <= set(figures)


def test_network_benchmark_runs() -> None:
    """benchmarks/network.py on the emulated cluster (namespaces: skips or, under ./scripts/test, fails
    where they cannot be made)."""
    from tests import netemu

    netemu.require()
    figures = run_benchmark("network.py")
    assert {"link_gbps", "replicate_gbps", "replicate_vs_link"} <= set(figures)
    assert figures["replicate_sender_cpu_s_per_gb"] > 0 and figures["replicate_receiver_cpu_s_per_gb"] > 0
    assert figures["replicate_host_cpu_s_per_gb"] > 0
    interleaving = {"iteration_s_none", "iteration_s_eager", "iteration_s_interleaved", "slowdown_eager_pct"}
    interleaving |= {"slowdown_interleaved_pct", "replication_interval", "replication_interval_bound"}
    interleaving |= {"replication_interval_losses"}
    interleaving |= {
        "host_cpu_s_none",
        "host_busy_pct_interleaved",
        "replication_cpu_pct_of_capacity_interleaved",
    }
    assert interleaving | {"machine_losses", "peer_restores"} <= set(figures)
    assert 0 < figures["host_busy_pct_none"] <= 100
    # Each rank's communication lies inside the span from the earliest rank's start to the latest end.
    assert 0 <= figures["send_overlap_own_ms"] <= figures["send_overlap_any_ms"]
    assert figures["comm_start_spread_ms"] >= 0
    assert figures["machine_losses"] >= 1
    from worker_lib.agent.priority import REPLICATION_NICE

    assert figures["replication_nice"] == REPLICATION_NICE  # the agents' default, as a user's agent runs


def test_alignment_benchmark_runs() -> None:
    """benchmarks/alignment.py: the product's root and agents on the emulated cluster, rounds aligned."""
    from tests import netemu

    netemu.require()
    figures = run_benchmark("alignment.py")
    assert {"interval_aligned", "lag_aligned", "iteration_s_aligned"} <= set(figures)
    assert figures["rounds_aligned"] >= 1, "an aligned round completed"


def test_replication_priority_benchmark_runs() -> None:
    figures = run_benchmark("replication_priority.py")
    for nice in (0, 5, 10):
        assert figures[f"loop_lag_max_ms_{nice}"] >= figures[f"loop_lag_p50_ms_{nice}"] >= 0
        assert figures[f"replicas_per_s_{nice}"] > 0, "every priority still replicates"


def test_gpu_benchmark_runs_or_says_why_not() -> None:
    """benchmarks/gpu.py needs a CUDA device: without one (here, CI) it says so in its JSON line and exits 0;
    with one it reports every figure the README quotes."""
    import torch

    figures = run_benchmark("gpu.py")
    if not torch.cuda.is_available():
        assert figures == {"skipped": "no CUDA device"}
        return
    expected = {"d2h_gbps_pinned", "d2h_gbps_shm_registered", "iteration_s_none", "iteration_s_memcpy"}
    expected |= {"overhead_pct_castor_staged", "overhead_pct_castor_direct", "stall_pct_castor_direct"}
    expected |= {"staging_bytes_gb_castor_direct", "steps_fenced_on_device", "direct_bytes_gb"}
    assert expected <= set(figures)
    assert figures["direct_bytes_gb"] > 0 and figures["staging_bytes_gb_castor_direct"] == 0
