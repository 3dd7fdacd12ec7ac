"""Hostile input on Postgres and SQLite (issue 10, item 6): free-form JSON bounded in depth, size and
values; a request body limit; malformed bodies in the one error shape; bounded /metrics labels; 405 with
Allow and HEAD on GET routes; strict numbers and booleans; limits on machines per job and on what the
local operator launches, their expensive work off the event loop; control characters escaped in logs."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.root.db.models import FailureEvent, Job
from services.root.flows import jobs as job_flows
from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register, registration
from tests.integration.conftest import ADMIN_TOKEN, admin, bearer, create_job

JSON = {"content-type": "application/json"}


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


async def registered(client: httpx.AsyncClient, **fields: object) -> dict[str, Any]:
    job = await create_job(client, machines=2, **fields)
    assert (await register(client, job, "i-a")).status_code == 200
    return job


async def progress(client: httpx.AsyncClient, job: dict[str, Any], raw_details: str) -> httpx.Response:
    """A progress report whose `details` is the raw JSON text given (NaN and lone surrogates cannot be
    written by json.dumps)."""
    body = (
        '{"instance_id": "i-a", "generation": 1, "event": "restore_failed", "details": ' + raw_details + "}"
    )
    return await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/0/progress",
        content=body.encode("utf-8", "surrogatepass"),
        headers={**bearer(str(job["worker_token"])), **JSON},
    )


# -- free-form JSON ---------------------------------------------------------------------------------------


async def test_deep_details_are_refused_and_failures_stay_readable(client: httpx.AsyncClient) -> None:
    job = await registered(client)
    for depth in (9, 300):
        error = assert_error(await progress(client, job, json.dumps(nested(depth))), 422, "validation_error")
        assert "details" in str(error["message"]) and "deep" in str(error["message"])
    assert (await client.get(f"/api/v1/jobs/{job['id']}/failures", headers=admin())).status_code == 200
    # Eight levels, the limit, are fine (and so is an ordinary restore error).
    assert (
        await progress(client, job, json.dumps({"error": "peer gone", "x": nested(7)}))
    ).status_code == 204
    failures = (await client.get(f"/api/v1/jobs/{job['id']}/failures", headers=admin())).json()
    assert failures and failures[0]["details"]["error"] == "peer gone"


@pytest.mark.parametrize(
    "raw",
    [
        '{"x": NaN}',
        '{"x": Infinity}',
        '{"x": -Infinity}',
        '{"x": 1e400}',
        f'{{"x": [{2**63}]}}',
        f'{{"x": {-(2**63) - 1}}}',
        '{"x": "a\\u0000b"}',
        '{"x\\u0000": 1}',
        '{"x": "\\ud800"}',
        '{"\\udfff": 1}',
        '{"x": "' + "y" * 17_000 + '"}',
    ],
)
async def test_details_must_be_valid_json_for_every_database(client: httpx.AsyncClient, raw: str) -> None:
    job = await registered(client)
    error = assert_error(await progress(client, job, raw), 422, "validation_error")
    assert "details" in str(error["message"])
    failures = (await client.get(f"/api/v1/jobs/{job['id']}/failures", headers=admin())).json()
    assert failures == []


async def test_lone_surrogates_in_text_fields_are_refused(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2)
    body = json.dumps(registration("i-a")).replace('"i-a"', '"i-\\ud800"')
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines",
        content=body,
        headers={**bearer(str(job["worker_token"])), **JSON},
    )
    error = assert_error(response, 422, "validation_error")
    assert "instance_id" in str(error["message"])
    # A surrogate in an object key lands in the error's field name: still answered.
    heartbeat = '{"instance_id": "i-a", "summary": {"local": {"\\ud800": 1}}}'
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/0/heartbeat",
        content=heartbeat,
        headers={**bearer(str(job["worker_token"])), **JSON},
    )
    assert_error(response, 422, "validation_error")


async def test_details_stored_before_the_limits_still_read(
    root_app: FastAPI, client: httpx.AsyncClient
) -> None:
    """Rows written before the limits (300 levels deep, NaN on SQLite, a checkpoint frequency whose interval
    is infinite) never make a read fail."""
    job = await create_job(client, machines=2)
    bad: dict[str, Any] = {"deep": nested(300)}
    async with root_app.state.castor.database.session() as session:
        event = FailureEvent(job_id=uuid.UUID(str(job["id"])), rank=0, cause="old", details=bad)
        session.add(event)
        row = await session.get(Job, uuid.UUID(str(job["id"])))
        assert row is not None
        row.checkpoints_per_minute = 5e-324  # 60 / 5e-324 is infinite
        row.started_at = datetime.now(UTC) - timedelta(hours=1)
        await session.flush()
        failure_id = event.id
    fetched = await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())
    assert fetched.status_code == 200, fetched.text
    listed = await client.get(f"/api/v1/jobs/{job['id']}/failures", headers=admin())
    assert listed.status_code == 200, listed.text
    one = await client.get(f"/api/v1/jobs/{job['id']}/failures/{failure_id}", headers=admin())
    assert one.status_code == 200 and "deep" in one.json()["details"]
    await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    for page in (f"/jobs/{job['id']}", f"/jobs/{job['id']}/failures/{failure_id}"):
        assert (await client.get(page)).status_code == 200, page


# -- bodies -----------------------------------------------------------------------------------------------


async def test_request_bodies_over_the_limit_get_413(client: httpx.AsyncClient) -> None:
    big = json.dumps({"name": "big", "machines": 2, "launch": {"command": ["x" * (1024 * 1024)]}})
    error = assert_error(
        await client.post("/api/v1/jobs", content=big, headers={**admin(), **JSON}), 413, "payload_too_large"
    )
    assert "CASTOR_MAX_BODY_BYTES" in str(error["message"])

    async def chunked() -> Any:  # no Content-Length: counted as it is read
        for _ in range(20):
            yield b" " * 65536
        yield b"{}"

    response = await client.post("/api/v1/jobs", content=chunked(), headers={**admin(), **JSON})
    assert_error(response, 413, "payload_too_large")
    assert (await client.get("/api/v1/jobs", headers=admin())).json()["total"] == 0


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b'{"name": "caf\xe9", "machines": 2}', "UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "deep"),
        # Past Python's 4300-digit limit for integers (before: said "not UTF-8 text").
        (b'{"name": "big", "machines": ' + b"1" * 5000 + b"}", "too many digits"),
    ],
)
async def test_undecodable_bodies_get_422(client: httpx.AsyncClient, body: bytes, problem: str) -> None:
    error = assert_error(
        await client.post("/api/v1/jobs", content=body, headers={**admin(), **JSON}), 422, "validation_error"
    )
    assert problem in str(error["message"])


# -- strict types -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"machines": True, "replicas": 1}, "machines"),
        ({"machines": "4"}, "machines"),
        ({"machines": 4.0}, "machines"),
        ({"replicas": True}, "replicas"),
        ({"procs_per_machine": "1"}, "procs_per_machine"),
        ({"persist_every": False}, "persist_every"),
        ({"keep_persisted": "3"}, "keep_persisted"),
        ({"replication_bandwidth_gbps": True}, "replication_bandwidth_gbps"),
        ({"replication_bandwidth_gbps": "1.5"}, "replication_bandwidth_gbps"),
    ],
)
async def test_job_numbers_are_strict(client: httpx.AsyncClient, fields: dict[str, Any], field: str) -> None:
    body = {"name": "strict", "machines": 4, **fields}
    error = assert_error(
        await client.post("/api/v1/jobs", json=body, headers=admin()), 422, "validation_error"
    )
    assert field in str(error["message"])
    assert (await client.get("/api/v1/jobs", headers=admin())).json()["total"] == 0


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("machines", registration("i-b", port="7001"), "data_port"),  # type: ignore[arg-type]
        ("machines", registration("i-b", embedded="true"), "embedded"),
        ("machines", registration("i-b", embedded=1), "embedded"),
        ("machines", registration("i-b", rank=True), "rank"),
        ("machines/0/heartbeat", {"instance_id": "i-a", "summary": {"committed": True}}, "committed"),
        ("machines/0/heartbeat", {"instance_id": "i-a", "summary": {"local": {"0": "5"}}}, "local"),
        (
            "machines/0/exits",
            {"instance_id": "i-a", "local_rank": 0, "global_rank": 0, "exit_code": "1"},
            "exit_code",
        ),
        (
            "machines/0/exits",
            {"instance_id": "i-a", "local_rank": False, "global_rank": 0, "exit_code": 1},
            "local_rank",
        ),
        ("machines/0/progress", {"instance_id": "i-a", "generation": True, "event": "resumed"}, "generation"),
        (
            "machines/0/inventory",
            {
                "instance_id": "i-a",
                "generation": 1,
                "holdings": [
                    {
                        "rank": 0,
                        "iteration": 1,
                        "tier": "local",
                        "digest": "d",
                        "data_bytes": 1,
                        "verified": 1,
                    }
                ],
            },
            "verified",
        ),
    ],
)
async def test_worker_numbers_and_booleans_are_strict(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    job = await registered(client)
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/{path}", json=body, headers=bearer(str(job["worker_token"]))
    )
    error = assert_error(response, 422, "validation_error")
    assert field in str(error["message"])


async def test_summary_keys_are_still_ranks_as_strings(client: httpx.AsyncClient) -> None:
    job = await registered(client)
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/0/heartbeat",
        json={"instance_id": "i-a", "summary": {"local": {"0": 5}, "per_minute": 3}},
        headers=bearer(str(job["worker_token"])),
    )
    assert response.status_code == 200, response.text


# -- methods ----------------------------------------------------------------------------------------------


async def test_405_names_every_allowed_method(client: httpx.AsyncClient) -> None:
    job = await create_job(client)
    cases = {
        f"/api/v1/jobs/{job['id']}": ("PUT", {"GET", "HEAD", "DELETE"}),
        "/api/v1/jobs": ("PATCH", {"GET", "HEAD", "POST"}),
        "/healthz": ("POST", {"GET", "HEAD"}),
        f"/api/v1/worker/jobs/{job['id']}/machines": ("GET", {"POST"}),
    }
    for path, (method, allowed) in cases.items():
        response = await client.request(method, path, headers=admin())
        assert_error(response, 405, "method_not_allowed")
        assert set(response.headers["allow"].split(", ")) == allowed, path


async def test_head_answers_every_get_route(root_app: FastAPI, client: httpx.AsyncClient) -> None:
    job = await registered(client)
    values = {"job_id": str(job["id"]), "failure_id": "1", "name": "castor.css"}
    paths = [path for path, operations in root_app.openapi()["paths"].items() if "get" in operations]
    paths += [
        "/",
        "/login",
        "/jobs/{job_id}",
        "/jobs/{job_id}/failures/{failure_id}",
        "/static/{name}",
        "/metrics",
    ]
    await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    worker_paths = {p for p in paths if p.startswith("/api/v1/worker")}
    for template in paths:
        path = re.sub(r"\{(\w+)\}", lambda m: values[m[1]], template)
        headers = bearer(str(job["worker_token"])) if template in worker_paths else admin()
        got = await client.get(path, headers=headers)
        head = await client.head(path, headers=headers)
        assert head.status_code == got.status_code != 405, (template, head.status_code, got.status_code)
        assert head.content == b"", template
        assert head.headers.get("content-type") == got.headers.get("content-type"), template


# -- /metrics ---------------------------------------------------------------------------------------------


def latency_series(text: str) -> set[str]:
    return {
        line.split(" ")[0]
        for line in text.splitlines()
        if line.startswith("castor_http_request_duration_seconds_count")
    }


async def test_invented_methods_and_paths_do_not_grow_metrics(client: httpx.AsyncClient) -> None:
    await client.request("BREW", "/api/v1/jobs")
    await client.request("BREW", "/nowhere")
    await client.get(f"/nothing-{uuid.uuid4().hex}")
    before = latency_series((await client.get("/metrics")).text)
    for index in range(50):
        await client.request(f"INVENTED{index}", "/api/v1/jobs")
        await client.request(f"X{index}", f"/nowhere/{index}")
        await client.get(f"/nothing-{uuid.uuid4().hex}")
    after = latency_series((await client.get("/metrics")).text)
    assert after == before
    assert not any("INVENTED" in series or "BREW" in series or "nothing-" in series for series in after)
    assert any('method="other"' in series and 'route="/api/v1/jobs"' in series for series in after)
    assert any('route="unmatched"' in series for series in after)


# -- limits -----------------------------------------------------------------------------------------------


async def test_machines_per_job_are_limited(root_app: FastAPI, client: httpx.AsyncClient) -> None:
    limit = root_app.state.castor.settings.max_machines_per_job
    body = {"name": "huge", "machines": limit + 1}
    error = assert_error(
        await client.post("/api/v1/jobs", json=body, headers=admin()), 422, "validation_error"
    )
    assert "machines" in str(error["message"]) and "CASTOR_MAX_MACHINES_PER_JOB" in str(error["message"])
    assert (await client.get("/api/v1/jobs", headers=admin())).json()["total"] == 0


async def test_the_local_operator_launches_a_bounded_number_of_machines(
    root_app: FastAPI, client: httpx.AsyncClient
) -> None:
    limit = root_app.state.castor.settings.local_max_machines
    body = {"name": "many", "machines": limit + 1, "launch": {"command": ["true"]}}
    error = assert_error(
        await client.post("/api/v1/jobs", json=body, headers=admin()), 422, "launch_too_large"
    )
    assert "CASTOR_LOCAL_MAX_MACHINES" in str(error["message"])
    assert (await client.get("/api/v1/jobs", headers=admin())).json()["total"] == 0
    # Without a launch spec the same job is fine: its machines are started elsewhere.
    await create_job(client, name="many", machines=limit + 1)


async def test_placement_work_runs_off_the_event_loop(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: list[bool] = []

    def running_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    plan, out = job_flows.plan_placement, job_flows.placement_out

    def plan_spy(*args: Any) -> Any:
        on_loop.append(running_loop())
        return plan(*args)

    def out_spy(*args: Any) -> Any:
        on_loop.append(running_loop())
        return out(*args)

    monkeypatch.setattr(job_flows, "plan_placement", plan_spy)
    monkeypatch.setattr(job_flows, "placement_out", out_spy)
    job = await create_job(client, machines=512, replicas=3)
    placement = await client.get(f"/api/v1/jobs/{job['id']}/placement", headers=admin())
    assert placement.status_code == 200 and len(placement.json()["ranks"]) == 512
    assert on_loop == [False, False]


# -- logs -------------------------------------------------------------------------------------------------


async def test_control_characters_from_agents_are_escaped_in_log_lines(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Agents' text (here a host name with a newline and a terminal escape, which registration accepts;
    an instance id no longer may hold either) reaches log lines at many call sites (the operators'
    replacement lines, causes in recovery lines): every record of the service's loggers is escaped, whether
    formatted with arguments or not."""
    caplog.set_level(logging.INFO, logger="services")
    job = await create_job(client, machines=2)
    text = "i-a\nCRITICAL forged line \x1b[2J"
    assert (await register(client, job, text)).status_code == 422
    assert (await register(client, job, "i-a", hostname=text)).status_code == 200
    machines = (await client.get(f"/api/v1/jobs/{job['id']}/machines", headers=admin())).json()
    stored = machines[0]["hostname"]
    assert stored == text
    logging.getLogger("services.root.orchestration").info("replacing machine %d: %s", 0, f"started {stored}")
    logging.getLogger("services.root.clients.local").info(f"started local machine {stored}")
    logging.getLogger("services.root.flows.recovery").error(
        "job %(job)s: %(why)s", {"job": "j", "why": stored}
    )
    lines = [caplog.handler.format(r) for r in caplog.records if "forged" in r.getMessage()]
    assert len(lines) == 3
    for line in lines:
        assert "\n" not in line and "\x1b" not in line, line
        assert "i-a\\x0aCRITICAL forged line \\x1b[2J" in line, line
