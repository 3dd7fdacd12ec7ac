"""How the root stops its background tasks (services/root/tasks.py): a task whose first cancellation was
swallowed (Python 3.11's asyncio.wait_for can) is cancelled again instead of hanging the shutdown, and a
commit's follow-up is not started once its engine is being disposed."""

from __future__ import annotations

import asyncio
import gc

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from services.root import tasks


class DeafOnce:
    """A task's body that swallows its first cancellation (as asyncio.wait_for can on Python 3.11)."""

    def __init__(self) -> None:
        self.cancellations = 0

    async def __call__(self) -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancellations += 1
                if self.cancellations > 1:
                    raise  # the second one gets through


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    deaf_once = DeafOnce()
    obedient = asyncio.create_task(asyncio.sleep(3600), name="obedient")
    deaf = asyncio.create_task(deaf_once(), name="deaf")
    await asyncio.sleep(0)  # both running
    await asyncio.wait_for(tasks.stopped(obedient, deaf), 10)
    assert obedient.cancelled() and deaf.cancelled() and deaf_once.cancellations == 2
    assert "deaf" in caplog.text and "obedient" not in caplog.text, "the log names the one still running"


async def test_a_stop_inside_a_stopped_task_still_stops_its_own_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's workers stop their helpers as they exit: the outer stop's second cancellation reaches the
    worker while it waits for a helper that swallowed its first one, and the helper must still stop."""
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)

    async def worker() -> None:
        helper = asyncio.create_task(DeafOnce()(), name="helper")
        try:
            await asyncio.sleep(3600)
        finally:
            await tasks.stopped(helper)

    running = asyncio.create_task(worker(), name="worker")
    await asyncio.sleep(0.01)
    helper = next(task for task in asyncio.all_tasks() if task.get_name() == "helper")
    await asyncio.wait_for(tasks.stopped(running), 10)
    assert running.cancelled() and helper.cancelled(), "the helper outlived its worker's stop"


async def test_the_outcome_of_a_task_whose_cleanup_raised_is_taken(caplog: pytest.LogCaptureFixture) -> None:
    async def failing_cleanup() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            raise RuntimeError("the rollback on the way out failed")

    task = asyncio.create_task(failing_cleanup())
    await asyncio.sleep(0)
    await tasks.stopped(task)
    del task
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_follow_up_of_a_commit_after_the_dispose_began_is_not_started() -> None:
    engine = create_async_engine("sqlite+aiosqlite://")
    ran: list[str] = []

    async def follow_up(name: str) -> None:
        ran.append(name)
        await asyncio.sleep(3600)

    tasks.start_after_commit(engine, follow_up("before"), "before")
    await asyncio.sleep(0)
    await tasks.stop_after_commit(engine)
    tasks.start_after_commit(engine, follow_up("after"), "after")  # closed, never run: no "never awaited"
    await asyncio.sleep(0)
    assert ran == ["before"]
    await engine.dispose()
