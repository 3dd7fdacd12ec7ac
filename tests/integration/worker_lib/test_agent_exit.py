"""A stopping agent does not wait for what cannot answer: a warm spare still importing its modules reads its
order (an empty one: "exit") only once the imports are done, which on a busy machine took longer than the
local operator's grace (the demo's Ctrl-C waited for it), and never ends when an import hangs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from worker_lib.agent.launcher import ProcessExit, WorkerGroup

# An import that never ends (a stand-in for torch importing on a saturated host, or a CUDA init that hangs);
# it says when it has started, so the test stops the spare while it is importing.
SLOW_MODULE = """
import pathlib, time
pathlib.Path({marker!r}).write_text("importing")
time.sleep(3600)
"""


async def until(condition: object, what: str, within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def test_a_spare_still_importing_is_killed_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "importing"
    (tmp_path / "castor_test_endless_import.py").write_text(SLOW_MODULE.format(marker=str(marker)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("CASTOR_PRELOAD", "castor_test_endless_import")
    group = WorkerGroup(asyncio.Queue[ProcessExit](), pid_dir=tmp_path / "pids")
    await group.prewarm(1)
    spare = group._spares[0]
    try:
        await until(marker.exists, "the spare to start importing")
        assert group.warm_spares == 0
        # Before the fix this waited for the import to end (an hour here).
        await asyncio.wait_for(group.discard_spares(), 60)
        assert spare.returncode is not None and spare.returncode < 0, "killed"
        assert group._spares == []
    finally:
        if spare.returncode is None:
            spare.kill()
            await spare.wait()


async def test_a_warm_spare_still_exits_on_its_empty_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CASTOR_PRELOAD", "json")
    group = WorkerGroup(asyncio.Queue[ProcessExit](), pid_dir=tmp_path / "pids")
    await group.prewarm(1)
    spare = group._spares[0]
    await until(lambda: group.warm_spares == 1, "the spare to be warm")
    await asyncio.wait_for(group.discard_spares(), 60)
    assert spare.returncode == 0, "told to exit, not killed"
