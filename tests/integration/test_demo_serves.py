"""`castor demo` serves the API and the root page on the embedded defaults and stops cleanly on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.harness import free_port, wait_for_port


def test_demo_serves_api_and_root_page(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "CASTOR_STATE_DIR": str(tmp_path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "demo", "--serve-only", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_for_port(port, process, timeout=60)
        base = f"http://127.0.0.1:{port}"
        assert "Castor" in httpx.get(base + "/").text
        token = (tmp_path / "admin-token").read_text().strip()
        created = httpx.post(
            base + "/api/v1/jobs",
            json={"name": "demo-smoke", "machines": 2},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert created.status_code == 201, created.text
        assert (tmp_path / "castor.db").exists(), "the embedded default is a SQLite file in the state dir"
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    # The first start generated the token: shown this once, with where it is kept.
    assert f"admin token: {token}" in output and str((tmp_path / "admin-token").resolve()) in output
    assert f"127.0.0.1:{port}" in output
