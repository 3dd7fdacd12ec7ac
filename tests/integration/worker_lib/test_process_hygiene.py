"""Training processes never see the worker token, die with their agent, and a restarted agent kills what a
previous one left running (only what is provably that machine's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker_lib.agent import die_with_parent
from worker_lib.agent.launcher import LaunchSpec, ProcessExit, WorkerGroup
from worker_lib.agent.stale import kill_stale, proc_stat, read_pid_file, record_pid

SECRET = "castor-job.0123.the-secret-of-this-test"

# Reports what the process sees: its environment as Python has it, and as /proc shows it to others.
REPORT = """
import json, os, sys
with open(sys.argv[1], "w") as out:
    json.dump({"environ": dict(os.environ), "proc": open("/proc/self/environ", "rb").read().decode(),
               "argv": sys.orig_argv}, out)
"""


@pytest.fixture(autouse=True)
def light_spares(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CASTOR_PRELOAD", "json")  # spares need not import torch for this
    yield


def alive(pid: int) -> bool:
    return proc_stat(pid) is not None  # a zombie counts as gone


def wait_gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def spec(command: list[str], shm_dir: Path) -> LaunchSpec:
    return LaunchSpec(
        command=command,
        machine_rank=0,
        procs_per_machine=1,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=1,
        generation=1,
        restore_iteration=None,
        shm_dir_of={0: str(shm_dir / "local" / "rank-0")},
        notify_socket="/nonexistent",
        job_id="hygiene-test",
        extra_env={},
    )


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_training_processes_never_see_the_worker_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm: bool
) -> None:
    monkeypatch.setenv("CASTOR_WORKER_TOKEN", SECRET)
    monkeypatch.setenv("CASTOR_WORKER_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("CASTOR_ADMIN_TOKEN", "castor-admin.the-operators-secret")
    script, out = tmp_path / "report.py", tmp_path / "out.json"
    script.write_text(REPORT)
    group = WorkerGroup(asyncio.Queue[ProcessExit](), warm=warm, pid_dir=tmp_path / "pids")
    await group.prewarm(1)
    try:
        await group.start(spec([sys.executable, str(script), str(out)], tmp_path))
        assert await group.wait() == [0]
    finally:
        await group.stop()
        await group.discard_spares()
    report = json.loads(out.read_text())
    assert ("worker_lib.agent.warm" in report["argv"]) == warm
    assert SECRET not in json.dumps(report), "the token reached the training process"
    assert "CASTOR_WORKER_TOKEN_FILE" not in report["environ"]
    assert "castor-admin.the-operators-secret" not in json.dumps(report)
    assert report["environ"]["RANK"] == "0", "the rest of the environment is there"
    # The pid file names the process with its start time.
    pid, started = read_pid_file(tmp_path / "pids" / "rank-0") or (0, None)
    assert pid > 0 and started is not None


def test_the_wrapper_execs_the_command_with_the_environment_it_was_given(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "ONLY": "this"}  # no LC_CTYPE: Python would add one (PEP 538)
    result = subprocess.run(die_with_parent.wrap(["env"], env), env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert dict(line.split("=", 1) for line in result.stdout.splitlines()) == env
    missing = subprocess.run(
        die_with_parent.wrap(["no-such-command-castor"], env), env=env, capture_output=True, text=True
    )
    assert missing.returncode == 127 and "no-such-command-castor" in missing.stderr


def test_the_wrapper_leaves_sigpipe_and_sigxfsz_to_the_command_as_a_direct_start_does() -> None:
    # Python (the wrapper) ignores both at startup, and exec keeps ignored signals ignored.
    command = ["sh", "-c", "grep SigIgn /proc/self/status; yes | head -1"]
    env = dict(os.environ)
    result = subprocess.run(
        die_with_parent.wrap(command, env), env=env, capture_output=True, text=True, timeout=30
    )
    ignored = int(result.stdout.split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), "SIGPIPE ignored"
    assert not ignored & (1 << (signal.SIGXFSZ - 1)), "SIGXFSZ ignored"
    assert result.stdout.splitlines()[-1] == "y" and "Broken pipe" not in result.stderr, result.stderr


def test_a_wrapped_process_dies_with_its_parent(tmp_path: Path) -> None:
    # The parent starts a child through the wrapper, says its pid, and waits; then it is killed (-9).
    parent_code = (
        "import subprocess, sys, os, time\n"
        "from worker_lib.agent import die_with_parent\n"
        "env = dict(os.environ)\n"
        "child = subprocess.Popen(die_with_parent.wrap(['sleep', '300'], env), env=env,"
        " start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10  # until the wrapper has become `sleep`
        while b"sleep" not in Path(f"/proc/{child}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child)
        parent.kill()
        parent.wait()
        assert wait_gone(child, timeout=5), "the child outlived its parent"
    finally:
        with_kill(child)


def test_a_wrapper_whose_parent_already_died_does_not_run_the_command() -> None:
    # Expected parent 1: not the test process, as if the agent had died before the signal was armed.
    script = die_with_parent.__file__
    result = subprocess.run([sys.executable, "-I", "-S", script, "1", "1", "--", "sleep", "300"], timeout=30)
    assert result.returncode == 128 + signal.SIGKILL


def with_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start_dummy(env_extra: dict[str, str] | None = None, args: list[str] | None = None) -> subprocess.Popen:
    code = "import time; time.sleep(300)"
    return subprocess.Popen(
        [sys.executable, "-c", code, *(args or [])],
        env={**os.environ, **(env_extra or {})},
        start_new_session=True,
    )


def test_stale_training_processes_of_this_machine_are_killed_and_nothing_else(tmp_path: Path) -> None:
    machine = tmp_path / "machine"
    pids = machine / "pids"
    pids.mkdir(parents=True)
    cold = start_dummy({"CASTOR_SHM_DIR": f"{machine}/local/rank-0"})  # a cold-started rank
    warm = start_dummy(args=["--machine", str(machine)])  # a warm-started rank's command line
    stranger = start_dummy()  # not ours at all
    other_machine = start_dummy({"CASTOR_SHM_DIR": f"{tmp_path}/other/local/rank-3"})
    recycled = start_dummy({"CASTOR_SHM_DIR": f"{machine}/local/rank-4"})  # ours, but not the recorded one
    processes = [cold, warm, stranger, other_machine, recycled]
    try:
        time.sleep(0.2)
        record_pid(pids / "rank-0", cold.pid)
        record_pid(pids / "rank-1", warm.pid)
        record_pid(pids / "rank-2", stranger.pid)
        record_pid(pids / "rank-3", other_machine.pid)
        stat = proc_stat(recycled.pid)
        assert stat is not None
        (pids / "rank-4").write_text(f"{recycled.pid} {stat.start_ticks - 1}\n")  # another start time

        killed = kill_stale(pids, machine)

        assert sorted(killed) == sorted([cold.pid, warm.pid])
        assert cold.wait(timeout=10) == -signal.SIGKILL and warm.wait(timeout=10) == -signal.SIGKILL
        for untouched in (stranger, other_machine, recycled):
            assert untouched.poll() is None, "a process that is not provably ours was killed"
        assert not list(pids.glob("rank-*")), "the stale pid files are gone"
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_what_remains_of_a_training_session_whose_leader_died_is_killed(tmp_path: Path) -> None:
    machine = tmp_path / "machine"
    (machine / "pids").mkdir(parents=True)
    # A training process (session leader) that forked a worker and then died: the worker lives on.
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!"],
        env={**os.environ, "CASTOR_SHM_DIR": f"{machine}/local/rank-0"},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    worker = int(leader.stdout.readline())
    leader.wait()
    (machine / "pids" / "rank-0").write_text(f"{leader.pid}\n")  # the old format: no start time
    try:
        assert alive(worker)
        assert kill_stale(machine / "pids", machine) == [worker]
        assert wait_gone(worker)
    finally:
        with_kill(worker)
