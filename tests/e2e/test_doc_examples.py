"""The complete programs of docs/training.md's "FSDP2 and sharded states" and "torch.distributed.checkpoint
(DCP)" sections, as a user copies them, run with torchrun on 2 processes over gloo: stopped partway and
run again, each resumes where it stopped and ends bit-exact with a run that was never stopped.

The only edits are the ones a test needs: fewer iterations, and for the DCP program an export directory of
its own. The run that resumes starts from another random seed, so a program that failed to restore (and
trained from scratch) would end elsewhere; its last checkpoint is compared, rank by rank, with the
uninterrupted run's by the manifest's content digest."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import REPO
from worker_lib.store.slots import SlotStore

RUN_TIMEOUT_S = 180  # one torchrun of 2 processes: about 5-15 s here
# Three runs per test, each bounded: the suite's 300 s per test would stop one whose runs were merely slow.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT_S + 60)]

GUIDE = REPO / "docs" / "training.md"
WORLD = 2
STOPPED_AT, ITERATIONS = 6, 12  # the first run's iterations, and every run's last


def complete_program(section: str) -> str:
    """The first Python block after "A complete program" in `section` of the guide."""
    text = GUIDE.read_text()
    start = text.index(f"\n## {section}\n")
    body = text[start : text.index("\n## ", start + 1)]
    found = re.search(r"A complete program.*?```python\n(.*?)```", body, re.DOTALL)
    assert found is not None, f"no complete program in {section!r}"
    return found.group(1)


def edited(program: str, iterations: int, seed: int, export_to: Path) -> str:
    for old, new in (
        (", 1000):", f", {iterations}):"),
        ("torch.manual_seed(0)", f"torch.manual_seed({seed})"),
    ):
        assert old in program, f"the guide's program no longer has {old!r}: update this test"
        program = program.replace(old, new)
    return program.replace('"/data/run-final"', repr(str(export_to)))


@pytest.fixture
def job_names() -> Iterator[list[str]]:
    """Job names for the runs' default shared-memory directories (/dev/shm/castor-<uid>/<job>), removed."""
    names: list[str] = []
    yield names
    base = Path("/dev/shm") / f"castor-{os.getuid()}"
    for name in names:
        shutil.rmtree(base / name, ignore_errors=True)
    with contextlib.suppress(OSError):
        base.rmdir()  # unless something else has a job there


def run(program: str, job: str, directory: Path) -> None:
    """The program under torchrun, as a user starts it: no agent, none of Castor's variables but the job's
    name. Its workers run in sessions of their own, so a run past RUN_TIMEOUT_S is stopped whole."""
    script = directory / f"program-{uuid.uuid4().hex[:6]}.py"
    script.write_text(program)
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("CASTOR_") and k not in ("RANK", "WORLD_SIZE")
    }
    env.update(CASTOR_JOB=job, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    torchrun = subprocess.Popen(
        [*command, str(script)], cwd=directory, env=env, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _, stderr = torchrun.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_workers(torchrun.pid)  # while torchrun lives: its pid and its children's are still theirs
        torchrun.kill()
        torchrun.communicate()
        raise
    assert torchrun.returncode == 0, stderr.decode()[-4000:]


def stop_workers(torchrun_pid: int) -> None:
    """Kill whatever torchrun left: its process group, and its workers' (each starts a session of its own)."""
    children = subprocess.run(
        ["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True
    ).stdout.split()
    for pid in [torchrun_pid, *map(int, children)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def last_digests(job: str) -> dict[int, tuple[int, str]]:
    """Per rank, the newest committed checkpoint's iteration and content digest."""
    base = Path("/dev/shm") / f"castor-{os.getuid()}" / job
    out: dict[int, tuple[int, str]] = {}
    for rank in range(WORLD):
        store = SlotStore(base / f"rank-{rank}")
        try:
            newest = store.committed()[0]
        finally:
            store.close()
        out[rank] = (newest.iteration, newest.digest)
    return out


@pytest.mark.parametrize("section", ["FSDP2 and sharded states", "torch.distributed.checkpoint (DCP)"])
def test_the_guides_program_resumes_bit_exact_where_it_stopped(
    section: str, tmp_path: Path, job_names: list[str]
) -> None:
    program = complete_program(section)
    whole, stopped = f"doc-whole-{uuid.uuid4().hex[:8]}", f"doc-stopped-{uuid.uuid4().hex[:8]}"
    job_names.extend([whole, stopped])

    run(edited(program, ITERATIONS, 0, tmp_path / "export-whole"), whole, tmp_path)
    run(edited(program, STOPPED_AT, 0, tmp_path / "export-stopped"), stopped, tmp_path)
    assert {iteration for iteration, _ in last_digests(stopped).values()} == {STOPPED_AT - 1}
    run(edited(program, ITERATIONS, 1, tmp_path / "export-resumed"), stopped, tmp_path)

    expected = last_digests(whole)
    assert {iteration for iteration, _ in expected.values()} == {ITERATIONS - 1}
    assert last_digests(stopped) == expected, "the resumed run ends where the uninterrupted one does"
    if "export_dcp" in program:
        assert (tmp_path / "export-resumed" / ".metadata").is_file(), "the export is a DCP directory"
