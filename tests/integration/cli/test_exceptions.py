"""A crashed rank's exception, not only its exit code, on the failure event, the failure page and
`castor failures show`.

The way an agent reports it: a real training process (torchelastic's `@record` on its entry point) raises
ValueError("boom 42") under the agent's WorkerGroup, which reads its TORCHELASTIC_ERROR_FILE; the agent's
RootClient sends the exit report to a real `castor serve`.
"""

from __future__ import annotations

import asyncio
import html
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.cli.conftest import ADMIN_TOKEN, Root, castor, create_job, unique
from tests.integration.test_error_files import WITH_RECORD, check, spec
from worker_lib.agent.launcher import ProcessExit, WorkerGroup
from worker_lib.client import RootClient

pytestmark = pytest.mark.slow


async def crash(tmp_path: Path) -> ProcessExit:
    script = tmp_path / "train.py"
    script.write_text(WITH_RECORD)
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=False, pid_dir=tmp_path / "machine" / "pids")
    try:
        await group.start(spec(tmp_path, script))
        return await asyncio.wait_for(exits.get(), timeout=120)
    finally:
        await group.stop()


async def report(root: Root, job: dict[str, Any], ended: ProcessExit) -> dict[str, Any]:
    async with RootClient(root.url, job["id"], job["worker_token"]) as client:
        return await client.report_exit(
            1, "i-1", local_rank=0, global_rank=1, exit_code=ended.exit_code, error=ended.error
        )


def test_the_exception_reaches_the_failure_event_page_and_cli(root: Root, tmp_path: Path) -> None:
    ended = asyncio.run(crash(tmp_path))
    check(ended, tmp_path)  # its error file read: type, message, the last frames

    job = create_job(root, unique("boom"), machines=2)
    worker = f"/api/v1/worker/jobs/{job['id']}"
    for rank in range(2):
        registered = root.api(
            "POST",
            f"{worker}/machines",
            token=job["worker_token"],
            json={"instance_id": f"i-{rank}", "address": "127.0.0.1", "data_port": 9300 + rank},
        )
        assert registered.status_code == 200, registered.text
    ack = asyncio.run(report(root, job, ended))
    failure_id = ack.failure_id
    assert isinstance(failure_id, int)

    # The failure event: the exception in its cause, whole in its details.
    event = root.api("GET", f"/api/v1/jobs/{job['id']}/failures/{failure_id}").json()
    assert event["cause"] == "training process rank 1 exited with code 1: ValueError: boom 42"
    assert event["details"]["error"]["type"] == "ValueError"
    assert "in load_batch" in event["details"]["error"]["traceback"]

    # The failure page: the message and the traceback's last frames.
    with httpx.Client(base_url=root.url, timeout=10) as browser:
        login = browser.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
        assert login.status_code == 303, login.text
        page = browser.get(f"/jobs/{job['id']}/failures/{failure_id}")
    assert page.status_code == 200, page.text
    text = html.unescape(page.text)
    assert '<h3 id="exception">Exception</h3>' in text
    assert "ValueError: boom 42" in text
    assert 'raise ValueError("boom 42")' in text and "in load_batch" in text

    # The CLI.
    shown = castor(root, "failures", "show", job["name"], str(failure_id))
    assert shown.returncode == 0, shown.stderr
    assert "Exception: ValueError: boom 42" in shown.stdout
    assert 'raise ValueError("boom 42")' in shown.stdout
    assert "exited with code 1: ValueError: boom 42" in shown.stdout


def test_an_error_past_the_limits_is_refused_with_the_error_shape(root: Root) -> None:
    job = create_job(root, unique("boom-limits"), machines=2)
    worker = f"/api/v1/worker/jobs/{job['id']}"
    root.api(
        "POST",
        f"{worker}/machines",
        token=job["worker_token"],
        json={"instance_id": "i-0", "address": "127.0.0.1", "data_port": 9310},
    ).raise_for_status()
    response = root.api(
        "POST",
        f"{worker}/machines/0/exits",
        token=job["worker_token"],
        json={
            "instance_id": "i-0",
            "local_rank": 0,
            "global_rank": 0,
            "exit_code": 1,
            "error": {"message": "x" * 2001},
        },
    )
    assert response.status_code == 422, response.text
    assert set(response.json()["error"]) == {"code", "message", "details"}
