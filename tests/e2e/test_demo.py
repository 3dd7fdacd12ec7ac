"""The one-command demo, in a short mode: a training job on 4 local machines survives a software failure,
a machine loss and a whole-group loss, each recovered from the expected tier."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from services import local_faults
from tests.harness import free_port

pytestmark = pytest.mark.slow


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
