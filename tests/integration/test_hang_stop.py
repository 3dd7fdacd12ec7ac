"""The hang watchdog's action on a real process (WorkerGroup.stop_hung): the stacks, then the kill, and an
exit report that says why and where it hung. Warm starts get the stack dump from the spare, cold starts from
the training side's agent notifier (what a Checkpointer creates). The whole way through an agent, the root
and a recovery: tests/e2e/test_agents.py."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.integration.test_error_files import spec
from worker_lib.agent.launcher import ProcessExit, WorkerGroup

pytestmark = pytest.mark.slow

HANGS = """
import time
from pathlib import Path

from worker_lib.agent_ipc import AgentNotifier


def waiting_for_a_peer_that_never_answers(ready):
    ready.write_text("stuck")
    while True:
        time.sleep(0.5)


AgentNotifier.from_environment(0, Path("."))
waiting_for_a_peer_that_never_answers(Path({ready!r}))
"""


async def stop_a_hung_process(tmp_path: Path, *, warm: bool) -> ProcessExit:
    ready = tmp_path / "ready"
    script = tmp_path / "train.py"
    script.write_text(HANGS.format(ready=str(ready)))
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=warm, pid_dir=tmp_path / "machine" / "pids")
    try:
        if warm:
            await group.prewarm(1)
            while group.warm_spares < 1:  # noqa: ASYNC110 - a counter, no event to wait on
                await asyncio.sleep(0.1)
        await group.start(spec(tmp_path, script))
        async with asyncio.timeout(120):
            while not ready.exists():  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert await group.stop_hung(0, "rank 0 committed no checkpoint for 9 s")
        return await asyncio.wait_for(exits.get(), timeout=60)
    finally:
        await group.stop()
        await group.discard_spares()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_a_hung_process_is_killed_and_reported_with_its_stacks(tmp_path: Path, warm: bool) -> None:
    ended = await stop_a_hung_process(tmp_path, warm=warm)
    assert ended.exit_code == -signal.SIGKILL
    assert not ended.expected, "a failure, not a stop the agent asked for"
    assert ended.error is not None
    assert ended.error["type"] == "Hung"
    assert ended.error["message"] == "Hung: rank 0 committed no checkpoint for 9 s"
    # faulthandler's dump: where the process was stuck, most recent call first.
    assert "in waiting_for_a_peer_that_never_answers" in ended.error["traceback"], ended.error["traceback"]


async def test_stopping_a_rank_that_does_not_run_here_does_nothing(tmp_path: Path) -> None:
    group = WorkerGroup(asyncio.Queue[ProcessExit](), warm=False, pid_dir=tmp_path / "pids")
    assert not await group.stop_hung(0, "nothing started yet")
