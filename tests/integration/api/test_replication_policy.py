"""A job's replication policy (interleaved or eager) and optional bandwidth cap: stored with the job, shown
in its JSON, handed to every machine at registration; bad values are a 422 in the one error shape."""

from __future__ import annotations

import httpx

from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register
from tests.integration.conftest import admin, create_job


async def test_the_policy_goes_from_the_job_to_every_machine(client: httpx.AsyncClient) -> None:
    job = await create_job(
        client, machines=2, replicas=2, replication_policy="eager", replication_bandwidth_gbps=0.5
    )
    assert (job["replication_policy"], job["replication_bandwidth_gbps"]) == ("eager", 0.5)
    listed = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert (listed["replication_policy"], listed["replication_bandwidth_gbps"]) == ("eager", 0.5)
    registration = (await register(client, job, "i-a")).json()
    assert (registration["replication_policy"], registration["replication_bandwidth_gbps"]) == ("eager", 0.5)


async def test_interleaved_without_a_cap_is_the_default(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2, replicas=2)
    assert (job["replication_policy"], job["replication_bandwidth_gbps"]) == ("interleaved", None)
    registration = (await register(client, job, "i-a")).json()
    assert registration["replication_policy"] == "interleaved"


async def test_bad_policies_are_refused(client: httpx.AsyncClient) -> None:
    for extra in ({"replication_policy": "lazy"}, {"replication_bandwidth_gbps": 0}):
        body = {"name": "bad-policy", "machines": 2, **extra}
        response = await client.post("/api/v1/jobs", json=body, headers=admin())
        assert_error(response, 422, "validation_error")
