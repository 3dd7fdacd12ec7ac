"""A restore reports its failure only once every local rank's fetch has ended: before, the first failure
was reported at once (asyncio.gather) while another rank's fetch went on writing its local store in a
thread, and the next plan's restore could take the same slot beside it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker_lib.agent.agent import all_settled, cancel_and_wait
from worker_lib.errors import CheckpointNotFoundError


def test_the_first_failure_is_raised_once_every_fetch_has_ended() -> None:
    slow_done = threading.Event()

    def slow_fetch() -> str:
        time.sleep(0.3)  # a multi-GB copy from a peer, in a thread
        slow_done.set()
        return "rank 1"

    async def failing_fetch() -> str:
        raise CheckpointNotFoundError("rank 0: the source stopped answering")

    async def main() -> None:
        with pytest.raises(CheckpointNotFoundError, match="rank 0"):
            await all_settled([failing_fetch(), asyncio.to_thread(slow_fetch)])
        assert slow_done.is_set(), "the failure was raised while a fetch still ran"
        assert await all_settled([asyncio.sleep(0, "a"), asyncio.sleep(0.01, "b")]) == ["a", "b"]

    asyncio.run(main())


def test_a_stopping_agent_waits_a_bounded_time_for_a_loop_that_outlives_its_cancellation() -> None:
    let_go = False

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if let_go:
                    raise
                # else: what a loop does whose wait swallowed the cancellation

    async def main() -> None:
        nonlocal let_go
        loop = asyncio.get_running_loop()
        polite = asyncio.create_task(asyncio.sleep(10), name="polite")
        stuck_task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        started = loop.time()
        stuck = await cancel_and_wait([polite, stuck_task], 0.2)
        assert loop.time() - started < 5, "the wait was not bounded"
        assert stuck == {stuck_task} and polite.cancelled()
        assert await cancel_and_wait([], 0.2) == set()
        let_go = True
        stuck_task.cancel()
        await asyncio.gather(stuck_task, return_exceptions=True)

    asyncio.run(main())
