"""A completed or stopped job gives its shared memory back: the machine's directory, and the job's
directory above it once the last machine of the job on this host is gone; never a directory the user
chose above the machine's own."""

from __future__ import annotations

import uuid
from pathlib import Path

from worker_lib.agent.agent import free_shared_memory
from worker_lib.agent.holdings import Holdings


def test_the_last_machine_removes_the_jobs_directory(tmp_path: Path) -> None:
    job = str(uuid.uuid4())
    for job_dir in (tmp_path / "castor" / job, tmp_path / "local" / uuid.UUID(job).hex):  # default, operator
        first, second = Holdings(job_dir / "m0"), Holdings(job_dir / "m1")
        (first.root / "pids").mkdir(parents=True)
        second.root.mkdir(parents=True, exist_ok=True)
        free_shared_memory(first, job)
        assert not first.root.exists() and job_dir.exists(), "machine 1 still uses the job's directory"
        free_shared_memory(second, job)
        assert not job_dir.exists()


def test_a_directory_the_user_chose_stays(tmp_path: Path) -> None:
    chosen = tmp_path / "my-shm"
    holdings = Holdings(chosen / "machine-0")
    holdings.root.mkdir(parents=True, exist_ok=True)
    free_shared_memory(holdings, str(uuid.uuid4()))
    assert not holdings.root.exists() and chosen.exists()
