"""A restore reports its failure only once every local rank's fetch has ended: before, the first failure
was reported at once (asyncio.gather) while another rank's fetch went on writing its local store in a
thread, and the next plan's restore could take the same slot beside it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from worker_lib.agent.agent import all_settled
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
