"""Background tasks the root starts, and how it stops them before it lets go of what they use.

Two kinds outlive the call that started them: the leader's workers (stopped with the leadership, see
orchestration.loop) and the follow-ups a commit starts on the engine it came from (a big job's counters
refreshed, a followed job's replication alignment read again: flows.machines, flows.alignment). The
database's dispose stops the latter first: one still running would use the disposed engine, which quietly
opens a new pool, and on SQLite take the file's write lock after the app stopped.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Coroutine
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

# A task still running this long after its cancellation is cancelled again: Python 3.11's asyncio.wait_for
# (which aetcd uses) can swallow a cancellation. Longer than one etcd call's 5 s deadline; a cleanup cut
# short (the leader lease's revoke, tried on each endpoint in turn) costs nothing: the lease expires.
RECANCEL_S = 6.0

# Weak: an engine nobody disposes of (a test's) is not kept alive by the tasks its commits once started.
_after_commit: weakref.WeakKeyDictionary[AsyncEngine, set[asyncio.Task[None]]] = weakref.WeakKeyDictionary()
_disposed: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()


async def stopped(*tasks: asyncio.Task[Any]) -> None:
    """Cancel `tasks` and wait until they have finished (their cleanup done), whatever they raised.

    Stops nest (the leader's workers stop their own helpers): a caller cancelled meanwhile (its own stop
    cancelling it again) passes the cancellation on to what it is stopping and still waits for it, then
    raises it. Otherwise a helper whose cancellation was swallowed would outlive the stop."""
    pending = set(tasks)
    interrupted: asyncio.CancelledError | None = None
    while pending:
        for task in pending:
            task.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        except asyncio.CancelledError as cancelled:
            interrupted = cancelled
            continue
        if pending:
            names = ", ".join(sorted(task.get_name() for task in pending))
            log.warning(
                "still running %.0fs after their cancellation: %s; cancelling again", RECANCEL_S, names
            )
    # All done: this takes their outcomes (asyncio.wait does not), so a task whose cleanup raised is not
    # logged as "exception was never retrieved" when it is collected.
    await asyncio.gather(*tasks, return_exceptions=True)
    if interrupted is not None:
        raise interrupted


def start_after_commit(engine: AsyncEngine, work: Coroutine[Any, Any, None], name: str) -> None:
    """Run `work`, which uses `engine`, in a task of its own until it returns or the engine is disposed."""
    if engine in _disposed:  # a commit that came after the shutdown began: nobody would stop its follow-up
        work.close()
        return
    task = asyncio.get_running_loop().create_task(work, name=name)
    running = _after_commit.setdefault(engine, set())
    running.add(task)
    task.add_done_callback(running.discard)


async def stop_after_commit(engine: AsyncEngine) -> None:
    """Stop what commits on `engine` started and have not finished: the engine is about to be disposed.
    For good: commits on it later (SQLAlchemy lets a disposed engine be used again) start no follow-up."""
    _disposed.add(engine)
    await stopped(*_after_commit.pop(engine, set()))
