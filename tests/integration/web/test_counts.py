"""Counts that must agree wherever they are shown: the iterations a recovery lost are counted once per
recovery, not once per failure that joined it; a failure's recovery time has one definition (detection to
training resumed, the resume being when the last machine reported it) in the API, the pages and /metrics."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta

import httpx
from fastapi import FastAPI

from services.cli import failures, jobs
from services.root.db import repository as repo
from services.root.db.models import FailureEvent, FailureKind, FailureState, utcnow
from services.root.web.formatting import duration
from tests.integration.conftest import admin
from tests.integration.web.scenario import running_job
from tests.integration.web.test_metrics import scrape, value
from tests.integration.web.test_pages import text_of


async def test_a_lost_group_loses_its_iterations_once(client: httpx.AsyncClient, root_app: FastAPI) -> None:
    """A lost placement group is one recovery with a failure event per machine, each saying what the
    recovery lost: /metrics counts the rollback once (it read 315 for 159 iterations lost before)."""
    job = await running_job(client)
    before = await scrape(client)
    async with root_app.state.castor.database.session() as session:
        plan = await repo.latest_plan(session, uuid.UUID(job.id))
        assert plan is not None
        machines = {m.rank: m for m in await repo.live_machines(session, uuid.UUID(job.id))}
        now = utcnow()
        for rank in (2, 3):  # one placement group, both machines lost, one recovery
            session.add(
                FailureEvent(
                    job_id=plan.job_id,
                    machine_id=machines[rank].id,
                    rank=rank,
                    kind=FailureKind.HARDWARE,
                    cause=f"machine {rank} stopped heartbeating",
                    detected_at=now - timedelta(seconds=9),
                    classified_at=now - timedelta(seconds=8),
                    replaced_at=now - timedelta(seconds=6),
                    restored_at=now - timedelta(seconds=2),
                    resumed_at=now,
                    state=FailureState.RECOVERED,
                    plan_id=plan.id,
                    tier="persistent",
                    iterations_lost=52,
                    details={},
                )
            )
    after = await scrape(client)
    lost = value(after, "castor_iterations_lost_total") - value(before, "castor_iterations_lost_total")
    assert lost == 52, "one recovery rolled back 52 iterations, however many failures joined it"
    assert (
        value(after, "castor_failures_total", kind="hardware")
        - value(before, "castor_failures_total", kind="hardware")
        == 2
    ), "two machines failed"
    events = [e for e in await job.api("/failures") if e["state"] == "recovered"]
    assert [e["recovery_s"] for e in events] == [9.0, 9.0], "detection to resumed"


async def test_recovery_time_is_detection_to_the_last_resumed_report_everywhere(
    signed_in: httpx.AsyncClient,
) -> None:
    job = await running_job(signed_in)
    failure_id = await job.kill_process(1)
    await job.recover(20)
    event = await job.api(f"/failures/{failure_id}")
    reported = [datetime.fromisoformat(t) for t in event["details"]["resumed_reported_at"].values()]
    assert len(reported) == 4, "every machine's resumed report is noted"
    resumed, detected = (
        datetime.fromisoformat(event["resumed_at"]),
        datetime.fromisoformat(event["detected_at"]),
    )
    assert resumed == max(reported), "the recovery ends with the last machine's report, not a later pass"
    restored = [datetime.fromisoformat(t) for t in event["details"]["restored_reported_at"].values()]
    assert datetime.fromisoformat(event["restored_at"]) == max(restored)
    assert event["recovery_s"] == (resumed - detected).total_seconds()

    page = text_of((await signed_in.get(f"/jobs/{job.id}")).text)
    assert f"Recovery time {duration(event['recovery_s'])}" in page
    failure_page = text_of((await signed_in.get(f"/jobs/{job.id}/failures/{failure_id}")).text)
    assert f"Recovery time {duration(event['recovery_s'])}" in failure_page
    listed = (await signed_in.get(f"/api/v1/jobs/{job.id}/failures", headers=admin())).json()
    assert [e["recovery_s"] for e in listed if e["id"] == failure_id] == [event["recovery_s"]]

    # The API carries the phases the pages draw: a software failure needs no replacement, each phase starts
    # where the one before it ended, and the last ends when training resumed.
    phases = event["phases"]
    assert [p["name"] for p in phases] == ["detect", "classify", "restore", "resume"]
    assert all(p["start"] == before["end"] for before, p in itertools.pairwise(phases))
    assert datetime.fromisoformat(phases[-1]["end"]) == resumed
    for phase in phases:
        assert f"{phase['name']} {duration(phase['seconds'])}".lower() in failure_page.lower()


async def test_saves_skipped_and_replicas_skipped_are_counted_apart(signed_in: httpx.AsyncClient) -> None:
    """ "N committed, M skipped" mixed the two: saves the training skipped, and commits replication never
    sent. The job's counter, the pages, /metrics and the CLI now tell them apart."""
    job = await running_job(signed_in)
    for rank, instance in enumerate(job.instances):
        summary = {
            "local": {str(rank): 30},
            "committed": 31,
            "skipped": 1,  # saves
            "replicas_skipped": 5,  # replication
            "per_minute": 120.0,
        }
        await job.post(f"/machines/{rank}/heartbeat", {"instance_id": instance, "summary": summary}, 200)
    state = await job.api("")
    assert state["checkpoints_skipped"] == 4, "saves skipped only, not replication's"
    samples = await scrape(signed_in)
    name = str(job.job["name"])
    assert value(samples, "castor_checkpoints_skipped_total", job=name, machine="2") == 1
    assert value(samples, "castor_replicas_skipped_total", job=name, machine="2") == 5
    page = text_of((await signed_in.get(f"/jobs/{job.id}")).text)
    assert "4 saves skipped · 20 replicas skipped" in page
    machines = await job.api("/machines")
    fields = dict(jobs._job_fields(state, datetime.now(UTC), machines))
    assert fields["checkpoints"] == "124 committed, 4 saves skipped, 20 replicas skipped, 120.0/min"


async def test_failures_are_numbered_within_their_job(
    signed_in: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """Failure ids are global (and a process exit folded into a machine loss leaves a gap): the pages,
    the API's `number` and the CLI number each job's failures 1, 2, 3, ... instead."""
    first = await running_job(signed_in, prefix="a")
    second = await running_job(signed_in, prefix="b")
    async with root_app.state.castor.database.session() as session:
        for job in (first, second, first, second):  # interleaved: the ids of one job jump
            session.add(
                FailureEvent(
                    job_id=uuid.UUID(job.id),
                    rank=0,
                    kind=FailureKind.SOFTWARE,
                    cause="training process rank 0 was killed by SIGKILL",
                    detected_at=utcnow(),
                    classified_at=utcnow(),
                    state=FailureState.RECOVERED,
                    details={},
                )
            )
            await session.flush()
    events = await second.api("/failures")
    ids = sorted(e["id"] for e in events)
    assert ids[1] - ids[0] == 2, "another job's failure came between them"
    assert sorted((e["id"], e["number"]) for e in events) == [(ids[0], 1), (ids[1], 2)]
    assert (await second.api(f"/failures/{ids[1]}"))["number"] == 2
    page = text_of((await signed_in.get(f"/jobs/{second.id}")).text)
    assert "#1 software recovered" in page and "#2 software recovered" in page, page
    assert f"#{ids[1]} " not in page
    rows = failures._failure_rows(events, datetime.now(UTC))
    assert [(row[0], row[1]) for row in rows] == [("#2", ids[1]), ("#1", ids[0])]
