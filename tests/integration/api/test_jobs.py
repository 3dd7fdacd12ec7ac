"""Public job API on Postgres and SQLite: CRUD, paging, auth boundaries, error shapes."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from fastapi import FastAPI

from services.root.db import repository as repo
from tests.integration.conftest import admin, bearer, create_job
from tests.integration.web.scenario import Scenario


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


async def test_create_get_list_delete(client: httpx.AsyncClient) -> None:
    created = await create_job(client, name="gpt-small", machines=5, replicas=2, persist_every=50)
    assert created["state"] == "pending" and created["placement_strategy"] == "mixed"
    assert str(created["worker_token"]).startswith("castor-job.")

    fetched = (await client.get(f"/api/v1/jobs/{created['id']}", headers=admin())).json()
    assert fetched["name"] == "gpt-small" and fetched["persist_every"] == 50
    assert "worker_token" not in fetched, "the token is shown only once"

    placement = (await client.get(f"/api/v1/jobs/{created['id']}/placement", headers=admin())).json()
    assert [g["members"] for g in placement["groups"]] == [[0, 1], [2, 3, 4]]
    assert placement["ranks"][4] == {"rank": 4, "holders": [4, 2], "sends_to": [2]}
    assert set(placement["recovery_probability"]) == {"1", "2", "3", "4"}
    assert placement["recovery_probability"]["1"] == 1.0

    plans = (await client.get(f"/api/v1/jobs/{created['id']}/recovery-plans", headers=admin())).json()
    assert [(p["generation"], p["iteration"]) for p in plans] == [(1, None)], "a new job starts fresh"

    assert (await client.delete(f"/api/v1/jobs/{created['id']}", headers=admin())).status_code == 204
    assert_error(await client.get(f"/api/v1/jobs/{created['id']}", headers=admin()), 404, "job_not_found")
    assert_error(await client.delete(f"/api/v1/jobs/{created['id']}", headers=admin()), 404, "job_not_found")


async def test_paging_and_state_filter(client: httpx.AsyncClient) -> None:
    names = [f"page-{i:02d}" for i in range(7)]
    for name in names:
        await create_job(client, name=name, machines=2)
    first = (await client.get("/api/v1/jobs?limit=3", headers=admin())).json()
    second = (await client.get("/api/v1/jobs?limit=3&offset=3", headers=admin())).json()
    third = (await client.get("/api/v1/jobs?limit=3&offset=6", headers=admin())).json()
    assert first["total"] == 7 and len(first["items"]) == 3 and len(third["items"]) == 1
    seen = [j["name"] for page in (first, second, third) for j in page["items"]]
    assert sorted(seen) == names, "pages cover every job exactly once"
    assert seen == list(reversed(names)), "newest first"

    pending = (await client.get("/api/v1/jobs?state=pending", headers=admin())).json()
    running = (await client.get("/api/v1/jobs?state=running", headers=admin())).json()
    assert pending["total"] == 7 and running["total"] == 0
    assert_error(await client.get("/api/v1/jobs?state=sleeping", headers=admin()), 422, "validation_error")
    assert_error(await client.get("/api/v1/jobs?limit=0", headers=admin()), 422, "validation_error")


async def test_auth_boundaries(client: httpx.AsyncClient) -> None:
    job = await create_job(client)
    other = await create_job(client)
    assert_error(await client.get("/api/v1/jobs"), 401, "unauthorized")
    assert_error(await client.get("/api/v1/jobs", headers=bearer("nope")), 401, "unauthorized")
    forged = f"castor-job.{uuid.UUID(str(job['id'])).hex}.not-the-secret"
    assert_error(await client.get("/api/v1/jobs", headers=bearer(forged)), 401, "unauthorized")
    # A worker token is not an admin token.
    assert_error(
        await client.get(f"/api/v1/jobs/{job['id']}", headers=bearer(str(job["worker_token"]))),
        403,
        "forbidden",
    )
    # A job's token cannot act on another job.
    register = {"instance_id": "i-1", "address": "127.0.0.1", "data_port": 7000}
    response = await client.post(
        f"/api/v1/worker/jobs/{other['id']}/machines", json=register, headers=bearer(str(job["worker_token"]))
    )
    assert_error(response, 403, "forbidden")
    plan = await client.get(
        f"/api/v1/worker/jobs/{other['id']}/recovery-plan", headers=bearer(str(job["worker_token"]))
    )
    assert_error(plan, 403, "forbidden")
    assert (await client.get("/api/v1/jobs", headers=admin())).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "x", "machines": 0}, "machines"),
        ({"name": "x", "machines": 2, "replicas": 3}, "cannot exceed"),
        ({"name": "bad name!", "machines": 2}, "name"),
        ({"name": "x", "machines": "four"}, "machines"),
        ({"name": "x", "machines": 5, "placement": "group"}, "group placement"),
        ({"name": "x", "machines": 2, "surprise": 1}, "surprise"),
        ({"machines": 2}, "name"),
    ],
)
async def test_invalid_job_bodies_get_422_naming_the_problem(
    client: httpx.AsyncClient, body: dict[str, object], field: str
) -> None:
    error = assert_error(
        await client.post("/api/v1/jobs", json=body, headers=admin()), 422, "validation_error"
    )
    assert field in str(error["message"])


async def test_malformed_requests_never_500(client: httpx.AsyncClient) -> None:
    raw = await client.post(
        "/api/v1/jobs", content=b"{not json", headers={**admin(), "content-type": "application/json"}
    )
    assert_error(raw, 422, "validation_error")
    assert_error(await client.get("/api/v1/jobs/not-a-uuid", headers=admin()), 422, "validation_error")
    assert_error(await client.get("/api/v1/nothing-here", headers=admin()), 404, "not_found")
    assert_error(await client.put("/api/v1/jobs", headers=admin()), 405, "method_not_allowed")
    job = await create_job(client)
    assert_error(
        await client.get(f"/api/v1/jobs/{job['id']}/failures/99", headers=admin()), 404, "failure_not_found"
    )


async def test_duplicate_name_conflicts_and_keeps_the_first(client: httpx.AsyncClient) -> None:
    first = await create_job(client, name="twin", machines=4)
    response = await client.post("/api/v1/jobs", json={"name": "twin", "machines": 8}, headers=admin())
    assert_error(response, 409, "job_exists")
    kept = (await client.get(f"/api/v1/jobs/{first['id']}", headers=admin())).json()
    assert kept["machines"] == 4, "the existing job is untouched"


async def test_a_stop_while_the_leader_holds_the_job_row_publishes_a_newer_directive(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """A stop that read the job before a leader's step committed a new directive (its revision r + 1) used
    to write r + 1 again: agents that had seen r + 1 never heard "finished". It now reads the row under
    its lock."""
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    job = await create_job(client)
    job_id = uuid.UUID(str(job["id"]))
    async with database.session() as session:
        row = await repo.get_job(session, job_id, for_update=True)
        assert row is not None
        before = row.directive_revision
        stop = asyncio.create_task(client.post(f"/api/v1/jobs/{job_id}/stop", headers=admin()))
        await asyncio.sleep(0.3)  # the stop has read the job and waits for the row
        assert not stop.done()
        row.directive_revision += 1  # the leader's step: a new directive
    response = await stop
    assert response.status_code == 200 and response.json()["state"] == "stopped", response.text
    async with database.session() as session:
        row = await repo.get_job(session, job_id)
        assert row is not None and row.directive_revision == before + 2


async def test_stopping_a_job_in_recovery_closes_its_open_failures(client: httpx.AsyncClient) -> None:
    """Before, a stop left them open for ever: under way on the pages, and a replacement in flight went
    on for a stopped job."""
    scenario = Scenario(client, await create_job(client, machines=2, replicas=2))
    await scenario.register(["i-0", "i-1"])
    await scenario.heartbeat(5)
    failure_id = await scenario.kill_process(1)
    (event,) = await scenario.api("/failures")
    assert event["id"] == failure_id and event["state"] in ("detected", "recovering")
    response = await client.post(f"/api/v1/jobs/{scenario.id}/stop", headers=admin())
    assert response.status_code == 200 and response.json()["state"] == "stopped", response.text
    (event,) = await scenario.api("/failures")
    assert event["state"] == "unrecoverable"
    assert event["details"]["unrecoverable"] == "the job was stopped before this failure was recovered"
