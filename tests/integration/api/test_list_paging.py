"""Paging of the job's list endpoints (machines, failures, recovery plans, checkpoints) on Postgres and
SQLite: the X-Total-Count and Link rel="next" headers, the defaults and bounds of `limit`, pages that cover
every item once in a stable order while new rows arrive, 422 in the one error shape for bad values; the
CLI's client following the pages; the job page listing only the newest of a long history."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.root.db.models import (
    FailureEvent,
    PersistedCheckpoint,
    PersistedShard,
    RecoveryPlan,
)
from tests.integration.api.test_jobs import assert_error
from tests.integration.conftest import ADMIN_TOKEN, admin, bearer, create_job
from worker_lib.api.public import FailureOut, MachineOut
from worker_lib.client import RootClient, next_params

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def register(client: httpx.AsyncClient, job: dict[str, Any], count: int) -> None:
    for i in range(count):
        body = {"instance_id": f"i-{i}", "address": "127.0.0.1", "data_port": 7000 + i}
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines", json=body, headers=bearer(str(job["worker_token"]))
        )
        assert response.status_code in (200, 201), response.text


async def add_failures(app: FastAPI, job_id: str, minutes: list[int]) -> list[int]:
    """Failures detected `minutes` after T0 (in this order of ids); their ids."""
    async with app.state.castor.database.session() as session:
        events = [
            FailureEvent(
                job_id=uuid.UUID(job_id),
                rank=0,
                kind="software",
                state="recovered",
                cause=f"failure at +{m} min",
                detected_at=T0 + timedelta(minutes=m),
                details={},
            )
            for m in minutes
        ]
        session.add_all(events)
        await session.flush()
        return [e.id for e in events]


async def pages(client: httpx.AsyncClient, url: str) -> tuple[list[list[Any]], list[int]]:
    """Every page of a list, following its Link rel="next"; the pages and each one's X-Total-Count."""
    found, totals = [], []
    for _ in range(50):
        response = await client.get(url, headers=admin())
        assert response.status_code == 200, response.text
        assert isinstance(response.json(), list), "a list endpoint still answers a JSON list"
        found.append(response.json())
        totals.append(int(response.headers["X-Total-Count"]))
        following = next_params(response.headers.get("Link"))
        if following is None:
            return found, totals
        assert response.headers["Link"].endswith('>; rel="next"')
        url = str(httpx.URL(url.split("?")[0], params=following))
    raise AssertionError("the next links never ended")


async def test_machines_page_by_rank(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=5)
    await register(client, job, 5)
    url = f"/api/v1/jobs/{job['id']}/machines"

    whole = await client.get(url, headers=admin())
    assert [m["rank"] for m in whole.json()] == [0, 1, 2, 3, 4], "the default page holds a whole job"
    assert whole.headers["X-Total-Count"] == "5" and "Link" not in whole.headers

    found, totals = await pages(client, f"{url}?limit=2")
    assert [len(p) for p in found] == [2, 2, 1] and totals == [5, 5, 5]
    assert [m["rank"] for page in found for m in page] == [0, 1, 2, 3, 4]
    first = await client.get(f"{url}?limit=2&history=true", headers=admin())
    assert "history=true" in first.headers["Link"] and "offset=2" in first.headers["Link"]
    last = await client.get(f"{url}?limit=2&offset=4", headers=admin())
    assert [m["rank"] for m in last.json()] == [4] and "Link" not in last.headers
    beyond = await client.get(f"{url}?offset=9", headers=admin())
    assert beyond.json() == [] and beyond.headers["X-Total-Count"] == "5"

    for bad in ("limit=0", "limit=1001", "limit=x", "offset=-1", "offset=2147483648"):
        error = assert_error(await client.get(f"{url}?{bad}", headers=admin()), 422, "validation_error")
        assert error["details"]["errors"][0]["field"] == f"query.{bad.split('=')[0]}"


async def test_failures_page_newest_first_and_stable_while_new_ones_arrive(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await create_job(client, machines=2)
    # Ids in an order other than detection's; two detected at the same time (the id breaks the tie).
    ids = await add_failures(root_app, str(job["id"]), [5, 1, 7, 3, 3, 9, 2])
    newest_first = [i for _, i in sorted(zip([5, 1, 7, 3, 3, 9, 2], ids, strict=True), reverse=True)]
    url = f"/api/v1/jobs/{job['id']}/failures"

    first = await client.get(f"{url}?limit=3", headers=admin())
    assert [f["id"] for f in first.json()] == newest_first[:3]
    assert first.headers["X-Total-Count"] == "7"
    assert f"before_id={newest_first[2]}" in first.headers["Link"]
    # A failure recorded between two pages comes first on a new first page, and shifts nothing.
    [newer] = await add_failures(root_app, str(job["id"]), [60])
    rest, totals = await pages(client, f"{url}?{httpx.URL(first.headers['Link'][1:-13]).query.decode()}")
    assert [f["id"] for f in first.json() + [f for page in rest for f in page]] == newest_first
    assert totals[0] == 8, "the total counts the new one"
    again = (await client.get(f"{url}?limit=1", headers=admin())).json()
    assert [f["id"] for f in again] == [newer]

    # Numbers within the job follow the ids, whatever the page.
    every = (await client.get(url, headers=admin())).json()
    assert {f["id"]: f["number"] for f in every} == {i: n for n, i in enumerate([*ids, newer], start=1)}
    assert len(every) == 8

    unknown = assert_error(
        await client.get(f"{url}?before_id=999999", headers=admin()), 422, "validation_error"
    )
    assert unknown["details"]["errors"][0]["field"] == "query.before_id"
    other = await create_job(client, machines=2)
    [foreign] = await add_failures(root_app, str(other["id"]), [1])
    assert_error(await client.get(f"{url}?before_id={foreign}", headers=admin()), 422, "validation_error")
    for bad in ("limit=0", "limit=501", "before_id=0", "before_id=x"):
        assert_error(await client.get(f"{url}?{bad}", headers=admin()), 422, "validation_error")


async def test_plans_and_checkpoints_page_newest_first(client: httpx.AsyncClient, root_app: FastAPI) -> None:
    job = await create_job(client, machines=2, procs_per_machine=1)
    job_id = uuid.UUID(str(job["id"]))
    async with root_app.state.castor.database.session() as session:
        for generation in range(2, 7):
            session.add(
                RecoveryPlan(job_id=job_id, generation=generation, iteration=generation * 10, sources=[])
            )
        for iteration in (10, 30, 20):
            checkpoint = PersistedCheckpoint(
                job_id=job_id, iteration=iteration, location=f"file:///c/{iteration}"
            )
            session.add(checkpoint)
            await session.flush()
            for rank in range(2 if iteration != 20 else 1):
                session.add(
                    PersistedShard(
                        checkpoint_id=checkpoint.id, rank=rank, key=f"k{rank}", digest="d" * 64, nbytes=5
                    )
                )

    found, totals = await pages(client, f"/api/v1/jobs/{job_id}/recovery-plans?limit=2")
    assert [p["generation"] for page in found for p in page] == [6, 5, 4, 3, 2, 1] and set(totals) == {6}
    assert [len(p) for p in found] == [2, 2, 2]
    whole = await client.get(f"/api/v1/jobs/{job_id}/recovery-plans", headers=admin())
    assert len(whole.json()) == 6 and "Link" not in whole.headers

    found, totals = await pages(client, f"/api/v1/jobs/{job_id}/checkpoints?limit=2")
    assert [(c["iteration"], c["complete"]) for page in found for c in page] == [
        (30, True),
        (20, False),
        (10, True),
    ]
    assert totals == [3, 3] and [len(c["shards"]) for c in found[0]] == [2, 1]

    for path in ("recovery-plans?before_generation=0", "recovery-plans?limit=501", "checkpoints?limit=0"):
        assert_error(
            await client.get(f"/api/v1/jobs/{job_id}/{path}", headers=admin()), 422, "validation_error"
        )
    assert_error(
        await client.get(f"/api/v1/jobs/{job_id}/checkpoints?before_iteration=-1", headers=admin()),
        422,
        "validation_error",
    )


async def test_the_client_follows_the_pages(client: httpx.AsyncClient, root_app: FastAPI) -> None:
    job = await create_job(client, machines=3)
    await register(client, job, 3)
    ids = await add_failures(root_app, str(job["id"]), [1, 2, 3, 4, 5])
    api = RootClient("http://castor.test", "", ADMIN_TOKEN, transport=httpx.ASGITransport(app=root_app))
    try:
        path = f"/jobs/{job['id']}"
        every = await api._list(FailureOut, f"{path}/failures", {"limit": 2})
        assert [f.id for f in every] == list(reversed(ids)), "three pages of two, in order, each once"
        machines = await api._list(MachineOut, f"{path}/machines", {"limit": 1})
        assert [m.rank for m in machines] == [0, 1, 2]
        page = await api.failures_page(str(job["id"]), limit=2)
        assert page.total == 5 and page.next == {"limit": "2", "before_id": str(ids[3])}
        assert [m.rank for m in await api.machines(str(job["id"]))] == [0, 1, 2]
        assert len(await api.failures(str(job["id"]))) == 5
    finally:
        await api.close()


def test_next_params_reads_the_next_relation_only() -> None:
    assert next_params(None) is None and next_params("") is None
    assert next_params('</a?limit=2&offset=2>; rel="prev"') is None
    link = '</x?limit=2&offset=0>; rel="prev", </api/v1/jobs/j/machines?limit=2&offset=4&history=true>; '
    link += 'rel="next"'
    assert next_params(link) == {"limit": "2", "offset": "4", "history": "true"}


@pytest.mark.parametrize("endpoint", ["machines", "failures", "recovery-plans", "checkpoints"])
async def test_every_list_documents_its_paging(root_app: FastAPI, endpoint: str) -> None:
    operation = root_app.openapi()["paths"][f"/api/v1/jobs/{{job_id}}/{endpoint}"]["get"]
    names = {p["name"] for p in operation["parameters"]}
    assert "limit" in names and names & {"offset", "before_id", "before_generation", "before_iteration"}
    assert {"X-Total-Count", "Link"} <= set(operation["responses"]["200"]["headers"])
