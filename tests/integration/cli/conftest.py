"""A real root service (`castor serve` in a subprocess, SQLite in a temp state dir) for the CLI tests, and
a helper that runs the CLI as a subprocess the way an operator would."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import start_listening, stop_process

ADMIN_TOKEN = "castor-admin.cli-test-token"


@dataclass
class Root:
    url: str
    state_dir: Path
    workdir: Path
    process: subprocess.Popen[bytes]

    def api(self, method: str, path: str, token: str = ADMIN_TOKEN, **kwargs: Any) -> httpx.Response:
        return httpx.request(
            method, self.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=10, **kwargs
        )


def base_env() -> dict[str, str]:
    """The test process's environment without any CASTOR_* variable (a developer's shell may set some)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("CASTOR_")}


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Root]:
    state_dir = tmp_path_factory.mktemp("cli-root")
    env = {
        **base_env(),
        "CASTOR_STATE_DIR": str(state_dir),
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        # No agents heartbeat for the jobs these tests register by hand: keep the failure detector out.
        "CASTOR_HEARTBEAT_TIMEOUT_S": "3600",
        "CASTOR_INVENTORY_TIMEOUT_S": "3600",
        "CASTOR_LOCAL_SHM_BASE": str(state_dir / "shm"),
    }
    log = (state_dir / "serve.log").open("wb")
    # Every CLI test of this worker uses this one server: a port taken between its choice and the bind (the
    # other xdist worker's processes take ephemeral ports too) starts it again on another.
    try:
        process, (port,) = start_listening(
            lambda ports: [
                *(sys.executable, "-m", "services.cli", "serve"),
                *("--port", str(ports[0]), "--log-level", "warning"),
            ],
            timeout=60,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    except BaseException:
        log.close()
        raise
    server = Root(f"http://127.0.0.1:{port}", state_dir, tmp_path_factory.mktemp("cli-workdir"), process)
    try:
        yield server
    finally:
        try:
            # Deleting a job stops the agents the local operator started for it (they outlive the service).
            if process.poll() is None:
                for job in server.api("GET", "/api/v1/jobs", params={"limit": 500}).json()["items"]:
                    server.api("DELETE", f"/api/v1/jobs/{job['id']}")
        finally:  # a wedged service (the deletes failing) is stopped all the same
            stop_process(process)
            log.close()


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        import json

        return json.loads(self.stdout)


def castor(root: Root, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Result:
    """`castor ARGS` against the test root, run from a scratch directory (no stray .castor/admin-token)."""
    environment = {
        **base_env(),
        "CASTOR_ROOT_URL": root.url,
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        **(env or {}),
    }
    environment = {key: value for key, value in environment.items() if value}  # "" unsets a variable
    completed = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=root.workdir,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )
    assert "Traceback" not in completed.stderr, completed.stderr
    return Result(completed.returncode, completed.stdout, completed.stderr)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def create_job(root: Root, name: str, machines: int = 4, **fields: Any) -> dict[str, Any]:
    response = root.api("POST", "/api/v1/jobs", json={"name": name, "machines": machines, **fields})
    assert response.status_code == 201, response.text
    job: dict[str, Any] = response.json()
    return job


def castor_on_tty(root: Root, *args: str, typed: bytes = b"", timeout: float = 60) -> tuple[int, str]:
    """`castor ARGS` with a pseudo-terminal as stdin, stdout and stderr (what an operator's shell gives it);
    `typed` is what the operator types. Returns the exit code and everything the terminal showed."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    environment = {**base_env(), "CASTOR_ROOT_URL": root.url, "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=environment,
        cwd=root.workdir,
        close_fds=True,
    )
    os.close(slave)
    if typed:
        os.write(master, typed)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed its side
                    break
                if not chunk:
                    break
                output += chunk
            elif process.poll() is not None:
                break
        process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(master)
    text = output.decode(errors="replace")
    assert "Traceback" not in text, text
    return process.returncode, text
