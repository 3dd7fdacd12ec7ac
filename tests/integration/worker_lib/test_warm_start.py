"""The agent starts a training command in a warm spare only when the spare is provably the interpreter the
command names: same executable, same prefix (a venv over the same base Python is another interpreter) and
the same startup environment. Otherwise the command runs as given, with its own interpreter."""

from __future__ import annotations

import asyncio
import contextlib
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


# What a script sees of how it was started: where its imports come from, its own path, its stdin.
FIDELITY_SCRIPT = """
import json, os, sys
try:
    import castor_test_helper
    helper = castor_test_helper.__file__
except ImportError as exc:
    helper = repr(exc)
stdin = os.fstat(0) if sys.stdin is not None else None
with open(sys.argv[-1], "w") as out:
    json.dump({"path0": sys.path[0], "file": __file__, "argv0": sys.argv[0], "argv": sys.argv,
               "helper": helper,
               "stdin": None if stdin is None else [stdin.st_dev, stdin.st_ino],
               "stdin_stream": None if sys.stdin is None else [sys.stdin.name, sys.stdin.mode,
                                                               sys.stdin.encoding, sys.stdin.errors],
               "input": None if sys.stdin is None else sys.stdin.read()}, out)
"""


@contextlib.contextmanager
def stdin_from(path: Path) -> Iterator[None]:
    """This process's fd 0 (the agent's stdin) reads `path` meanwhile."""
    saved = os.dup(0)
    with path.open("rb") as source:
        os.dup2(source.fileno(), 0)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)


@pytest.mark.parametrize("how", ["script", "module"])
async def test_a_warm_start_sees_what_a_cold_start_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # run/train.py links to real/train.py, beside which lies the module it imports.
    (tmp_path / "real").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "real" / "train.py").write_text(FIDELITY_SCRIPT)
    (tmp_path / "real" / "castor_test_helper.py").write_text("")
    (tmp_path / "run" / "train.py").symlink_to("../real/train.py")
    (tmp_path / "run" / "castor_test_main.py").write_text(FIDELITY_SCRIPT)
    monkeypatch.chdir(tmp_path / "run")
    entry = ["train.py"] if how == "script" else ["-m", "castor_test_main"]
    reports = {}
    for warm in (True, False):
        (tmp_path / "input").write_text(f"the agent's stdin ({warm})\n")
        out = tmp_path / f"out-{warm}.json"
        with stdin_from(tmp_path / "input"):
            reports[warm] = await run_once([sys.executable, *entry, str(out)], warm=warm)
        assert reports[warm].pop("warm_starts") == int(warm)
        assert reports[warm].pop("input") == f"the agent's stdin ({warm})\n"
        assert reports[warm].pop("argv")[1:] == [str(out)]
    assert reports[True] == reports[False]
    if how == "script":  # as CPython sets them: the link resolved for the path, not for __file__
        real = os.path.realpath(tmp_path / "real")  # noqa: ASYNC240
        assert reports[True]["path0"] == real
        assert reports[True]["helper"] == os.path.join(real, "castor_test_helper.py")
        assert reports[True]["file"] == str(tmp_path / "run" / "train.py")
    assert reports[True]["stdin_stream"][:2] == ["<stdin>", "r"]
    assert reports[True]["argv0"] == (
        "train.py" if how == "script" else str(tmp_path / "run" / "castor_test_main.py")
    )
