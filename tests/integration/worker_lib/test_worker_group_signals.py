"""A signal reaches every training process, those a start in progress launches included, and the agent's
wait for them ends; stopping a generation also stops what a process that already died left in its group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

from worker_lib.agent.launcher import LaunchSpec, ProcessExit, WorkerGroup
from worker_lib.agent.stale import proc_stat


def spec(command: list[str], procs: int, tmp_path: Path) -> LaunchSpec:
    return LaunchSpec(
        command=command,
        machine_rank=0,
        procs_per_machine=procs,
        world_size=procs,
        master_addr="127.0.0.1",
        master_port=1,
        generation=1,
        restore_iteration=None,
        shm_dir_of={rank: str(tmp_path / f"rank-{rank}") for rank in range(procs)},
        notify_socket="/nonexistent",
        job_id="signals-test",
        extra_env={},
    )


async def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while proc_stat(pid) is not None:  # a zombie counts as gone
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_signal_while_starting_reaches_every_process_and_the_wait_ends(tmp_path: Path) -> None:
    group = WorkerGroup(asyncio.Queue[ProcessExit](), warm=False, pid_dir=tmp_path / "pids")
    launch = group._launch
    launched: list[asyncio.subprocess.Process] = []
    waits: list[asyncio.Future[list[int]]] = []

    async def launch_and_signal_meanwhile(spec: LaunchSpec, local_rank: int) -> asyncio.subprocess.Process:
        launching = asyncio.ensure_future(launch(spec, local_rank))
        if local_rank == 1:  # the agent's SIGTERM comes while rank 1 is being launched
            await asyncio.sleep(0)
            group.signal(signal.SIGTERM)  # ForwardSignal
            waits.append(asyncio.ensure_future(group.wait()))  # ExitAfterWorkers
        process = await launching
        launched.append(process)
        return process

    group._launch = launch_and_signal_meanwhile  # type: ignore[method-assign]
    try:
        await group.start(spec(["sleep", "30"], 4, tmp_path))
        # Before the fix: "dictionary changed size during iteration", and ranks 1..3 kept running.
        codes = await asyncio.wait_for(waits[0], 10)
        assert len(launched) >= 2
        assert [p.returncode for p in launched] == [-signal.SIGTERM] * len(launched), "every one got it"
        assert codes == [-signal.SIGTERM] * len(launched)
    finally:
        await group.stop(1)
        for process in launched:
            with contextlib.suppress(ProcessLookupError):
                process.kill()


async def test_stop_stops_the_group_of_a_process_that_already_died(tmp_path: Path) -> None:
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=False, pid_dir=tmp_path / "pids")
    helper_file = tmp_path / "helper"
    # A training process that started a helper (a data loader worker) and was then SIGKILLed (an OOM kill).
    command = ["sh", "-c", f"sleep 300 & echo $! > {helper_file}; kill -9 $$"]
    helper = 0
    try:
        await group.start(spec(command, 1, tmp_path))
        ended = await asyncio.wait_for(exits.get(), 10)
        assert ended.exit_code == -signal.SIGKILL
        helper = int(helper_file.read_text())
        assert proc_stat(helper) is not None, "the helper outlived its process"
        await group.stop(1)  # the recovery's StopWorkers
        assert await gone(helper, 5), "the helper outlived the stop"
    finally:
        await group.stop(1)
        if helper:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


async def test_stop_kills_a_helper_that_ignores_sigterm_after_its_process_died(tmp_path: Path) -> None:
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=False, pid_dir=tmp_path / "pids")
    helper_file = tmp_path / "helper"
    # The helper says its pid once it ignores SIGTERM; only then does its process die.
    helper_script = f"trap '' TERM; echo \\$$ > {helper_file}; sleep 300"  # its own pid, not the outer's
    command = [
        "sh",
        "-c",
        f'sh -c "{helper_script}" & while [ ! -s {helper_file} ]; do sleep 0.01; done; kill -9 $$',
    ]
    helper = 0
    try:
        await group.start(spec(command, 1, tmp_path))
        await asyncio.wait_for(exits.get(), 10)
        helper = int(helper_file.read_text())
        await group.stop(1)
        assert await gone(helper, 5), "a helper that ignores SIGTERM outlived the stop"
    finally:
        await group.stop(1)
        if helper:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


async def test_a_reaped_leaders_pid_taken_by_another_process_is_not_signalled(tmp_path: Path) -> None:
    """Once a finished rank's group is empty, its id may be another process's pid and group (a warm spare,
    another agent's rank): that group is a stranger's and gets no signal."""
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=False, pid_dir=tmp_path / "pids")
    stranger = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
    try:
        await group.start(spec(["true"], 1, tmp_path))
        await asyncio.wait_for(exits.get(), 10)
        (finished,) = group._processes.values()
        assert finished.returncode == 0
        finished.pid = stranger.pid  # as if the kernel handed the reaped leader's pid to the stranger  # type: ignore[misc]
        group.signal(signal.SIGTERM)
        await group.stop(1)
        await asyncio.sleep(0.2)
        assert stranger.returncode is None and proc_stat(stranger.pid) is not None
    finally:
        stranger.kill()
        await stranger.wait()
