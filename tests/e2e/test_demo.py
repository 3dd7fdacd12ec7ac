"""The one-command demo, in a short mode: a training job on 4 local machines survives a software failure,
a machine loss and a whole-group loss, each recovered from the expected tier."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from services import local_faults
from services.demo import SHUTDOWN_BUDGET_S
from tests.e2e.cluster import wait_until
from tests.harness import free_port, wait_for_port

pytestmark = pytest.mark.slow

# The demo's own shutdown budget (its watchdog prints the stacks and exits 1 past it), plus margin: a hang
# shows up as a failed assertion with the stacks in the output, not as a timeout with nothing to read.
CTRL_C_WITHIN_S = SHUTDOWN_BUDGET_S + 30


def test_demo_survives_three_kinds_of_failure(tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"castor-demo-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "CASTOR_STATE_DIR": str(tmp_path / "state"), "CASTOR_LOCAL_SHM_BASE": str(shm)}
    command = [
        sys.executable,
        "-m",
        "services.cli",
        "demo",
        "--port",
        str(free_port()),
        "--iterations",
        "160",
        "--exit-when-done",
    ]
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    finally:
        local_faults.kill(local_faults.pids_with_arguments("--shm-dir", str(shm)))
        shutil.rmtree(shm, ignore_errors=True)
    output = result.stdout
    assert result.returncode == 0, output + result.stderr[-3000:]
    recovered = re.findall(r"recovered: (\w+) failure, tier (\w+)", output)
    assert recovered == [("software", "local"), ("hardware", "peer"), ("hardware", "persistent")], output
    assert "Job completed at iteration 159" in output
    assert re.search(r"admin token: castor-admin\.\S+", output)


def test_ctrl_c_stops_the_demo_its_job_and_its_machines(tmp_path: Path) -> None:
    shm = Path("/dev/shm") / f"castor-demo-{uuid.uuid4().hex[:8]}"
    state = tmp_path / "state"
    env = {**os.environ, "CASTOR_STATE_DIR": str(state), "CASTOR_LOCAL_SHM_BASE": str(shm)}
    port = free_port()
    command = [sys.executable, "-m", "services.cli", "demo", "--port", str(port), "--machines", "2"]
    process = subprocess.Popen(
        [*command, "--no-faults", "--iterations", "100000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}/api/v1"
    try:
        wait_for_port(port, process, timeout=60)
        headers = {"Authorization": f"Bearer {(state / 'admin-token').read_text().strip()}"}

        def training() -> dict[str, object] | None:
            jobs = httpx.get(base + "/jobs", headers=headers).json()["items"]
            return jobs[0] if jobs and (jobs[0]["newest_iteration"] or 0) >= 2 else None

        job = wait_until(training, 180, "the demo job to train")
        assert local_faults.pids_with_arguments("--shm-dir", str(shm)), "its machines run"
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=CTRL_C_WITHIN_S)
    finally:
        if process.poll() is None:
            process.kill()
        leftover = (  # agents, their warm spares, training processes
            local_faults.pids_with_arguments("--shm-dir", str(shm))
            + local_faults.pids_with_arguments("--machine", str(shm))
            + local_faults.pids_with_environ(f"CASTOR_SHM_DIR={shm}")
        )
        local_faults.kill(leftover)
        shutil.rmtree(shm, ignore_errors=True)
    assert process.returncode == 0, output
    assert f"Stopped job {job['name']}" in output
    assert leftover == [], "Ctrl-C left machines running"
    assert not shm.exists() or not any(shm.iterdir()), "their shared memory was given back"


def test_ctrl_c_after_the_job_ended_shuts_the_server_down_cleanly(tmp_path: Path) -> None:
    """Once the job is over the demo keeps serving its pages until Ctrl-C. Ctrl-C used to cancel uvicorn's
    task itself (the demo's task was awaiting it), so the server skipped its shutdown and the app's
    lifespan died with a CancelledError traceback, its database threads left to the interpreter's exit.
    The demo is started with SIGINT ignored, as a background job of a non-interactive shell inherits it
    (`castor demo &` in a script, or a test suite started that way): Ctrl-C must still stop it."""
    shm = Path("/dev/shm") / f"castor-demo-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "CASTOR_STATE_DIR": str(tmp_path / "state"), "CASTOR_LOCAL_SHM_BASE": str(shm)}
    log = tmp_path / "demo.log"
    ignoring_sigint = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    command = [
        *(sys.executable, "-c", ignoring_sigint),
        *("-m", "services.cli", "demo", "--port", str(free_port()), "--machines", "2"),
    ]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--no-faults", "--iterations", "3"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        over = lambda: "The pages stay up" in log.read_text() or process.poll() is not None  # noqa: E731
        wait_until(over, 300, "the end of the job")
        assert process.poll() is None, log.read_text()
        process.send_signal(signal.SIGINT)
        process.wait(timeout=CTRL_C_WITHIN_S)
    finally:
        if process.poll() is None:
            process.kill()
        local_faults.kill(local_faults.pids_with_arguments("--shm-dir", str(shm)))
        shutil.rmtree(shm, ignore_errors=True)
    output = log.read_text()
    assert "Job completed at iteration 2" in output
    assert process.returncode == 0, output
    assert "Traceback" not in output and "CancelledError" not in output, output
