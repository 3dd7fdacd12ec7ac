"""/metrics counters never go down: deleting a job (its failure events, plans) and folding a peer's process
exit into a machine's loss retire the rows' contributions (metric_totals) instead of dropping them.
Prometheus reads any decrease of a counter, or of a histogram's buckets, sum or count, as a reset."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from services.root import metrics
from services.root.db import repository as repo
from services.root.flows.failures import machine_lost
from services.root.web import queries
from tests.integration.conftest import admin
from tests.integration.web.scenario import running_job

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# What the database's failure events make, counted over every job (the per-job families, labelled by job,
# end with their job: a series that stops is not a reset).
FAILURE_FAMILIES = (
    "castor_failures",
    "castor_recoveries",
    "castor_iterations_lost",
    "castor_recovery_phase_seconds",
    "castor_recovery_seconds",
)


async def counters(client: httpx.AsyncClient) -> Samples:
    """Every sample of the failure families (counters and histograms) of a scrape."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        if family.name in FAILURE_FAMILIES:
            assert family.type in ("counter", "histogram"), family
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    assert {name for name, _ in samples} >= {
        "castor_failures_total",
        "castor_recoveries_total",
        "castor_iterations_lost_total",
        "castor_recovery_phase_seconds_bucket",
        "castor_recovery_phase_seconds_sum",
        "castor_recovery_seconds_count",
    }
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def decreased(before: Samples, after: Samples) -> list[str]:
    """The samples of `before` that are lower in `after`, or missing from it, one line each."""
    return sorted(
        f"{name}{dict(sorted(labels))}: {was} -> {after.get((name, labels))}"
        for (name, labels), was in before.items()
        if after.get((name, labels), -1.0) < was
    )


async def test_counters_stay_when_a_job_with_failures_and_a_recovery_is_deleted(
    client: httpx.AsyncClient,
) -> None:
    job = await running_job(client)
    await job.heartbeat(23)
    await job.kill_process(2)
    await job.recover(20)  # rolls back from 23: 3 iterations lost
    await job.kill_process(1)  # a failure still open when the job is deleted
    before = await counters(client)
    assert value(before, "castor_failures_total", kind="software") == 2
    assert value(before, "castor_recoveries_total", tier="local") == 1
    assert value(before, "castor_iterations_lost_total") == 3
    assert value(before, "castor_recovery_phase_seconds_count", phase="restore") == 1
    assert value(before, "castor_recovery_seconds_count", kind="software") == 1
    assert value(before, "castor_recovery_seconds_sum", kind="software") > 0

    response = await client.delete(f"/api/v1/jobs/{job.id}", headers=admin())
    assert response.status_code == 204
    after = await counters(client)
    assert not decreased(before, after), "\n".join(decreased(before, after))
    assert after == before, "a deleted job's history is retired as it was counted"

    # A job after it adds to the retired totals.
    second = await running_job(client, prefix="j")
    await second.heartbeat(22)
    await second.kill_process(3)
    await second.recover(20)
    later = await counters(client)
    assert not decreased(after, later), "\n".join(decreased(after, later))
    assert value(later, "castor_failures_total", kind="software") == 3
    assert value(later, "castor_recoveries_total", tier="local") == 2
    assert value(later, "castor_iterations_lost_total") == 5
    assert value(later, "castor_recovery_seconds_count", kind="software") == 2
    assert value(later, "castor_recovery_seconds_bucket", kind="software", le="+Inf") == 2

    response = await client.delete(f"/api/v1/jobs/{second.id}", headers=admin())
    assert response.status_code == 204
    assert await counters(client) == later


async def test_a_process_exit_folded_into_a_machine_loss_still_counts(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await running_job(client)
    # Exit code 1, no recorded error: it may be rank 0's waiting on a dead peer (a symptom).
    symptom = await job.kill_process(0, exit_code=1)
    before = await counters(client)
    assert value(before, "castor_failures_total", kind="software") == 1

    database = root_app.state.castor.database
    async with database.session() as session:
        locked = await repo.get_job(session, uuid.UUID(job.id), for_update=True)
        assert locked is not None
        machine = next(m for m in await repo.live_machines(session, locked.id) if m.rank == 1)
        loss = await machine_lost(session, locked, machine, "stopped heartbeating (the test)")
        assert loss is not None
        assert [c["machine_rank"] for c in loss.details["cascade"]] == [0], "the exit folded in"
    failures = await job.api("/failures")
    assert symptom not in [f["id"] for f in failures]

    after = await counters(client)
    assert not decreased(before, after), "\n".join(decreased(before, after))
    assert value(after, "castor_failures_total", kind="software") == 1, "the folded exit still counts"
    assert value(after, "castor_failures_total", kind="hardware") == 1

    response = await client.delete(f"/api/v1/jobs/{job.id}", headers=admin())
    assert response.status_code == 204
    assert await counters(client) == after


async def test_a_job_deleted_while_a_scrape_reads_is_counted_once(
    client: httpx.AsyncClient, root_app: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape reads the failure events, then the retired totals: a job deleted in between (its events
    retired) was counted in both on Postgres, and the next scrape went down."""
    if root_app.state.castor.database.is_sqlite:
        pytest.skip("SQLite: the deletion waits for the scrape's transaction to end")
    job = await running_job(client)
    await job.kill_process(2)
    await job.kill_process(1)
    before = await counters(client)
    assert value(before, "castor_failures_total", kind="software") >= 1
    read_tiers = queries.recoveries_by_tier

    async def deleted_meanwhile(session: Any) -> Any:
        monkeypatch.setattr(queries, "recoveries_by_tier", read_tiers)
        response = await client.delete(f"/api/v1/jobs/{job.id}", headers=admin())
        assert response.status_code == 204
        return await read_tiers(session)

    monkeypatch.setattr(queries, "recoveries_by_tier", deleted_meanwhile)
    families = await metrics.database_families(root_app.state.castor.database)  # the scrape it raced
    assert queries.recoveries_by_tier is read_tiers, "the deletion ran during the scrape"
    (failures,) = [f for f in families if isinstance(f, Metric) and f.name == "castor_failures"]
    racing = {s.labels["kind"]: s.value for s in failures.samples if s.name == "castor_failures_total"}
    after = await counters(client)
    assert racing["software"] == value(after, "castor_failures_total", kind="software"), (racing, after)
    assert after == before
