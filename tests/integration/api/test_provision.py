"""A job whose machines the local operator cannot start fails at once, with the reason on a failure event,
and the machines that did start are stopped: before, it waited in pending for machines that never came."""

from __future__ import annotations

import errno
import subprocess
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.root.clients import local
from tests.integration.conftest import admin


async def test_a_job_whose_machines_cannot_be_started_fails_and_stops_those_that_started(
    root_app: FastAPI, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    operator = root_app.state.castor.operator
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if started:  # the second machine: the host is out of processes
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        process = real_popen(["sleep", "600"], start_new_session=True)  # the first one starts for real
        started.append(process)
        return process

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    body = {"name": "unstartable", "machines": 2, "launch": {"command": ["python", "train.py"]}}
    response = await client.post("/api/v1/jobs", json=body, headers=admin())
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    # The ASGI client returns after the response's background task (the provisioning) has run.
    job = (await client.get(f"/api/v1/jobs/{job_id}", headers=admin())).json()
    assert job["state"] == "failed" and job["finished_at"] is not None
    failures = (await client.get(f"/api/v1/jobs/{job_id}/failures", headers=admin())).json()
    assert len(failures) == 1
    assert failures[0]["state"] == "unrecoverable"
    assert "could not start the job's machines" in failures[0]["cause"]
    assert "Resource temporarily unavailable" in failures[0]["cause"]
    # The machine that had started is stopped, not left running for a job that has failed.
    assert started[0].wait(timeout=30) is not None
    assert not [i for i in operator._processes if i.startswith(f"local-{job_id.replace('-', '')[:8]}")]
    # A stop of the failed job is refused as for any finished job.
    stop = await client.post(f"/api/v1/jobs/{job_id}/stop", headers=admin())
    assert stop.status_code == 409, stop.text
