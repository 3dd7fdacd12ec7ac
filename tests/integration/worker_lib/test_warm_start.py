"""The agent starts a training command in a warm spare only when the spare is provably the interpreter the
command names: same executable, same prefix (a venv over the same base Python is another interpreter) and
the same startup environment. Otherwise the command runs as given, with its own interpreter."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker_lib.agent.launcher import LaunchSpec, ProcessExit, WorkerGroup

# Prints which interpreter runs it: its prefix, and how the process was started (a warm spare's command
# line is `python -m worker_lib.agent.warm`).
SCRIPT = """
import json, sys
with open(sys.argv[1], "w") as out:
    json.dump({"prefix": sys.prefix, "orig_argv": sys.orig_argv}, out)
"""


@pytest.fixture(scope="module")
def other_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second venv over the same base Python as ours: the same binary once symlinks are resolved, a
    different sys.prefix."""
    path = tmp_path_factory.mktemp("other") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


@pytest.fixture(autouse=True)
def light_spares(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CASTOR_PRELOAD", "json")  # spares need not import torch for this
    yield


def spec(command: list[str], extra_env: dict[str, str] | None = None) -> LaunchSpec:
    return LaunchSpec(
        command=command,
        machine_rank=0,
        procs_per_machine=1,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=1,
        generation=1,
        restore_iteration=None,
        shm_dir_of={0: "/nonexistent"},
        notify_socket="/nonexistent",
        job_id="warm-test",
        extra_env=extra_env or {},
    )


async def run_once(command: list[str], extra_env: dict[str, str] | None = None, warm: bool = True) -> dict:
    """Start `command` once through a WorkerGroup with a warm spare ready; what the script reported."""
    exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
    # The error files go beside the script's report (tmp_path), not into a temp dir nobody removes.
    group = WorkerGroup(exits, warm=warm, pid_dir=Path(command[-1]).parent / "pids")
    await group.prewarm(1)
    try:
        await group.start(spec(command, extra_env))
        assert await group.wait() == [0]
        report = {**read_report(command[-1]), "warm_starts": group._warm_starts}
        if group._warm_starts == 0:  # a command that never runs warm keeps no spares for restarts
            await group.prewarm(1)
            assert not group.warm and all(p.stdin is None or p.stdin.is_closing() for p in group._spares)
        return report
    finally:
        await group.stop()
        await group.discard_spares()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "which_python.py"
    path.write_text(SCRIPT)
    return path


def read_report(path: str) -> dict:
    return dict(json.loads(Path(path).read_text()))


def started_warm(report: dict) -> bool:
    return "worker_lib.agent.warm" in report["orig_argv"]


async def test_the_agents_own_interpreter_starts_warm(script: Path, tmp_path: Path) -> None:
    report = await run_once([sys.executable, str(script), str(tmp_path / "out.json")])
    assert report["warm_starts"] == 1 and started_warm(report)
    assert report["prefix"] == sys.prefix


async def test_another_venv_of_the_same_base_python_runs_its_own_interpreter(
    script: Path, tmp_path: Path, other_venv: Path
) -> None:
    python = other_venv / "bin" / "python"
    assert python.resolve() == Path(sys.executable).resolve(), "same base binary"  # noqa: ASYNC240
    report = await run_once([str(python), str(script), str(tmp_path / "out.json")])
    assert report["warm_starts"] == 0 and not started_warm(report)
    assert report["prefix"] == str(other_venv)
    assert report["orig_argv"][0] == str(python)


async def test_python_found_on_the_jobs_path_is_the_one_that_runs(
    script: Path, tmp_path: Path, other_venv: Path
) -> None:
    path = f"{other_venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    report = await run_once(["python", str(script), str(tmp_path / "out.json")], extra_env={"PATH": path})
    assert report["warm_starts"] == 0 and report["prefix"] == str(other_venv)


async def test_the_base_python_of_our_venv_is_not_our_interpreter(script: Path, tmp_path: Path) -> None:
    base = str(Path(sys.executable).resolve())  # noqa: ASYNC240
    report = await run_once([base, str(script), str(tmp_path / "out.json")])
    assert report["warm_starts"] == 0 and not started_warm(report)
    assert report["prefix"] == sys.base_prefix


async def test_a_different_startup_environment_starts_cold(script: Path, tmp_path: Path) -> None:
    report = await run_once(
        [sys.executable, str(script), str(tmp_path / "out.json")], extra_env={"PYTHONPATH": str(tmp_path)}
    )
    assert report["warm_starts"] == 0 and not started_warm(report)


async def test_warm_start_off_starts_cold(script: Path, tmp_path: Path) -> None:
    report = await run_once([sys.executable, str(script), str(tmp_path / "out.json")], warm=False)
    assert report["warm_starts"] == 0 and not started_warm(report)
