"""A deposed leader's replacements under way stop with its driver: one waiting for an instance to come up
kept polling the Auto Scaling Group for up to the replacement timeout alongside the new leader's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.root.orchestration.leadership import Deposed
from services.root.orchestration.per_job import PerJob
from services.root.orchestration.recovery_driver import RecoveryDriver
from services.root.settings import Settings


class DeposedLeadership:
    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        raise Deposed("another replica raised the epoch")
        yield


async def test_the_driver_stops_its_replacements_when_the_leadership_ends(tmp_path: Path) -> None:
    settings = Settings(database_url="sqlite+aiosqlite://", state_dir=tmp_path, admin_token="x")
    driver = RecoveryDriver(DeposedLeadership(), PerJob(), settings, operator=None)  # type: ignore[arg-type]
    awaiting_instance = asyncio.create_task(asyncio.sleep(900))  # a replacement polling for its instance
    driver._tasks.add(awaiting_instance)
    await asyncio.wait_for(driver.drive(), 10)  # deposed at its first transaction
    assert awaiting_instance.cancelled()
