"""Long polls parked until a job's next change (the directive, the replication alignment): one future per
waiting request in a per-job set, resolved by whoever announces the change."""

from __future__ import annotations

import asyncio
import uuid

Waiting = dict[uuid.UUID, set[asyncio.Future[None]]]


async def until_woken(waiting: Waiting, job_id: uuid.UUID, timeout_s: float) -> None:
    """Wait until a future of `waiting[job_id]` is resolved (a change announced) or `timeout_s` passed."""
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiting.setdefault(job_id, set()).add(waiter)
    try:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives as the
        # change is announced, and the request then polled on until its deadline (holding a server's stop).
        async with asyncio.timeout(max(0.0, timeout_s)):
            await waiter
    except TimeoutError:
        pass
    finally:
        waiters = waiting.get(job_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del waiting[job_id]


def wake(waiters: set[asyncio.Future[None]]) -> None:
    """Resolve the waiting requests' futures (those whose loop is still running)."""
    for waiter in waiters:
        if not waiter.done() and not waiter.get_loop().is_closed():
            waiter.set_result(None)
