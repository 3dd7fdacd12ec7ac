"""The achieved replication interval and its lag, from the agents' heartbeats to the job's API resource,
its machines, its page and /metrics, with a "stalled" state once replication stops advancing (issue 11,
item 2)."""

from __future__ import annotations

import httpx

from services.root.domain.replication import job_replication
from tests.integration.conftest import ADMIN_TOKEN, admin
from tests.integration.web.scenario import Scenario, running_job
from tests.integration.web.test_metrics import scrape, value


async def heartbeat(job: Scenario, newest: int, replicated: int, interval: int) -> None:
    for rank, instance in enumerate(job.instances):
        # Machine 2 is the slowest: its interval is one iteration longer, its replicas one further behind.
        slow = 1 if rank == 2 else 0
        summary = {
            "local": {str(rank): newest},
            "committed": newest + 1,
            "replicated_iteration": replicated - slow,
            "replication_interval": interval + slow,
            "replication_lag_iterations": newest - replicated + slow,
            "replication_age_s": 1.5,
            "replication_rounds": 4,
        }
        await job.post(f"/machines/{rank}/heartbeat", {"instance_id": instance, "summary": summary}, 200)


async def test_the_replication_interval_reaches_the_api_the_page_and_metrics(
    client: httpx.AsyncClient,
) -> None:
    job = await running_job(client)
    name = str(job.job["name"])
    await heartbeat(job, newest=40, replicated=36, interval=4)

    resource = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()
    assert resource["replication_interval"] == 5, "the slowest machine's interval"
    assert resource["replication_lag"] == 5 and resource["replicated_iteration"] == 35
    assert resource["replication_state"] == "ok"
    machines = (await client.get(f"/api/v1/jobs/{job.id}/machines", headers=admin())).json()
    assert {m["rank"]: m["summary"]["replication_interval"] for m in machines} == {0: 4, 1: 4, 2: 5, 3: 4}

    samples = await scrape(client)
    assert value(samples, "castor_replication_interval_iterations", job=name) == 5
    assert value(samples, "castor_replication_lag_iterations", job=name) == 5
    assert value(samples, "castor_replication_stalled", job=name) == 0

    response = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    assert response.status_code == 303, response.text
    page = (await client.get(f"/jobs/{job.id}")).text
    assert "Replication interval" in page and "every 5 it." in page and "5 iterations behind" in page
    assert "stalled" not in page

    # Training goes on, replication does not: the interval stays, the lag grows past 4 intervals.
    await heartbeat(job, newest=80, replicated=36, interval=4)
    resource = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()
    assert resource["replication_state"] == "stalled" and resource["replication_lag"] == 45
    samples = await scrape(client)
    assert value(samples, "castor_replication_stalled", job=name) == 1
    page = (await client.get(f"/jobs/{job.id}")).text
    assert "stalled: 45 iterations behind" in page


def test_the_state_is_stalled_only_past_four_intervals_and_twenty_iterations() -> None:
    def state(interval: int | None, lag: int) -> str | None:
        summary = {
            "replication_interval": interval,
            "replication_lag_iterations": lag,
            "replicated_iteration": 1,
        }
        return job_replication([summary]).state

    assert state(10, 40) == "ok" and state(10, 41) == "stalled"
    assert state(1, 20) == "ok" and state(1, 21) == "stalled", "a fast link: 20 iterations at least"
    assert state(None, 20) == "ok", "the first round of a large checkpoint is not yet a stall"
    assert job_replication([{"replication_lag_iterations": None}]).state is None, "m = 1: nothing replicates"
