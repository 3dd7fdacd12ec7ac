"""The leader's lease watch (etcd mode) returns only once its two helpers, the batch writer of lease events
and the sweep of keys that expired unwatched, have finished: the root's shutdown closes the etcd client and
disposes of the database right after the leader's work returns. Before, they were cancelled and left to
finish their cleanup (a transaction's rollback) beside the shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.root.orchestration.detection import Detectors
from services.root.orchestration.per_job import PerJob
from services.root.settings import Settings


class QuietCoordinator:
    """An etcd whose machine keys never change."""

    async def watch_machines(self) -> AsyncIterator[tuple[str, Any, Any]]:
        await asyncio.Event().wait()
        yield ("put", None, None)  # never reached: makes this an async generator, as the real one is


class Helper:
    """Stands in for one of the watch's helpers: runs until cancelled, then takes a moment to clean up."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cleaned_up = False

    async def __call__(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.05)  # a rollback, a connection returned to the pool
            self.cleaned_up = True


async def test_the_lease_watch_returns_after_its_helpers_finished(tmp_path: Path) -> None:
    settings = Settings(database_url="sqlite+aiosqlite://", state_dir=tmp_path, admin_token="x")
    detectors = Detectors(None, PerJob(), settings, None, QuietCoordinator())  # type: ignore[arg-type]
    apply, sweep = Helper(), Helper()
    detectors._apply_lease_events = apply  # type: ignore[method-assign]
    detectors._sweep_missing_keys = sweep  # type: ignore[method-assign]
    watch = asyncio.create_task(detectors.watch_leases())
    await asyncio.wait_for(asyncio.gather(apply.started.wait(), sweep.started.wait()), 10)
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    assert apply.cleaned_up and sweep.cleaned_up
