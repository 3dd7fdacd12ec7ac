"""Failure injection on this host, for the demo, the end-to-end tests and the benchmarks: what a crashed
process or a lost machine looks like to Castor when "machines" are local agent processes.

Training processes are found through the pid files their agent keeps in the machine's shared-memory
directory (or the CASTOR_SHM_DIR in their environment), agents by the --instance-id on their command line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path


def pids_with_environ(marker: str) -> list[int]:
    """Processes whose environment contains `marker` (e.g. CASTOR_SHM_DIR=/dev/shm/castor/job/machine)."""
    return _scan("environ", marker.encode())


def pids_with_arguments(*arguments: str) -> list[int]:
    """Processes whose command line contains these consecutive arguments."""
    return _scan("cmdline", "\0".join(arguments).encode())


def _scan(what: str, needle: bytes) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{pid}/{what}").read_bytes():
                found.append(int(pid))
    return found


def training_pids(shm_dir: Path, rank: int | None = None) -> list[int]:
    """The training processes of the machine whose shared memory is `shm_dir` (of one rank, if given):
    the pid files its agent keeps, and processes started cold with that CASTOR_SHM_DIR."""
    pattern = f"rank-{rank}" if rank is not None else "rank-*"
    found = set()
    for pid_file in Path(shm_dir, "pids").glob(pattern):
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text().split()[0])  # "<pid> <start time>"
            if Path(f"/proc/{pid}").exists():
                found.add(pid)
    marker = f"CASTOR_SHM_DIR={shm_dir}" + (f"/local/rank-{rank}\0" if rank is not None else "")
    return sorted(found | set(pids_with_environ(marker)))


def kill(pids: list[int], signum: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def kill_training_process(shm_dir: Path, rank: int) -> list[int]:
    """A software failure: the training process of `rank` dies (SIGKILL); its machine stays."""
    pids = training_pids(shm_dir, rank)
    kill(pids)
    return pids


def lose_machine(shm_dir: Path, instance_id: str) -> None:
    """A hardware failure: the machine's agent and every training process die at once, its memory too.
    Everything is found first and killed together, so nothing keeps running orphaned for a moment."""
    doomed = (
        pids_with_arguments("--instance-id", instance_id)
        + training_pids(shm_dir)
        + pids_with_arguments("--machine", str(shm_dir))  # its warm spares
    )
    kill(doomed)
    kill(training_pids(shm_dir))  # anything that was starting while we looked
    shutil.rmtree(shm_dir, ignore_errors=True)
