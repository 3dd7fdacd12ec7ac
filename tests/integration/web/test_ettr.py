"""A job's measured ETTR in its API resource, on its page and in /metrics (issue 14, item 1)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import JSON, cast, literal, update

from services.root.db.models import FailureEvent, Job, JobState, Machine
from tests.integration.conftest import admin, create_job
from tests.integration.web.scenario import running_job
from tests.integration.web.test_metrics import scrape, value

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


async def test_api_and_page_show_the_measured_ettr_of_a_finished_job(
    root_app: FastAPI, client: httpx.AsyncClient, signed_in: httpx.AsyncClient
) -> None:
    """1,000 s of training, one hardware failure: 2 s detection, 1 s classification, 30 s replacement, 5 s
    restore, 14 s resume of which 4 s is the first (kept) iteration, 3 iterations of 4 s rolled back."""
    job = await create_job(client, machines=2)
    async with root_app.state.castor.database.session() as session:
        row = await session.get(Job, uuid.UUID(str(job["id"])))
        assert row is not None
        row.state, row.started_at, row.finished_at = JobState.COMPLETED, T0, at(1000)
        row.checkpoints_per_minute = 15.0  # one checkpoint every iteration of 4 s
        session.add(
            FailureEvent(
                job_id=row.id,
                rank=1,
                kind="hardware",
                state="recovered",
                cause="machine 1 lost",
                detected_at=at(102),
                classified_at=at(103),
                replaced_at=at(133),
                restored_at=at(138),
                resumed_at=at(152),
                tier="peer",
                iterations_lost=3,
                details={"last_heartbeat_at": at(100).isoformat()},
            )
        )
    body = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert body["ettr"] == {
        "ettr": pytest.approx(0.94),
        "wall_s": 1000.0,
        "productive_s": 940.0,
        "detection_s": 3.0,
        "replacement_s": 30.0,
        "restore_s": 5.0,
        "warmup_s": 10.0,
        "lost_iterations_s": 12.0,
        "checkpoint_overhead_s": None,
        "iteration_s": 4.0,
    }
    listed = (await client.get("/api/v1/jobs", headers=admin(), params={"limit": 500})).json()["items"]
    assert next(j for j in listed if j["id"] == job["id"])["ettr"]["ettr"] == pytest.approx(0.94)

    page = (await signed_in.get(f"/jobs/{job['id']}")).text
    assert "Effective training time (ETTR)" in page and "94.0 %" in page
    assert "replacement 30 s" in page and "lost iterations 12 s" in page


async def test_a_job_stopped_during_a_recovery_counts_its_downtime_until_the_stop(
    root_app: FastAPI, client: httpx.AsyncClient
) -> None:
    """1,000 s of training; a process crashed at 500 s and its recovery was still restoring when the job
    was failed at 1,000 s. Before, the unrecoverable failure's open phase was dropped: ETTR 1.0, the
    worst jobs reported as the best."""
    job = await create_job(client, machines=2)
    async with root_app.state.castor.database.session() as session:
        row = await session.get(Job, uuid.UUID(str(job["id"])))
        assert row is not None
        row.state, row.started_at, row.finished_at = JobState.FAILED, T0, at(1000)
        session.add(
            FailureEvent(
                job_id=row.id,
                rank=1,
                kind="software",
                state="unrecoverable",
                cause="rank 1 exited with 1",
                detected_at=at(500),
                classified_at=at(500),
                details={"unrecoverable": "the job was stopped before this failure was recovered"},
            )
        )
    ettr = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()["ettr"]
    assert ettr["ettr"] == pytest.approx(0.5) and ettr["restore_s"] == pytest.approx(500.0)


async def test_metrics_show_the_ettr_of_a_running_job_after_a_recovery(client: httpx.AsyncClient) -> None:
    job = await running_job(client)
    await job.heartbeat(23)
    await job.kill_process(2)
    await job.recover(23)
    samples = await scrape(client)
    name = str(job.job["name"])
    ettr = value(samples, "castor_job_ettr", job=name)
    assert 0 < ettr < 1, "a recovery took some of the time"
    restore = value(samples, "castor_job_wasted_by_cause_seconds", job=name, cause="restore")
    assert restore > 0
    api = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()["ettr"]
    # The recovery is over: its cost is fixed (the ratio itself rises as training goes on).
    assert api["restore_s"] == pytest.approx(restore, abs=0.001) and api["ettr"] >= ettr
    assert value(samples, "castor_job_productive_seconds", job=name) > 0


async def test_simulate_from_job_takes_the_recorded_phases(client: httpx.AsyncClient) -> None:
    """`castor simulate --from-job`'s costs from a real recovered failure, as the API returns it."""
    from services.cli.simulate import job_costs
    from services.root.domain.simulate import Setting, castor_inputs

    job = await running_job(client)
    await job.heartbeat(23)
    await job.kill_process(2)
    await job.recover(23)
    resource = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()
    failures = (await client.get(f"/api/v1/jobs/{job.id}/failures", headers=admin())).json()
    [failure] = failures
    _, fallback = castor_inputs(Setting())
    costs, source = job_costs(resource, failures, fallback)
    assert source["failures_used"] == 1 and source["samples"]["restore_local_s"] == 1
    restore = datetime.fromisoformat(failure["restored_at"]) - datetime.fromisoformat(
        failure["classified_at"]
    )
    assert costs.restore_local_s == pytest.approx(restore.total_seconds(), abs=1e-3)
    assert costs.restore_local_s != fallback.restore_local_s
    assert costs.replace_standby_s == fallback.replace_standby_s  # no hardware failure recorded


async def test_heartbeats_that_report_checkpoint_stalls_make_the_overhead_measured(
    root_app: FastAPI, client: httpx.AsyncClient, signed_in: httpx.AsyncClient
) -> None:
    """The agents' summaries carry each rank's cumulative stall; the job is charged the slowest rank's."""
    job = await running_job(client)
    async with root_app.state.castor.database.session() as session:
        row = await session.get(Job, uuid.UUID(job.id))
        assert row is not None
        row.started_at = datetime.now(UTC) - timedelta(hours=1)  # wall time well above the stalls
    before = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()["ettr"]
    assert before["checkpoint_overhead_s"] is None  # the scenario's summaries carry no figure
    name = str(job.job["name"])
    assert (
        "castor_job_wasted_by_cause_seconds",
        frozenset({"job": name, "cause": "checkpoint"}.items()),
    ) not in (await scrape(client))

    for rank, instance in enumerate(job.instances):
        summary = {
            "local": {str(rank): 30},
            "committed": 31,
            "per_minute": 120.0,
            "stalled_s": {str(rank): 1.5 + rank},  # rank 3 waited longest: 4.5 s
            "save_calls": {str(rank): 31},
        }
        await job.post(f"/machines/{rank}/heartbeat", {"instance_id": instance, "summary": summary}, 200)

    ettr = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()["ettr"]
    assert ettr["checkpoint_overhead_s"] == pytest.approx(4.5)
    assert ettr["productive_s"] == pytest.approx(ettr["wall_s"] - 4.5, abs=0.01)  # no failure: only stalls
    machines = (await client.get(f"/api/v1/jobs/{job.id}/machines", headers=admin())).json()
    assert {m["rank"]: m["summary"]["stalled_s"] for m in machines} == {
        r: {str(r): 1.5 + r} for r in range(4)
    }

    samples = await scrape(client)
    assert value(samples, "castor_job_wasted_by_cause_seconds", job=name, cause="checkpoint") == 4.5
    page = (await signed_in.get(f"/jobs/{job.id}")).text
    assert "checkpoint stalls 4.5 s" in page and "not measured" not in page


async def test_the_checkpoint_stall_counts_only_well_formed_entries_over_every_machine(
    root_app: FastAPI, client: httpx.AsyncClient
) -> None:
    """Summaries from etcd are not validated: the stall sums, per rank over every machine that ran it (a
    replaced one too), only non-negative finite seconds, and rank keys that are numbers ("00" is rank 0);
    the rest is skipped."""
    job = await running_job(client)
    job_id = uuid.UUID(job.id)
    summaries = {
        0: '{"stalled_s": {"0": 1.0, "1": -5, "2": "7", "3": true, "x": 50}, "save_calls": {"0": 10}}',
        1: '{"stalled_s": {"00": 1.0, "4": 1e400}, "save_calls": {"00": 2.5}}',
        2: '{"stalled_s": "bad", "save_calls": {"2": 1}}',
        3: '{"stalled_s": {"5": 4.0, "0": -1.0}, "save_calls": [1]}',
    }
    async with root_app.state.castor.database.session() as session:
        row = await session.get(Job, job_id)
        assert row is not None
        row.started_at = datetime.now(UTC) - timedelta(hours=1)
        for rank, summary in summaries.items():  # the JSON text as it is, not as Python would write it
            value = (
                literal(summary) if root_app.state.castor.database.is_sqlite else cast(literal(summary), JSON)
            )
            await session.execute(
                update(Machine).where(Machine.job_id == job_id, Machine.rank == rank).values(summary=value)
            )
        session.add(
            Machine(
                job_id=job_id,
                rank=0,
                instance_id="gone-0",
                address="127.0.0.1",
                data_port=7000,
                state="replaced",
                summary={"stalled_s": {"0": 2.5}, "save_calls": {"0": 3}},
            )
        )
    ettr = (await client.get(f"/api/v1/jobs/{job.id}", headers=admin())).json()["ettr"]
    # Rank 0: 1.0 + 1.0 ("00") + 2.5 (the replaced machine) = 4.5 s, above rank 5's 4.0 s.
    assert ettr["checkpoint_overhead_s"] == pytest.approx(4.5)
