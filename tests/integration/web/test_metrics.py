"""/metrics: Prometheus text that parses, counts what the database holds, times the API by route
template, and gives away no secret."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import ADMIN_TOKEN
from tests.integration.web.scenario import running_job

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")  # no token: metrics are unauthenticated
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_metrics_parse_and_count_what_the_database_holds(client: httpx.AsyncClient) -> None:
    job = await running_job(client)
    samples = await scrape(client)
    assert value(samples, "castor_jobs", state="running") == 1
    assert value(samples, "castor_machines", state="healthy") == 4
    name = str(job.job["name"])
    assert value(samples, "castor_job_newest_iteration", job=name) == 20
    assert value(samples, "castor_checkpoints_committed_total", job=name, machine="2") == 21
    assert value(samples, "castor_checkpoints_replicated_total", job=name, machine="2") == 20
    assert value(samples, "castor_replication_lag_seconds", job=name) == 0.08, "the worst machine's lag"
    assert value(samples, "castor_database_up") == 1 and value(samples, "castor_leader") == 1


async def test_failure_counter_rises_after_a_failure_and_recoveries_fill_the_histograms(
    client: httpx.AsyncClient,
) -> None:
    job = await running_job(client)
    await job.heartbeat(23)
    before = await scrape(client)
    await job.kill_process(2)
    after = await scrape(client)
    assert (
        value(after, "castor_failures_total", kind="software")
        == value(before, "castor_failures_total", kind="software") + 1
    )
    assert value(after, "castor_failures_total", kind="hardware") == value(
        before, "castor_failures_total", kind="hardware"
    )

    await job.recover(23)
    recovered = await scrape(client)
    for phase in ("detect", "classify", "restore", "resume"):
        assert (
            value(recovered, "castor_recovery_phase_seconds_count", phase=phase)
            == value(before, "castor_recovery_phase_seconds_count", phase=phase) + 1
        ), phase
    assert value(recovered, "castor_recovery_phase_seconds_count", phase="replace") == value(
        before, "castor_recovery_phase_seconds_count", phase="replace"
    ), "software failures have no replace phase"
    assert (
        value(recovered, "castor_recoveries_total", tier="local")
        == value(before, "castor_recoveries_total", tier="local") + 1
    )
    count = value(recovered, "castor_recovery_seconds_count", kind="software")
    assert (
        count >= 1 and value(recovered, "castor_recovery_seconds_bucket", kind="software", le="+Inf") == count
    )


async def test_api_latency_by_route_template_and_no_secrets(client: httpx.AsyncClient) -> None:
    job = await running_job(client)
    await job.api("")
    await client.get(f"/api/v1/jobs/{job.id}/machines", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    response = await client.get("/metrics")
    samples = await scrape(client)
    assert (
        value(
            samples,
            "castor_http_request_duration_seconds_count",
            route="/api/v1/jobs/{job_id}",
            method="GET",
            status="200",
        )
        >= 1
    )
    assert (
        value(
            samples,
            "castor_http_request_duration_seconds_count",
            route="/api/v1/worker/jobs/{job_id}/machines/{rank}/heartbeat",
            method="POST",
            status="200",
        )
        >= 4
    )
    assert job.id not in response.text, "route templates, not raw paths"
    assert ADMIN_TOKEN not in response.text and str(job.job["worker_token"]) not in response.text
    assert str(job.job["worker_token"]).split(".")[-1] not in response.text
