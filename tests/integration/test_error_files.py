"""A training process's uncaught exception reaches its exit report through torchelastic's error file.

Real processes under the agent's WorkerGroup: a warm start of a script without `@record` (the spare wraps
the script itself). A cold start of a script whose entry point has torchelastic's `@record` (what torchrun
users write), the whole way to the failure event, the failure page and the CLI:
tests/integration/cli/test_exceptions.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from worker_lib.agent.launcher import ERROR_FILE_ENV, LaunchSpec, ProcessExit, WorkerGroup, read_error_file

pytestmark = pytest.mark.slow

RAISES = """
import os


def load_batch(step):
    if step == 3:
        raise ValueError("boom 42")


def main():
    for step in range(5):
        load_batch(step)
"""

WITH_RECORD = (
    RAISES
    + """
from torch.distributed.elastic.multiprocessing.errors import record

record(main)()
"""
)
WITHOUT_RECORD = RAISES + "\nmain()\n"


def spec(tmp_path: Path, script: Path) -> LaunchSpec:
    return LaunchSpec(
        command=[sys.executable, str(script)],
        machine_rank=0,
        procs_per_machine=1,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29500,
        generation=1,
        restore_iteration=None,
        shm_dir_of={0: str(tmp_path / "shm")},
        notify_socket=str(tmp_path / "notify.sock"),
        job_id="job-error-files",
        extra_env={ERROR_FILE_ENV: str(tmp_path / "shared-error.json")},  # the launcher's own wins
    )


async def run_one(tmp_path: Path, source: str, *, warm: bool) -> ProcessExit:
    script = tmp_path / "train.py"
    script.write_text(source)
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=warm, pid_dir=tmp_path / "machine" / "pids")
    try:
        if warm:
            await group.prewarm(1)
            # Until the spare's torch import is done (a counter, no event to wait on): the start is warm.
            while group.warm_spares < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        await group.start(spec(tmp_path, script))
        return await asyncio.wait_for(exits.get(), timeout=120)
    finally:
        await group.stop()
        await group.discard_spares()


def check(ended: ProcessExit, tmp_path: Path) -> None:
    assert ended.exit_code == 1 and not ended.expected
    assert ended.error is not None, "no error file was read"
    assert ended.error["type"] == "ValueError"
    assert ended.error["message"] == "ValueError: boom 42"
    # The last frames: where it was raised, in the script's own function.
    assert "in load_batch" in ended.error["traceback"]
    assert 'raise ValueError("boom 42")' in ended.error["traceback"]
    # One file per process, beside pids/, never the one the environment named.
    written = tmp_path / "machine" / "errors" / "generation-1-rank-0.json"
    assert json.loads(written.read_text())["message"]["message"] == "ValueError: boom 42"
    assert not (tmp_path / "shared-error.json").exists()


async def test_warm_start_reports_the_exception_without_record(tmp_path: Path) -> None:
    check(await run_one(tmp_path, WITHOUT_RECORD, warm=True), tmp_path)


async def test_a_clean_or_killed_exit_carries_no_error(tmp_path: Path) -> None:
    ended = await run_one(tmp_path, "import sys\nsys.exit(3)\n", warm=False)
    assert ended.exit_code == 3 and ended.error is None


def test_read_error_file_takes_the_traceback_tail_and_plain_messages(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    frames = "".join(f'  File "x.py", line {n}, in f{n}\n' for n in range(2000))
    path.write_text(
        json.dumps({"message": {"message": "RuntimeError: x", "extraInfo": {"py_callstack": frames}}})
    )
    error = read_error_file(path)
    assert error is not None and error["traceback"].endswith("in f1999\n")
    assert len(error["traceback"]) <= 8010  # the last frames, within what the API accepts
    path.write_text(json.dumps({"message": "Signal 6 (SIGABRT) received by PID 7"}))
    assert read_error_file(path) == {
        "type": "",
        "message": "Signal 6 (SIGABRT) received by PID 7",
        "traceback": "",
    }
    path.write_text("not json")
    assert read_error_file(path) is None
    assert read_error_file(tmp_path / "missing.json") is None


def ended(pid: int) -> bool:
    """Whether process `pid` has exited: a zombie, or reaped already (asyncio's child watcher reaps in a
    thread of its own, and hands the exit to the event loop). A process reaped between the open and the read
    of its stat file fails the read with ESRCH (ProcessLookupError), not ENOENT: both are OSErrors."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("failed_first", [True, False])
async def test_a_process_that_failed_before_a_stop_is_no_expected_stop(
    tmp_path: Path, failed_first: bool
) -> None:
    # A recovery's stop can reach the agent before the exit of a process that failed on its own (its failure,
    # or a peer's it took down, set the recovery off): that exit still says why, and is reported.
    script = tmp_path / "train.py"
    script.write_text(WITH_RECORD if failed_first else "import time\ntime.sleep(60)\n")
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    group = WorkerGroup(exits, warm=False, pid_dir=tmp_path / "machine" / "pids")
    try:
        await group.start(spec(tmp_path, script))
        pid = int((tmp_path / "machine" / "pids" / "rank-0").read_text().split()[0])
        if failed_first:
            # Blocking the event loop: the exit is not seen until the stop has begun.
            deadline = time.monotonic() + 60
            while not ended(pid) and time.monotonic() < deadline:
                time.sleep(0.01)  # noqa: ASYNC251 (blocking on purpose, see above)
            assert ended(pid)
        await group.stop()
        process_exit = await asyncio.wait_for(exits.get(), timeout=30)
    finally:
        await group.stop()
    if failed_first:
        check(process_exit, tmp_path)  # exit code 1, the ValueError, and not expected
    else:
        assert process_exit.expected and process_exit.exit_code == -15 and process_exit.error is None
