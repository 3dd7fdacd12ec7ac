"""Embedded (torchrun) mode: the root does not orchestrate recoveries, but records each failure and closes it
once torchrun's relaunch trains again. Before, a crash and relaunch faster than the heartbeat timeout (and
any crash of a one-machine job, never declared lost on its silence alone) recorded nothing, and a machine
declared lost while torchrun restarted kept its failure open for good: the job's ETTR fell towards 0 from
then on, even after it completed."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from services.root.db import repository as repo
from services.root.flows import recovery
from services.root.flows.failures import machine_lost
from tests.integration.api.test_worker import register
from tests.integration.conftest import ADMIN_TOKEN, admin, bearer, create_job
from tests.integration.web.scenario import eventually
from tests.integration.web.test_metrics import scrape, value


async def heartbeat(
    client: httpx.AsyncClient,
    job: dict[str, Any],
    rank: int,
    committed: int,
    session: str | None = None,
    *,
    newest: int = 7,
    restored: Any = None,
    held: int | None = None,
    per_minute: float | None = None,
    status: int = 200,
) -> httpx.Response:
    summary: dict[str, Any] = {
        "local": {str(rank): newest},
        "committed": committed,
        "session": session or f"s-{rank}-a",
        "per_minute": per_minute,
    }
    if restored is not None:
        summary["restored"] = {str(rank): restored}
    if held is not None:
        summary["newest_at_restore"] = {str(rank): held}
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/heartbeat",
        json={"instance_id": f"node-{rank}", "summary": summary},
        headers=bearer(str(job["worker_token"])),
    )
    assert response.status_code == status, response.text
    return response


async def finish(client: httpx.AsyncClient, job: dict[str, Any], machines: int) -> None:
    """Every machine reports that its training finished: the job completes."""
    for rank in range(machines):
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/progress",
            json={"instance_id": f"node-{rank}", "generation": 1, "event": "finished"},
            headers=bearer(str(job["worker_token"])),
        )
        assert response.status_code == 204, response.text


async def failures(client: httpx.AsyncClient, job: dict[str, Any]) -> list[dict[str, Any]]:
    response = await client.get(f"/api/v1/jobs/{job['id']}/failures", headers=admin())
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()
    return found


async def declare_lost(
    root_app: FastAPI, job: dict[str, Any], rank: int, *, earlier_by: timedelta = timedelta(0)
) -> None:
    """What the leader does to a machine silent past the grace: a hardware failure, detected `earlier_by`
    before now."""
    async with root_app.state.castor.database.session() as session:
        job_row = await repo.get_job(session, uuid.UUID(job["id"]), for_update=True)
        assert job_row is not None
        # As the leader and the detector load them: without their JSON documents.
        (machine,) = [m for m in await repo.live_machines(session, job_row.id) if m.rank == rank]
        lost = await machine_lost(
            session, job_row, machine, "no heartbeat (the test)", details={"silent": True}
        )
        assert lost is not None
        lost.detected_at -= earlier_by


async def leader_step(root_app: FastAPI, job: dict[str, Any]) -> None:
    """A leader's step on the job, at once."""
    castor = root_app.state.castor
    async with castor.database.session() as session:
        job_row = await repo.get_job(session, uuid.UUID(job["id"]), for_update=True)
        assert job_row is not None
        await recovery.advance(session, job_row, castor.settings)


async def running_embedded_job(client: httpx.AsyncClient, machines: int) -> dict[str, Any]:
    job = await create_job(client, machines=machines, replicas=min(machines, 2))
    for rank in range(machines):
        response = await register(client, job, f"node-{rank}", embedded=True, agent_session=f"s-{rank}-a")
        assert response.status_code == 200, response.text
        await heartbeat(client, job, rank, committed=5)
    return job


async def test_a_relaunch_within_the_heartbeat_timeout_is_a_failure_recovered_at_the_first_commit(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await running_embedded_job(client, machines=1)
    # The same registration sent again (its answer lost) is no relaunch.
    again = await register(client, job, "node-0", embedded=True, agent_session="s-0-a")
    assert again.status_code == 200 and await failures(client, job) == []

    relaunched = await register(client, job, "node-0", embedded=True, agent_session="s-0-b")
    assert relaunched.status_code == 200, relaunched.text
    (event,) = await failures(client, job)
    assert event["kind"] == "software" and event["state"] == "detected", event
    assert "relaunched" in event["cause"] and event["resumed_at"] is None
    # The relaunched session's first heartbeat, before its first commit: not resumed yet. Nor is it on the
    # crashed agent's last heartbeat, delayed past the relaunch's registration: its commits are the old
    # session's.
    await heartbeat(client, job, 0, committed=0, session="s-0-b")
    await heartbeat(client, job, 0, committed=5, session="s-0-a")
    await leader_step(root_app, job)
    (event,) = await failures(client, job)
    assert event["state"] == "detected", "closed on the crashed session's commits"
    await heartbeat(client, job, 0, committed=1, session="s-0-b")

    async def recovered() -> bool:
        (event,) = await failures(client, job)
        return bool(event["state"] == "recovered")

    await eventually(recovered, "the leader closed the failure at the relaunched training's first commit")
    (event,) = await failures(client, job)
    assert event["restored_at"] is not None and event["resumed_at"] is not None
    assert event["resumed_at"] >= event["detected_at"]
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert fetched["state"] == "running" and fetched["failures"] == 1
    # The pages show it like any recovered failure (no plan, no tier).
    signed_in = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    assert signed_in.status_code == 303, signed_in.text
    for page in (f"/jobs/{job['id']}", f"/jobs/{job['id']}/failures/{event['id']}"):
        response = await client.get(page)
        assert response.status_code == 200 and "relaunched" in response.text, page


async def test_a_machine_lost_while_torchrun_restarted_is_reinstated_and_closed_when_the_job_completes(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await running_embedded_job(client, machines=2)
    await declare_lost(root_app, job, 1)
    (event,) = await failures(client, job)
    assert event["kind"] == "hardware" and event["state"] == "detected"

    relaunched = await register(client, job, "node-1", embedded=True, agent_session="s-1-b")
    assert relaunched.status_code == 200, relaunched.text
    (event,) = await failures(client, job)
    assert event["state"] == "detected" and "relaunched_at" in event["details"], event
    assert "reinstated" in event["details"], "the same machine came back: no replacement to wait for"
    machines = (await client.get(f"/api/v1/jobs/{job['id']}/machines", headers=admin())).json()
    assert {m["rank"]: m["state"] for m in machines} == {0: "healthy", 1: "healthy"}

    # The relaunched training finishes before any heartbeat showed a commit: the job completes, and its
    # failure is over with it.
    await finish(client, job, machines=2)
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert fetched["state"] == "completed"
    (event,) = await failures(client, job)
    assert event["state"] == "recovered" and event["resumed_at"] is not None, event


async def test_one_crash_relaunched_on_every_machine_is_one_failure_charged_once(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    job = await running_embedded_job(client, machines=3)
    for rank in range(3):  # torchrun relaunches every machine's processes after one of them crashed
        response = await register(client, job, f"node-{rank}", embedded=True, agent_session=f"s-{rank}-b")
        assert response.status_code == 200, response.text
    (event,) = await failures(client, job)
    assert event["rank"] == 0 and event["details"]["relaunched_machines"] == [1, 2], event
    for rank in range(3):
        await heartbeat(client, job, rank, committed=1, session=f"s-{rank}-b")

    async def recovered() -> dict[str, Any] | None:
        (event,) = await failures(client, job)
        return event if event["state"] == "recovered" else None

    event = await eventually(recovered, "the failure closed at the relaunched training's first commit")
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    downtime = (
        datetime.fromisoformat(event["resumed_at"]) - datetime.fromisoformat(event["detected_at"])
    ).total_seconds()
    assert fetched["wasted_time_s"] == pytest.approx(downtime, abs=1e-3), (fetched, event)

    # A crash long after a failure still open (its machine never came back) is a failure of its own.
    await declare_lost(root_app, job, 2, earlier_by=timedelta(hours=1))
    response = await register(client, job, "node-1", embedded=True, agent_session="s-1-c")
    assert response.status_code == 200, response.text
    opened = [e for e in await failures(client, job) if e["state"] == "detected"]
    assert sorted((e["rank"], e["kind"]) for e in opened) == [(1, "software"), (2, "hardware")], opened


@pytest.mark.parametrize(
    ("restored", "held", "tier", "lost"),
    [
        (5, None, "local", 2),  # the newest held taken at the last heartbeat before the relaunch (7)
        (5, 9, "local", 4),  # the relaunched ranks held 9: committed after that heartbeat
        (-1, None, "none", 8),  # a fresh start loses iterations 0..7
    ],
)
async def test_the_failure_records_what_the_relaunch_restored_and_the_iterations_it_lost(
    client: httpx.AsyncClient, root_app: FastAPI, restored: int, held: int | None, tier: str, lost: int
) -> None:
    job = await running_embedded_job(client, machines=1)  # its last heartbeat: iteration 7 committed
    relaunched = await register(client, job, "node-0", embedded=True, agent_session="s-0-b")
    assert relaunched.status_code == 200, relaunched.text
    (event,) = await failures(client, job)
    assert event["details"]["reached_iteration"] == 7, event
    # What a summary may not say: an iteration below -1, a count that is not an integer.
    for bad in (-2, True, "5", 2**31):
        error = await heartbeat(client, job, 0, committed=1, session="s-0-b", restored=bad, status=422)
        assert "restored" in error.text, error.text
    # The relaunched training restored `restored` (-1: nothing, it started fresh) and committed again.
    await heartbeat(
        client, job, 0, committed=1, session="s-0-b", newest=restored + 1, restored=restored, held=held
    )

    async def recovered() -> dict[str, Any] | None:
        (event,) = await failures(client, job)
        return event if event["state"] == "recovered" else None

    event = await eventually(recovered, "the failure closed at the relaunched training's first commit")
    assert (event["tier"], event["iterations_lost"]) == (tier, lost), event
    signed_in = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    assert signed_in.status_code == 303, signed_in.text
    page = await client.get(f"/jobs/{job['id']}/failures/{event['id']}")
    assert page.status_code == 200 and f"tier tier-{tier} big" in page.text, page.text


async def test_a_relaunched_machine_that_does_not_say_what_it_restored_leaves_the_rollback_unknown(
    client: httpx.AsyncClient,
) -> None:
    job = await running_embedded_job(client, machines=1)
    relaunched = await register(client, job, "node-0", embedded=True, agent_session="s-0-b")
    assert relaunched.status_code == 200, relaunched.text
    await heartbeat(client, job, 0, committed=1, session="s-0-b")  # a worker library from before the figure

    async def recovered() -> dict[str, Any] | None:
        (event,) = await failures(client, job)
        return event if event["state"] == "recovered" else None

    event = await eventually(recovered, "the failure closed at the relaunched training's first commit")
    assert event["tier"] is None and event["iterations_lost"] is None, event
    signed_in = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    assert signed_in.status_code == 303, signed_in.text
    for page in (f"/jobs/{job['id']}", f"/jobs/{job['id']}/failures/{event['id']}"):
        response = await client.get(page)
        assert response.status_code == 200 and "tier unknown" in response.text, page
        assert "tier pending" not in response.text, "a failure that ended waits for no tier"


async def test_one_crash_recorded_as_two_failures_closed_apart_counts_its_largest_rollback_once(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """Both machines declared lost while torchrun relaunched them: two failures of one crash, closed at two
    leader steps. Before, the job's wasted time charged the rollback of whichever closed first and /metrics
    added both."""
    job = await running_embedded_job(client, machines=2)
    for rank in range(2):
        await heartbeat(client, job, rank, committed=5, per_minute=30.0)  # 2 s per iteration
    before = await scrape(client)
    for rank in range(2):
        await declare_lost(root_app, job, rank)
    for rank in range(2):
        response = await register(client, job, f"node-{rank}", embedded=True, agent_session=f"s-{rank}-b")
        assert response.status_code == 200, response.text

    async def recovered(rank: int) -> dict[str, Any] | None:
        event = next(e for e in await failures(client, job) if e["rank"] == rank)
        return event if event["state"] == "recovered" else None

    # Both restored iteration 5; machine 0 held up to 7, machine 1 up to 8 (a commit after its heartbeat).
    for rank, held in ((0, 7), (1, 8)):
        await heartbeat(client, job, rank, 1, f"s-{rank}-b", restored=5, held=held, per_minute=30.0)
        await eventually(lambda rank=rank: recovered(rank), f"machine {rank}'s failure closed")  # type: ignore[misc]
    first, second = sorted(await failures(client, job), key=lambda e: e["rank"])
    assert (first["iterations_lost"], second["iterations_lost"]) == (2, 3), (first, second)
    assert first["details"]["crash"] == second["details"]["crash"] == first["id"], "one crash"
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    downtime = datetime.fromisoformat(second["resumed_at"]) - datetime.fromisoformat(first["detected_at"])
    assert fetched["wasted_time_s"] == pytest.approx(downtime.total_seconds() + 3 * 2.0, abs=1e-3), fetched
    after = await scrape(client)
    assert value(after, "castor_iterations_lost_total") - value(before, "castor_iterations_lost_total") == 3


async def test_a_machine_back_without_a_relaunch_ends_its_failure_when_reinstated(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """Declared lost while silent, its heartbeats resumed from the same session: its training (local rank
    0's services run inside it) never stopped, and torchrun relaunched nothing. Before, the failure stayed
    open until the job completed, charging the whole run since as downtime."""
    job = await running_embedded_job(client, machines=2)
    await heartbeat(client, job, 1, committed=5, restored=3, held=9)  # its session's own start, long ago
    await declare_lost(root_app, job, 1)
    (event,) = await failures(client, job)
    assert event["details"]["committed_at_loss"] == 5, event
    await heartbeat(client, job, 1, committed=5, restored=3, held=9)  # back, the same session

    async def reinstated() -> dict[str, Any] | None:
        (event,) = await failures(client, job)
        return event if "reinstated" in event["details"] else None

    await eventually(reinstated, "the machine reinstated when its heartbeats resumed")
    await leader_step(root_app, job)
    (event,) = await failures(client, job)
    assert event["state"] == "detected", "heartbeats, but no commit yet: its training may still be stuck"
    await heartbeat(client, job, 1, committed=6, restored=3, held=9)

    async def recovered() -> dict[str, Any] | None:
        (event,) = await failures(client, job)
        return event if event["state"] == "recovered" else None

    event = await eventually(recovered, "the failure closed once its machine's training committed again")
    assert "without a relaunch" in event["details"]["embedded_recovery"], event
    back = datetime.fromisoformat(event["details"]["reinstated"]["at"])
    assert datetime.fromisoformat(event["resumed_at"]) > back, event
    assert event["tier"] is None and event["iterations_lost"] == 0, "nothing restored, nothing rolled back"
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert fetched["state"] == "running" and fetched["failures"] == 1


async def test_a_failure_with_no_relaunch_takes_no_rollback_when_the_job_completes(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    """The job completes while a machine's loss is open, its training never relaunched: the completion
    closes the failure without the figures of the restore its training made when it started."""
    job = await running_embedded_job(client, machines=2)
    await heartbeat(client, job, 1, committed=5, restored=3, held=9)  # its session's own start, long ago
    await declare_lost(root_app, job, 1)
    await finish(client, job, machines=2)
    (event,) = await failures(client, job)
    assert event["state"] == "recovered", event
    assert event["tier"] is None and event["iterations_lost"] is None, event
