"""FSDP2 end to end: a GPT-style decoder with registered buffers (causal mask, RoPE tables), sharded with
`fully_shard` over gloo on 2 machines x 2 processes (m = 2), checkpointed every iteration as DTensor shards.
After a fault the job resumes from the expected tier and finishes bit-exact (every rank's parameter and
AdamW-state shards after every iteration) against an uninterrupted run of the same program.

2 x 2 rather than the issue's 4 x 2: 8 training processes, their warm spares and 4 agents on this host's
2 cores would take minutes per case; the sharding, the recovery planner and the tiers see the same thing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import REPO, LocalCluster, read_events, wait_until
from tests.e2e.recovery_checks import (
    check_consistent_restore,
    check_event,
    kill_training_process,
    newest_iteration,
    recovered_events,
)
from tests.harness import free_port

pytestmark = pytest.mark.slow

WORKLOAD = REPO / "tests" / "e2e" / "workloads" / "train_fsdp2.py"
MACHINES, PROCS = 2, 2
WORLD = MACHINES * PROCS
ITERATIONS = 14


def command(log_dir: Path, sleep: float) -> list[str]:
    return [
        sys.executable,
        str(WORKLOAD),
        f"--iterations={ITERATIONS}",
        f"--sleep={sleep}",
        f"--log-dir={log_dir}",
    ]


def uninterrupted_run(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """The same program on WORLD plain processes (no agent, no failure): the reference."""
    port = free_port()
    shm = Path("/dev/shm") / f"castor-e2e-fsdp2-reference-{uuid.uuid4().hex[:8]}"
    processes = []
    try:
        for rank in range(WORLD):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "CASTOR_SHM_DIR": str(shm / f"rank-{rank}"),
            }
            processes.append(subprocess.Popen(command(log_dir, sleep=0), cwd=REPO, env=env))
        codes = [process.wait(timeout=300) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        shutil.rmtree(shm, ignore_errors=True)
    assert codes == [0] * WORLD
    return read_events(log_dir)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """One uninterrupted run for every fault."""
    return uninterrupted_run(tmp_path_factory.mktemp("fsdp2-reference"))


def final_digests(events: dict[int, list[dict[str, Any]]]) -> dict[int, dict[int, str]]:
    """Per rank, the digest of its shards after each iteration as the run finally computed it."""
    return {
        rank: {e["iteration"]: e["digest"] for e in rank_events if e["event"] == "iteration"}
        for rank, rank_events in events.items()
    }


# fault -> (machines lost, failure kind, tier of the slowest restore)
FAULTS = {
    "process_kill": ((), "software", "local"),
    "machine_loss": ((1,), "hardware", "peer"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fsdp2_decoder_resumes_bit_exact_after_a_fault(
    cluster: LocalCluster, tmp_path: Path, fault: str, reference: dict[int, list[dict[str, Any]]]
) -> None:
    lost, kind, tier = FAULTS[fault]

    logs = tmp_path / "logs"
    # A long heartbeat timeout for the process kill: a late heartbeat on a saturated host must not turn it
    # into a machine loss.
    cluster.start_root(heartbeat_timeout_s="6" if lost else "15")
    cluster.launch_job(command(logs, sleep=0.3), machines=MACHINES, procs_per_machine=PROCS, replicas=2)
    wait_until(lambda: newest_iteration(logs) >= 3, 180, "iteration 3", 0.05)
    if lost:
        for machine in [cluster.root_machine(index) for index in lost]:
            cluster.kill_machine(machine)
    else:
        kill_training_process(logs, rank=1)
    reached = newest_iteration(logs)
    (event,) = recovered_events(cluster, 1, timeout=180)
    check_event(event, kind=kind, tier=tier, replaced=bool(lost))
    if lost:
        assert event["details"]["tiers"] == {"0": "local", "1": "local", "2": "peer", "3": "peer"}
    else:
        assert set(event["details"]["tiers"].values()) == {"local"}
    check_consistent_restore(logs, WORLD, reached, max_lost=1)
    cluster.wait_for_job("completed")

    events = read_events(logs)
    assert final_digests(events) == final_digests(reference)
    assert len(final_digests(reference)[0]) == ITERATIONS
    for rank in range(WORLD):
        (done,) = [e for e in events[rank] if e["event"] == "done"]
        (reference_done,) = [e for e in reference[rank] if e["event"] == "done"]
        assert done["digest"] == reference_done["digest"]
