"""Process-exit reports and the job row (issue 13): a clean exit writes nothing and locks nothing (it goes
through while another transaction holds the job row); a crash takes the job row's lock, as the leader's
writers of failure events do, and reads neither every machine nor the plan's per-rank sources (a collective
failure makes every training process of the job report at once)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from services.root.db.models import Job
from tests.integration.test_progress_reports import statements_of
from tests.integration.test_registrations import locks
from tests.integration.web.scenario import running_job


def exit_report(instance: str, rank: int, exit_code: int) -> dict[str, object]:
    return {"instance_id": instance, "local_rank": 0, "global_rank": rank, "exit_code": exit_code}


async def test_a_clean_exit_goes_through_while_the_job_row_is_locked(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    job = await running_job(client, 4)
    lock = select(Job).where(Job.id == uuid.UUID(job.id)).with_for_update(key_share=True)
    async with database.session() as session:
        await session.execute(lock)
        # Before: every exit report took this lock first, and waited here until the holder committed.
        for rank in range(4):
            body = exit_report(job.instances[rank], rank, 0)
            response = await asyncio.wait_for(job.post(f"/machines/{rank}/exits", body, 202), 30)
            assert response.json()["failure_id"] is None
    assert (await job.api(""))["state"] == "running"


async def test_crash_reports_read_only_what_they_need(client: httpx.AsyncClient, root_app: FastAPI) -> None:
    job = await running_job(client, 4)
    clean = await statements_of(
        root_app, lambda: job.post("/machines/0/exits", exit_report(job.instances[0], 0, 0), 202)
    )
    assert clean and not [s for s in clean if locks(s)], clean
    assert not [s for s in clean if s.startswith(("update", "insert", "delete"))], clean

    ids: list[int | None] = []

    async def crash(rank: int) -> None:
        response = await job.post(f"/machines/{rank}/exits", exit_report(job.instances[rank], rank, -9), 202)
        ids.append(response.json()["failure_id"])

    crashes = await statements_of(root_app, *(lambda r=rank: crash(r) for rank in range(1, 4)))
    if not root_app.state.castor.database.is_sqlite:  # SQLite: no row locks, one writer at a time
        assert len([s for s in crashes if locks(s)]) == 3, "each crash locks the job row once"
    assert not [s for s in crashes if "sources" in s], "the plan's per-rank sources stay unread"
    every_machine = [
        s for s in crashes if "from machines" in s and "instance_id =" not in s and "state !=" in s
    ]
    assert not every_machine, "the reporter's machine and the suspects only, not every machine"
    assert len(set(ids)) == 1 and ids[0] is not None, "the first crash opens a failure, the others join it"
    failure = await job.api(f"/failures/{ids[0]}")
    assert failure["kind"] == "software" and len(failure["details"]["cascade"]) == 2


def crash_report(instance: str, rank: int, error_type: str, message: str) -> dict[str, object]:
    error = {"type": error_type, "message": f"{error_type}: {message}"}  # as torchelastic writes it
    return {**exit_report(instance, rank, 1), "error": error}


@pytest.mark.parametrize("order", ["symptom first", "cause first"])
async def test_the_exit_that_says_nothing_of_its_peers_is_the_cause_whichever_arrives_first(
    client: httpx.AsyncClient, order: str
) -> None:
    # Rank 1's restore finds its checkpoint corrupt and exits; ranks 0 and 2, waiting on it in a collective,
    # exit with gloo's error. Which report reaches the root first is a race.
    job = await running_job(client, 4)
    cause = crash_report(
        job.instances[1], 1, "CheckpointCorruptError", "checkpoint of iteration 7 is corrupt"
    )
    symptoms = [
        crash_report(job.instances[r], r, "RuntimeError", "[gloo/transport/tcp/pair.cc:537] Read error")
        for r in (0, 2)
    ]
    reports = [symptoms[0], cause, symptoms[1]] if order == "symptom first" else [cause, *symptoms]
    ids = set()
    for report in reports:
        rank = int(str(report["global_rank"]))
        response = await job.post(f"/machines/{rank}/exits", report, 202)
        ids.add(response.json()["failure_id"])
    assert len(ids) == 1 and None not in ids, "one failure; the other exits join it"

    failure = await job.api(f"/failures/{ids.pop()}")
    assert failure["kind"] == "software" and failure["rank"] == 1, failure
    assert "rank 1" in failure["cause"] and "CheckpointCorruptError" in failure["cause"], failure["cause"]
    details = failure["details"]
    assert details["global_rank"] == 1 and details["error"]["type"] == "CheckpointCorruptError", details
    # The peers' exits are the cascade, each with the cause it was seen as.
    cascade = details["cascade"]
    assert sorted(e["global_rank"] for e in cascade) == [0, 2], cascade
    assert all("Read error" in e["cause"] and e["error"]["type"] == "RuntimeError" for e in cascade), cascade


async def test_an_exit_of_a_generation_a_recovery_replaced_joins_that_recovery(
    client: httpx.AsyncClient,
) -> None:
    # Rank 0's gloo abort opens recovery generation 2, which is planned and carried out before the agent of
    # rank 1 reports its own process's exit from generation 1 (its agent saw the exit only when it stopped
    # the process for the recovery): part of that recovery, and its cause, never a failure of its own.
    job = await running_job(client, 4)
    gloo = crash_report(
        job.instances[0], 0, "RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed"
    )
    opened = (await job.post("/machines/0/exits", gloo, 202)).json()["failure_id"]
    await job.recover(iteration=5)

    late = {
        **crash_report(job.instances[1], 1, "CheckpointCorruptError", "iteration 5 is corrupt"),
        "generation": 1,
    }
    assert (await job.post("/machines/1/exits", late, 202)).json()["failure_id"] == opened
    assert (await job.api(""))["state"] == "running", "no new recovery"
    failures = await job.api("/failures")
    assert [f["id"] for f in failures] == [opened], failures
    failure = await job.api(f"/failures/{opened}")
    assert "CheckpointCorruptError" in failure["cause"] and failure["rank"] == 1, failure
    assert [e["global_rank"] for e in failure["details"]["cascade"]] == [0], failure["details"]

    # The generation that runs now: a failure of its own, as before.
    current = {**crash_report(job.instances[2], 2, "ValueError", "boom"), "generation": 2}
    assert (await job.post("/machines/2/exits", current, 202)).json()["failure_id"] != opened


async def test_a_late_exit_names_the_failure_its_peers_opened_when_a_recovery_failed(
    client: httpx.AsyncClient,
) -> None:
    # Rank 1 is killed; generation 2 is planned; rank 1's restore then finds its copy corrupt and exits, which
    # aborts rank 0's collective: rank 0's exit reaches the root first and opens the next recovery, which
    # takes up both failures. Rank 1's exit, reported last, is the cause of the second, not part of the first.
    job = await running_job(client, 4)
    killed = await job.kill_process(1)
    await job.collect(2, iteration=5)
    gloo = {
        **crash_report(
            job.instances[0], 0, "RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed"
        ),
        "generation": 2,
    }
    aborted = (await job.post("/machines/0/exits", gloo, 202)).json()["failure_id"]
    assert aborted != killed
    await job.plan(3, "collecting")

    corrupt = {
        **crash_report(job.instances[1], 1, "CheckpointCorruptError", "iteration 5 is corrupt"),
        "exit_code": -15,  # still exiting when its agent stopped it for the recovery
        "generation": 2,
    }
    assert (await job.post("/machines/1/exits", corrupt, 202)).json()["failure_id"] == aborted
    failure = await job.api(f"/failures/{aborted}")
    assert failure["rank"] == 1, failure
    # It failed for its exception; the signal only ended its exit.
    assert failure["cause"] == (
        "training process rank 1 failed (was killed by SIGTERM while exiting): "
        "CheckpointCorruptError: iteration 5 is corrupt"
    ), failure["cause"]
    assert "cascade" not in (await job.api(f"/failures/{killed}"))["details"]


async def test_a_hung_process_the_agent_killed_reads_as_the_kill_and_why(client: httpx.AsyncClient) -> None:
    job = await running_job(client, 4)
    report = {
        **exit_report(job.instances[2], 2, -9),
        "error": {"type": "Hung", "message": "Hung: rank 2 committed no checkpoint for 60 s"},
    }
    failure_id = (await job.post("/machines/2/exits", report, 202)).json()["failure_id"]
    failure = await job.api(f"/failures/{failure_id}")
    assert failure["cause"] == (
        "training process rank 2 was killed by SIGKILL: Hung: rank 2 committed no checkpoint for 60 s"
    ), failure["cause"]
