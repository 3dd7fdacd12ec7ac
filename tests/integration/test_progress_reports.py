"""Progress and inventory reports off the job row (issue 13): a report writes its own machine's row and its
own progress row, locks nothing shared (it goes through while another transaction holds the job row) and
touches no failure event; the failure still shows every machine's report times and restore details, its
phases end at the last machine's report; the last machines' "finished" reports at once complete the job
exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event, select

from services.root.db.models import Job, RankProgress
from services.root.orchestration.recovery_driver import RecoveryDriver
from tests.integration.conftest import admin
from tests.integration.web.scenario import Scenario, eventually, running_job

MACHINES = 4


def holdings(rank: int, iteration: int) -> list[dict[str, Any]]:
    peer = rank ^ 1
    return [
        {"rank": r, "iteration": iteration, "tier": tier, "digest": f"{r:02d}" * 8, "data_bytes": 64}
        | {"verified": True}
        for r, tier in ((rank, "local"), (peer, "replica"))
    ]


def inventory(job: Scenario, rank: int) -> dict[str, Any]:
    return {"instance_id": job.instances[rank], "generation": 2, "holdings": holdings(rank, 20)}


def restored(job: Scenario, rank: int) -> dict[str, Any]:
    details = {str(rank): {"tier": "local", "seconds": 0.25 + rank, "source": rank}}
    return {"instance_id": job.instances[rank], "generation": 2, "event": "restored", "details": details}


def resumed(job: Scenario, rank: int) -> dict[str, Any]:
    return {"instance_id": job.instances[rank], "generation": 2, "event": "resumed"}


def finished(job: Scenario, rank: int) -> dict[str, Any]:
    return {"instance_id": job.instances[rank], "generation": 2, "event": "finished"}


async def completed(job: Scenario) -> dict[str, Any] | None:
    found: dict[str, Any] = await job.api("")
    return found if found["state"] == "completed" else None


async def recovered(job: Scenario, failure_id: int) -> dict[str, Any] | None:
    found: dict[str, Any] = await job.api(f"/failures/{failure_id}")
    return found if found["state"] == "recovered" else None


async def restored_everywhere(client: httpx.AsyncClient) -> tuple[Scenario, int]:
    """A crashed job (see crashed) whose recovery every machine restored."""
    job, failure_id = await crashed(client)
    for rank in range(MACHINES):
        await job.post(f"/machines/{rank}/inventory", inventory(job, rank), 204)
    await job.plan(2, "ready")
    for rank in range(MACHINES):
        await job.post(f"/machines/{rank}/progress", restored(job, rank), 204)
    return job, failure_id


async def crashed(client: httpx.AsyncClient) -> tuple[Scenario, int]:
    """A running job whose process on machine 1 crashed: its recovery (generation 2) is collecting."""
    job = await running_job(client, MACHINES)
    failure_id = await job.kill_process(1)
    await job.plan(2, "collecting")
    return job, failure_id


async def statements_of(root_app: FastAPI, *requests: Callable[[], Awaitable[Any]]) -> list[str]:
    """The SQL the requests ran, at once, each in a task of its own (their statements only: not the
    leader's meanwhile; the in-process transport runs a request in the task that sends it)."""
    statements: list[str] = []
    tasks: set[asyncio.Task[Any] | None] = set()

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if asyncio.current_task() in tasks:
            statements.append(" ".join(statement.split()).lower())

    async def run(request: Callable[[], Awaitable[Any]]) -> None:
        tasks.add(asyncio.current_task())
        await request()

    engine = root_app.state.castor.database.engine.sync_engine
    event.listen(engine, "before_cursor_execute", record)
    try:
        await asyncio.gather(*(asyncio.create_task(run(request)) for request in requests))
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return statements


async def test_reports_go_through_while_the_job_row_is_locked(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    database = root_app.state.castor.database
    if database.is_sqlite:
        pytest.skip("SQLite has no row locks: one writer at a time")
    job, failure_id = await crashed(client)
    lock = select(Job).where(Job.id == uuid.UUID(job.id)).with_for_update()
    async with database.session() as session:
        await session.execute(lock)
        # Before: every report took this lock first, and waited here until the holder committed.
        for rank in range(MACHINES):
            await asyncio.wait_for(job.post(f"/machines/{rank}/inventory", inventory(job, rank), 204), 30)
    await job.plan(2, "ready")
    async with database.session() as session:
        await session.execute(lock)
        for rank in range(MACHINES):
            await asyncio.wait_for(job.post(f"/machines/{rank}/progress", restored(job, rank), 204), 30)
        for rank in range(MACHINES - 1):
            await asyncio.wait_for(job.post(f"/machines/{rank}/progress", resumed(job, rank), 204), 30)
    await job.post(f"/machines/{MACHINES - 1}/progress", resumed(job, MACHINES - 1), 204)

    failure = await eventually(lambda: recovered(job, failure_id), "the failure to be recovered")
    details = failure["details"]
    assert (
        sorted(details["restored_reported_at"])
        == sorted(details["resumed_reported_at"])
        == ["0", "1", "2", "3"]
    )
    assert details["restore"]["2"] == {"2": {"tier": "local", "seconds": 2.25, "source": 2}}
    last_resumed = max(datetime.fromisoformat(t) for t in details["resumed_reported_at"].values())
    assert datetime.fromisoformat(failure["resumed_at"]) == last_resumed
    last_restored = max(datetime.fromisoformat(t) for t in details["restored_reported_at"].values())
    assert datetime.fromisoformat(failure["restored_at"]) == last_restored


async def test_a_report_writes_only_its_own_rows(client: httpx.AsyncClient, root_app: FastAPI) -> None:
    job, failure_id = await crashed(client)
    inventory_sql = await statements_of(
        root_app, lambda: job.post("/machines/0/inventory", inventory(job, 0), 204)
    )
    for rank in range(1, MACHINES):
        await job.post(f"/machines/{rank}/inventory", inventory(job, rank), 204)
    await job.plan(2, "ready")
    restored_sql = await statements_of(
        root_app, lambda: job.post("/machines/2/progress", restored(job, 2), 204)
    )
    retried_sql = await statements_of(
        root_app, lambda: job.post("/machines/2/progress", restored(job, 2), 204)
    )
    resumed_sql = await statements_of(
        root_app, lambda: job.post("/machines/2/progress", resumed(job, 2), 204)
    )

    postgres = not root_app.state.castor.database.is_sqlite
    for statements in (inventory_sql, restored_sql, retried_sql, resumed_sql):
        assert statements, "the request ran in this task"
        # One statement each on Postgres, in autocommit (the inventory checks the plan's head inside its
        # UPDATE; the progress row is written by an upsert fed by the machine's UPDATE), and no read of the
        # job row: a thousand of these arrive at once in a recovery. SQLite: the progress row apart.
        written = [s for s in statements if s != "begin immediate"]  # SQLite's BEGIN
        assert len(written) == (1 if postgres or statements is inventory_sql else 2), statements
        assert not [s for s in statements if " from jobs" in s], statements
        assert not [s for s in statements if "for update" in s or "for no key update" in s], statements
        assert not [s for s in statements if "failure_events" in s], "no failure event is read or written"
        assert not [s for s in statements if "sources" in s], "the plan's per-rank sources stay unread"
        writes = [s for s in statements if s.startswith(("update", "insert", "delete", "with"))]
        assert writes and all(
            s.startswith(("update machines", "insert into rank_progress", "with marked as (update machines"))
            for s in writes
        ), writes
        assert all("update machines" not in s or "where machines.job_id" in s for s in writes), writes

    # The retry moved nothing: the first report's time stays.
    failure = await job.api(f"/failures/{failure_id}")
    async with root_app.state.castor.database.session() as session:
        rows = (await session.execute(select(RankProgress).where(RankProgress.rank == 2))).scalars().all()
    assert [(r.generation, r.restore) for r in rows] == [
        (2, {"2": {"tier": "local", "seconds": 2.25, "source": 2}})
    ]
    row = rows[0]
    assert row.restored_at is not None and row.resumed_at is not None
    assert failure["details"]["restored_reported_at"] == {"2": row.restored_at.isoformat()}
    assert failure["details"]["resumed_reported_at"] == {"2": row.resumed_at.isoformat()}
    assert failure["restored_at"] is None, "three machines have not restored yet"

    # The rows go with their job (they have no foreign key to cascade from).
    assert (await job.client.delete(f"/api/v1/jobs/{job.id}", headers=admin())).status_code == 204
    async with root_app.state.castor.database.session() as session:
        assert not (await session.execute(select(RankProgress.id))).all()


async def test_the_last_finished_reports_at_once_complete_the_job_exactly_once(
    client: httpx.AsyncClient, root_app: FastAPI
) -> None:
    machines = 8
    job = await running_job(client, machines)
    directive = await client.get(f"/api/v1/worker/jobs/{job.id}/directive", headers=job.worker)
    revision = directive.json()["revision"]
    for rank in range(machines - 4):
        body = {"instance_id": job.instances[rank], "generation": 1, "event": "finished"}
        await job.post(f"/machines/{rank}/progress", body, 204)
    assert (await job.api(""))["state"] == "running", "half the machines are still training"

    def finished(rank: int) -> Callable[[], Awaitable[Any]]:
        body = {"instance_id": job.instances[rank], "generation": 1, "event": "finished"}
        return lambda: job.post(f"/machines/{rank}/progress", body, 204)

    statements = await statements_of(root_app, *(finished(rank) for rank in range(machines - 4, machines)))
    assert [s for s in statements if s.startswith("update jobs")], "one of them tried to complete the job"
    locking = [s for s in statements if "for update" in s or "for no key update" in s]
    assert not locking, "no report waits for the job row's lock"
    fetched = await job.api("")
    assert fetched["state"] == "completed" and fetched["finished_at"] is not None
    done = await client.get(
        f"/api/v1/worker/jobs/{job.id}/directive", params={"after": revision}, headers=job.worker
    )
    assert done.json()["status"] == "finished"
    assert done.json()["revision"] == revision + 1, "the job was completed once: one new revision"


class LeaderSteps:
    """The leader's recovery steps, held while the test posts reports (`hold`), so that no step runs
    between them: a step may close a recovery as soon as every machine said "finished" (finished counts as
    resumed), and the test says which of the two checks (the reports' or the leader's) completes the job."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0
        real = RecoveryDriver.step

        async def step(driver: RecoveryDriver, job_id: Any) -> None:
            await self._open.wait()
            self._running += 1
            self._idle.clear()
            try:
                await real(driver, job_id)
            finally:
                self._running -= 1
                if not self._running:
                    self._idle.set()

        monkeypatch.setattr(RecoveryDriver, "step", step)

    async def hold(self) -> None:
        """No step starts from now on, and the one under way (if any) has ended."""
        self._open.clear()
        await self._idle.wait()

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def leader_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[LeaderSteps]:
    steps = LeaderSteps(monkeypatch)
    yield steps
    steps.release()  # a test that failed while holding them: the leader stops with the app


async def finished_while_recovering(client: httpx.AsyncClient, leader: LeaderSteps) -> tuple[Scenario, int]:
    """Training ends right after a recovery: every machine's "finished" arrives while the job is still
    recovering (machine 3's "resumed", sent in the background, comes after), so none of them can complete
    it. Returns with the leader's steps held."""
    job, failure_id = await restored_everywhere(client)
    await leader.hold()
    for rank in range(MACHINES - 1):
        await job.post(f"/machines/{rank}/progress", resumed(job, rank), 204)
    for rank in range(MACHINES):
        await job.post(f"/machines/{rank}/progress", finished(job, rank), 204)
    await job.post(f"/machines/{MACHINES - 1}/progress", resumed(job, MACHINES - 1), 204)
    assert (await job.api(""))["state"] == "recovering", "no step closed the recovery"
    return job, failure_id


async def test_a_job_whose_machines_finish_before_its_recovery_closes_completes(
    client: httpx.AsyncClient, leader_steps: LeaderSteps
) -> None:
    """The step that closes the recovery completes the job; before, it stayed running and every agent
    waited."""
    job, failure_id = await finished_while_recovering(client, leader_steps)
    leader_steps.release()

    fetched = await eventually(lambda: completed(job), "the job to complete")
    assert fetched["finished_at"] is not None
    assert (await job.api(f"/failures/{failure_id}"))["state"] == "recovered"
    directive = await client.get(f"/api/v1/worker/jobs/{job.id}/directive", headers=job.worker)
    assert directive.json()["status"] == "finished"


async def test_machines_restored_at_the_last_iteration_finish_without_resuming_and_the_job_completes(
    client: httpx.AsyncClient,
) -> None:
    """The recovery restored the job's last iteration: the training processes have nothing left to run and
    exit at once, so no machine ever says "resumed", only "finished". That ends the recovery (before, the
    machines were declared lost for not resuming in time, and a new recovery began) and completes the job."""
    job, failure_id = await restored_everywhere(client)
    for rank in range(MACHINES):
        await job.post(f"/machines/{rank}/progress", finished(job, rank), 204)

    await eventually(lambda: completed(job), "the job to complete")
    failure = await job.api(f"/failures/{failure_id}")
    assert failure["state"] == "recovered" and failure["resumed_at"] is not None, failure
    assert len(await job.api("/failures")) == 1, "no machine was declared lost"


async def test_a_machine_that_only_finished_ends_the_recovery_at_its_report(
    client: httpx.AsyncClient,
) -> None:
    """A machine restored at the last iteration says only "finished", after the others resumed: the
    recovery ends at its report, not at the last "resumed" (before, the failure's resumed_at was the
    others' last report, earlier than the recovery's real end)."""
    job, failure_id = await restored_everywhere(client)
    for rank in range(MACHINES - 1):
        await job.post(f"/machines/{rank}/progress", resumed(job, rank), 204)
    others_resumed = datetime.now(UTC)
    await asyncio.sleep(0.05)  # the clock moves on between the others' reports and the last machine's
    await job.post(f"/machines/{MACHINES - 1}/progress", finished(job, MACHINES - 1), 204)

    failure = await eventually(lambda: recovered(job, failure_id), "the failure to be recovered")
    last = datetime.fromisoformat(failure["details"]["resumed_reported_at"][str(MACHINES - 1)])
    assert last > others_resumed
    assert datetime.fromisoformat(failure["resumed_at"]) == last, failure


def restore_failed(job: Scenario, rank: int, generation: int) -> dict[str, Any]:
    return {
        "instance_id": job.instances[rank],
        "generation": generation,
        "event": "restore_failed",
        "details": {"error": "the source stopped answering"},
    }


async def test_a_restore_failure_counts_only_for_the_current_plan(client: httpx.AsyncClient) -> None:
    """A machine whose source died reports that its restore of plan 2 failed after plan 3 (the recovery
    from that source's loss) began: before, it counted as plan 3 failing and began plan 4. Of the current
    plan it is a failure of its own; after the job ended it is ignored."""
    job, _ = await restored_everywhere(client)
    await job.kill_process(2)
    await job.plan(3, "collecting")
    failures = len(await job.api("/failures"))
    await job.post("/machines/0/progress", restore_failed(job, 0, 2), 204)
    assert len(await job.api("/failures")) == failures
    await job.post("/machines/0/progress", restore_failed(job, 0, 3), 204)
    found = await job.api("/failures")
    assert len(found) == failures + 1
    assert any("could not restore: the source stopped answering" in f["cause"] for f in found)
    plans = [p["generation"] for p in await job.api("/recovery-plans")]
    assert max(plans) >= 3

    ended = await running_job(client, 2, prefix="e")
    assert (await client.post(f"/api/v1/jobs/{ended.id}/stop", headers=admin())).status_code == 200
    await ended.post("/machines/0/progress", restore_failed(ended, 0, 1), 204)
    assert await ended.api("/failures") == []


class FailingCompletionChecks:
    """The leader's completion check after a step's commit, failing for the drivers `failing` says (a
    database error between the two), counting the calls. The reports' own checks are left alone."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.failing: Callable[[RecoveryDriver], bool] = lambda driver: True
        self.calls = 0
        real = RecoveryDriver._complete_if_finished

        async def check(driver: RecoveryDriver, job_id: uuid.UUID) -> None:
            self.calls += 1
            if self.failing(driver):
                raise RuntimeError("the database went away after the step's commit")
            await real(driver, job_id)

        monkeypatch.setattr(RecoveryDriver, "_complete_if_finished", check)

    async def made(self, count: int) -> bool:
        return self.calls >= count


async def test_a_completion_check_that_fails_after_the_recovery_closed_is_retried(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, leader_steps: LeaderSteps
) -> None:
    checks = FailingCompletionChecks(monkeypatch)
    job, _ = await finished_while_recovering(client, leader_steps)
    leader_steps.release()
    await eventually(lambda: checks.made(2), "the leader to check twice")
    assert (await job.api(""))["state"] == "running", "every check so far failed"
    checks.failing = lambda driver: False
    await eventually(lambda: completed(job), "the job to complete")


async def test_a_new_leader_checks_every_active_job_for_completion(
    client: httpx.AsyncClient, root_app: FastAPI, monkeypatch: pytest.MonkeyPatch, leader_steps: LeaderSteps
) -> None:
    """The leader stopped between closing a recovery and checking the job (here: its checks keep failing):
    a successor checks every active job once, and completes this one."""
    checks = FailingCompletionChecks(monkeypatch)
    job, _ = await finished_while_recovering(client, leader_steps)
    leader_steps.release()
    orchestrator = root_app.state.castor.orchestrator
    await eventually(lambda: checks.made(1), "the closing step's check")
    assert (await job.api(""))["state"] == "running"
    successor = RecoveryDriver(
        orchestrator.leadership, orchestrator.per_job, orchestrator.settings, orchestrator.operator
    )
    checks.failing = lambda driver: driver is not successor
    driving = asyncio.create_task(successor.drive())
    try:
        await eventually(lambda: completed(job), "the new leader to complete the job")
    finally:
        driving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await driving


async def test_a_failure_carried_into_a_new_plan_restores_again(client: httpx.AsyncClient) -> None:
    """Every machine restored plan 2, then a process crashed before all resumed: the first failure moves
    to plan 3 with its restore to do again. Before, it kept plan 2's restore time, and plan 3's replacement
    and restore were booked as its warm-up."""
    job, first = await restored_everywhere(client)

    async def restored_at() -> Any:
        return next(f for f in await job.api("/failures") if f["id"] == first)["restored_at"]

    await eventually(restored_at, "plan 2's restore to be recorded on the failure")
    await job.kill_process(2)
    await job.plan(3, "collecting")
    assert await restored_at() is None
