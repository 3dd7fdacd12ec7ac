"""`castor serve` shows the admin token only on the start that generates it; later starts say where it is,
so the token does not land in every log of the service."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.harness import free_port, wait_for_port
from tests.integration.cli.conftest import base_env


def _serve_once(state_dir: Path, *extra_env: tuple[str, str]) -> str:
    port = free_port()
    env = {**base_env(), "CASTOR_STATE_DIR": str(state_dir), "CASTOR_LOCAL_SHM_BASE": str(state_dir / "shm")}
    env.update(extra_env)
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_for_port(port, process, timeout=60)
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    return output.decode()


def test_the_admin_token_is_printed_only_when_generated(tmp_path: Path) -> None:
    first = _serve_once(tmp_path)
    path = tmp_path / "admin-token"
    token = path.read_text().strip()
    assert token in first and "shown only this once" in first, first

    again = _serve_once(tmp_path)
    assert token not in again, "a later start must not print the token"
    assert f"admin token: in {path.resolve()}" in again, again

    configured = _serve_once(tmp_path, ("CASTOR_ADMIN_TOKEN", "castor-admin.from-the-environment"))
    assert "castor-admin.from-the-environment" not in configured and token not in configured
    assert "CASTOR_ADMIN_TOKEN" in configured
