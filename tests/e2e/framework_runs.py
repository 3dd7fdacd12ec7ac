"""Shared by the framework callback tests (Lightning, Hugging Face Trainer): three runs of a workload in
tests/e2e/workloads, standalone (the Checkpointer's directory in /dev/shm, no root service): an
uninterrupted reference, a run that SIGKILLs itself after step `die_at`'s save() returned (its copy may
still be in flight), and a run of the same command that resumes from what the killed one left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tests.unit.worker_lib.helpers import assert_bit_equal

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240  # per run, on a host other jobs keep busy; an idle one takes a few seconds


def environment() -> dict[str, str]:
    """No hub access, and nothing of an agent or a recovery plan (standalone: the newest checkpoint)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASTOR_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def start(workload: str, tmp_path: Path, name: str, shm: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        str(REPO / "tests" / "e2e" / "workloads" / workload),
        f"--shm={shm}",
        f"--out={tmp_path / f'{name}.pt'}",
        *extra,
    ]
    log = (tmp_path / f"{name}.log").open("ab")
    return subprocess.Popen(command, cwd=REPO, env=environment(), stdout=log, stderr=subprocess.STDOUT)


def log_tail(tmp_path: Path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]


def wait(process: subprocess.Popen[bytes]) -> int:
    try:
        return process.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def check_resumes_bit_exact(
    workload: str,
    tmp_path: Path,
    *,
    steps: int,
    die_at: int,
    restored: tuple[int | None, ...] | None = None,
    **extra: str,
) -> None:
    """The resumed run ends with the reference's model, optimizer and scheduler states, bit for bit (and
    the same evaluations and best metric, when the workload writes them), and resumed from the killed run's
    last committed step: one of `restored`, by default die_at, or die_at - 1 when its copy was cut. `extra`:
    more options, `--name=value` (`--name` for an empty value); those ending in `_dir` get the run's name
    appended (`value/name`)."""
    shm_root = Path(tempfile.mkdtemp(prefix="castor-framework-", dir="/dev/shm"))
    try:

        def args(name: str) -> list[str]:
            options = [f"--{k.replace('_', '-')}" + (f"={v}" if v else "") for k, v in extra.items()]
            return [
                f"--steps={steps}",
                *(f"{o}/{name}" if o.split("=")[0].endswith("-dir") else o for o in options),
            ]

        # The reference and the run to kill at once (two cores), then the resumed run.
        reference = start(workload, tmp_path, "reference", shm_root / "reference", *args("reference"))
        killed = start(workload, tmp_path, "run", shm_root / "run", *args("run"), f"--die-at={die_at}")
        assert wait(killed) == -9, log_tail(tmp_path, "run")
        assert not (tmp_path / "run.pt").exists()
        resumed = start(workload, tmp_path, "run", shm_root / "run", *args("run"))
        assert wait(resumed) == 0, log_tail(tmp_path, "run")
        assert wait(reference) == 0, log_tail(tmp_path, "reference")

        expected: dict[str, Any] = torch.load(tmp_path / "reference.pt", weights_only=False)
        actual: dict[str, Any] = torch.load(tmp_path / "run.pt", weights_only=False)
        assert expected["restored_step"] is None, "the reference started fresh"
        assert actual["global_step"] == expected["global_step"] == steps
        for part in ("model", "optimizer", "scheduler"):
            assert_bit_equal(actual[part], expected[part], part)
        for part in ("evaluations", "best_metric"):
            assert actual.get(part) == expected.get(part), part
        assert actual["restored_step"] in (restored or (die_at - 1, die_at)), actual["restored_step"]
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)
