"""Out-of-range numbers and NUL characters, on Postgres and SQLite: each is a 422 naming the field, never
a 500 from the database (Postgres refuses integers beyond its columns and NUL characters in text), and
nothing already saved changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register
from tests.integration.conftest import admin, bearer, create_job

HUGE = 10**20
BEYOND_INT32 = 2**31


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"persist_every": BEYOND_INT32}, "persist_every"),
        ({"persist_every": HUGE}, "persist_every"),
        ({"launch": {"command": ["python", "train\x00.py"]}}, "command"),
        ({"launch": {"command": ["python"], "env": {"A": "b\x00"}}}, "env"),
        # Names the processes could never start with (os.execve refuses them): before, a 201 and a job
        # pending for ever.
        ({"launch": {"command": ["python"], "env": {"A=B": "1"}}}, "env"),
        ({"launch": {"command": ["python"], "env": {"": "1"}}}, "env"),
    ],
)
async def test_job_fields_out_of_range(client: httpx.AsyncClient, fields: dict[str, Any], field: str) -> None:
    body = {"name": "bounded", "machines": 4, **fields}
    error = assert_error(
        await client.post("/api/v1/jobs", json=body, headers=admin()), 422, "validation_error"
    )
    assert field in error["message"]
    jobs = (await client.get("/api/v1/jobs", headers=admin())).json()
    assert jobs["total"] == 0


async def test_query_and_path_numbers_out_of_range(client: httpx.AsyncClient) -> None:
    job = await create_job(client)
    for path in (f"/api/v1/jobs?offset={HUGE}", f"/api/v1/jobs/{job['id']}/failures/{HUGE}"):
        error = assert_error(await client.get(path, headers=admin()), 422, "validation_error")
        assert "offset" in error["message"] or "failure_id" in error["message"]
    worker = bearer(str(job["worker_token"]))
    directive = await client.get(f"/api/v1/worker/jobs/{job['id']}/directive?after={HUGE}", headers=worker)
    assert_error(directive, 422, "validation_error")
    heartbeat = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/{HUGE}/heartbeat",
        json={"instance_id": "i-a"},
        headers=worker,
    )
    assert_error(heartbeat, 422, "validation_error")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("heartbeat", {"summary": {"committed": HUGE}}, "committed"),
        ("heartbeat", {"summary": {"local": {"0": HUGE}}}, "local"),
        # More ranks than a machine runs (or holds replicas of): before, a summary of 70,000 ranks was stored
        # and every heartbeat of the job decoded it.
        ("heartbeat", {"summary": {"local": {str(rank): 1 for rank in range(65)}}}, "local"),
        ("heartbeat", {"summary": {"stalled_s": {str(rank): 0.1 for rank in range(65)}}}, "stalled_s"),
        ("heartbeat", {"summary": {"replicas": {str(rank): 1 for rank in range(64 * 15 + 1)}}}, "replicas"),
        ("heartbeat", {"summary": {"per_minute": "Infinity"}}, "per_minute"),
        # Finite but absurd: an announced iteration beyond the database's columns, an infinite interval.
        ("heartbeat", {"summary": {"per_minute": 1e21}}, "per_minute"),
        ("heartbeat", {"summary": {"per_minute": 5e-324}}, "per_minute"),
        ("heartbeat", {"summary": {"replication_age_s": 1e300}}, "replication_age_s"),
        ("progress", {"generation": HUGE, "event": "resumed"}, "generation"),
        ("progress", {"generation": 1, "event": "resumed", "iteration": HUGE}, "iteration"),
        ("exits", {"local_rank": 0, "global_rank": HUGE, "exit_code": 1}, "global_rank"),
        ("exits", {"local_rank": 0, "global_rank": 0, "exit_code": HUGE}, "exit_code"),
        (
            "persisted",
            {"rank": 0, "iteration": HUGE, "key": "k", "location": "l", "digest": "d", "nbytes": 1},
            "iteration",
        ),
        (
            "persisted",
            {"rank": 0, "iteration": 1, "key": "k\x00", "location": "l", "digest": "d", "nbytes": 1},
            "key",
        ),
    ],
)
async def test_worker_reports_out_of_range(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    job = await create_job(client, machines=2)
    assert (await register(client, job, "i-a")).status_code == 200
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/0/{path}",
        json={"instance_id": "i-a", **body},
        headers=bearer(str(job["worker_token"])),
    )
    error = assert_error(response, 422, "validation_error")
    assert field in error["message"]


async def test_registration_refuses_nul_characters(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2)
    error = assert_error(await register(client, job, "i-\x00"), 422, "validation_error")
    assert "instance_id" in error["message"] and "NUL" in error["message"]
    machines = (await client.get(f"/api/v1/jobs/{job['id']}/machines", headers=admin())).json()
    assert machines == []


@pytest.mark.parametrize("instance", ["/tmp/x", "../../escaped", ".hidden", "a b", "i-1/2", "a\\b", "héte"])
async def test_registration_refuses_instance_ids_that_could_name_a_path(
    client: httpx.AsyncClient, instance: str
) -> None:
    """The local operator names log files and shared-memory directories after instance ids."""
    job = await create_job(client, machines=2)
    error = assert_error(await register(client, job, instance), 422, "validation_error")
    assert "instance_id" in error["message"] and "printable ASCII" in error["message"]
    ids = ("i-0abc123def4567890", "ip-10-0-0-1.ec2.internal", "local-1a2b3c4d-m0~2", "::1", "fe80::1%eth0")
    job = await create_job(client, machines=len(ids))
    for accepted in ids:
        assert (await register(client, job, accepted)).status_code == 200


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("gone", "launch_cwd_missing"),
        # A name the filesystem cannot look up (ENAMETOOLONG from the stat: before, a 500).
        ("gone" + "x" * 300, "launch_cwd_missing"),
        # Longer than any path (PATH_MAX): refused by the schema.
        ("gone/" * 1000, "validation_error"),
    ],
    ids=["missing", "name-too-long", "path-too-long"],
)
async def test_a_launch_directory_that_does_not_exist_is_refused(
    client: httpx.AsyncClient, tmp_path: Path, name: str, code: str
) -> None:
    body = {
        "name": "nowhere",
        "machines": 2,
        "launch": {"command": ["python"], "cwd": str(tmp_path / name)},
    }
    error = assert_error(await client.post("/api/v1/jobs", json=body, headers=admin()), 422, code)
    assert "gone" in error["message"] or "cwd" in error["message"]
    assert (await client.get("/api/v1/jobs", headers=admin())).json()["total"] == 0
