"""Secrets and process hygiene with real agents: training processes die with a killed agent, a restarted
agent kills what its predecessor left running, and no token appears in any log of a job's run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from services import local_faults
from tests.e2e.cluster import LocalCluster, read_events, wait_until
from worker_lib.agent.stale import proc_stat, record_pid

pytestmark = pytest.mark.slow

QUIET_HEARTBEATS = {"heartbeat_timeout_s": "15"}


def alive(pid: int) -> bool:
    return proc_stat(pid) is not None  # a zombie (waiting for init to reap it) is gone


def test_training_processes_die_with_a_killed_agent(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.start_root(**QUIET_HEARTBEATS)
    cluster.create_job(machines=2, replicas=2)
    logs = tmp_path / "logs"
    command = cluster.training_command(logs, iterations=100_000, sleep=0.05)
    warm = cluster.start_machine(0, command, rank=0)  # its ranks start in warm spares
    cold = cluster.start_machine(1, command, rank=1, extra_args=["--no-warm-start"])  # through the wrapper
    wait_until(
        lambda: len(events := read_events(logs)) == 2 and all(len(e) >= 3 for e in events.values()),
        240,
        "both ranks training",
    )
    training = {m.index: local_faults.training_pids(m.shm_dir) for m in (warm, cold)}
    spares = local_faults.pids_with_arguments("--machine", str(warm.shm_dir))
    assert all(len(pids) == 1 for pids in training.values()), training
    doomed = [*training[0], *training[1], *spares]

    for machine in (warm, cold):
        machine.process.send_signal(signal.SIGKILL)  # the agent only
    for machine in (warm, cold):
        machine.process.wait()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in doomed) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in doomed if alive(pid)], "training processes outlived their agent"


def test_a_restarted_agent_kills_what_its_predecessor_left(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.start_root(**QUIET_HEARTBEATS)
    cluster.create_job(machines=2, replicas=2)
    instance = "machine-0"
    machine_dir = cluster.shm_base / instance
    (machine_dir / "pids").mkdir(parents=True)
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    # A training process of this machine that a previous agent left behind, and an unrelated process whose
    # pid a stale pid file happens to name.
    ours = subprocess.Popen(
        sleeper, env={**os.environ, "CASTOR_SHM_DIR": f"{machine_dir}/local/rank-0"}, start_new_session=True
    )
    stranger = subprocess.Popen(sleeper, start_new_session=True)
    try:
        wait_until(lambda: proc_stat(ours.pid) and proc_stat(stranger.pid), 10, "the dummies to start")
        record_pid(machine_dir / "pids" / "rank-0", ours.pid)
        record_pid(machine_dir / "pids" / "rank-1", stranger.pid)

        agent = cluster.start_machine(0, ["sleep", "600"], instance_id=instance, rank=0)
        wait_until(lambda: ours.poll() is not None, 120, "the stale training process to be killed")
        assert ours.returncode == -signal.SIGKILL
        wait_until(lambda: "left over by a previous agent" in agent.log_path.read_text(), 30, "the log line")
        assert stranger.poll() is None, "a process that is not the machine's was killed"
    finally:
        for process in (ours, stranger):
            process.kill()
            process.wait()


def test_no_token_in_any_log_nor_in_a_training_processs_environment(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A job the root's local operator launches (agents get --token-file), run to completion; its training
    processes print their environment, as an experiment tracker would record it."""
    cluster.start_root(**QUIET_HEARTBEATS)
    logs = tmp_path / "training"
    command = [*cluster.training_command(logs, iterations=8), "--print-environ"]
    cluster.launch_job(command, machines=2, replicas=2)
    worker_token = cluster.job["worker_token"]
    job_hex = uuid.UUID(cluster.job["id"]).hex
    agents = wait_until(
        lambda: len(p := local_faults.pids_with_arguments("--job", cluster.job["id"])) == 2 and p,
        60,
        "the two agents",
    )
    for pid in agents:  # no agent holds the token in its arguments
        with_pid = Path(f"/proc/{pid}/cmdline")
        if with_pid.exists():
            assert worker_token.encode() not in with_pid.read_bytes()
    cluster.wait_for_job("completed", timeout=300)

    files = [
        *cluster.workdir.glob("*.log"),
        *(cluster.workdir / "root-state" / "jobs" / job_hex / "logs").glob("*.log"),
        *logs.glob("*.jsonl"),
    ]
    assert any("environ:" in f.read_text(errors="replace") for f in files), "the training printed its env"
    assert any(f.name.startswith("root-") for f in files) and len(files) >= 5, files
    for path in files:
        text = path.read_text(errors="replace")
        assert worker_token not in text, f"the worker token is in {path}"
        assert cluster.admin_token not in text, f"the admin token is in {path}"
