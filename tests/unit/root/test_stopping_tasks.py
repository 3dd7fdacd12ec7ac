"""How the root stops its background tasks (services/root/tasks.py): a task whose first cancellation was
swallowed (Python 3.11's asyncio.wait_for can) is cancelled again instead of hanging the shutdown, and a
commit's follow-up is not started once its engine is being disposed."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from services.root import tasks


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    cancellations = 0

    async def deaf_once() -> None:
        nonlocal cancellations
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancellations += 1
                if cancellations > 1:
                    raise  # the second one gets through

    obedient = asyncio.create_task(asyncio.sleep(3600), name="obedient")
    deaf = asyncio.create_task(deaf_once(), name="deaf")
    await asyncio.sleep(0)  # both running
    await asyncio.wait_for(tasks.stopped(obedient, deaf), 10)
    assert obedient.cancelled() and deaf.cancelled() and cancellations == 2
    assert "deaf" in caplog.text and "obedient" not in caplog.text, "the log names the one still running"


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
