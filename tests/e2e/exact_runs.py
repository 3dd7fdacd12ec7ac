"""What the bit-exact resumption tests share (test_fsdp2.py, test_resume_exact.py): the same program run
uninterrupted on plain processes as the reference, and the comparison of a faulted run with it. Their
workloads log JSON events per rank like train_ddp.py ("start", "iteration" with the digest of the state
right after that iteration's step, "done" with the digest at the end)."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

from tests.e2e.cluster import REPO, read_events
from tests.harness import free_port


def uninterrupted_run(command: list[str], world: int, log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """`command` (which logs into `log_dir`) on `world` plain processes, no agent and no failure: the
    reference a faulted run must match. (Run before the cluster starts, not beside it: on a loaded 2-core
    host 8 more processes importing torch kept the root from listening within a minute.)"""
    port = free_port()
    shm = Path("/dev/shm") / f"castor-e2e-reference-{uuid.uuid4().hex[:8]}"
    processes = []
    try:
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "CASTOR_SHM_DIR": str(shm / f"rank-{rank}"),
            }
            processes.append(subprocess.Popen(command, cwd=REPO, env=env))
        codes = [process.wait(timeout=300) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(shm, ignore_errors=True)
    assert codes == [0] * world, f"the uninterrupted run failed: exit codes {codes}"
    return read_events(log_dir)


def final_digests(events: dict[int, list[dict[str, Any]]]) -> dict[int, dict[int, str]]:
    """Per rank, the digest after each iteration as the run finally computed it (a resumed run logs the
    iterations it trains again twice: the later one counts)."""
    return {
        rank: {e["iteration"]: e["digest"] for e in rank_events if e["event"] == "iteration"}
        for rank, rank_events in events.items()
    }


def check_same_as_reference(
    events: dict[int, list[dict[str, Any]]], reference: dict[int, list[dict[str, Any]]], iterations: int
) -> None:
    """Every rank's state after every iteration, and at the end, is bit-exact the reference's. A rank may
    log "done" more than once: a fault that strikes while it holds after the last iteration (or before its
    final barrier) restarts it from an older checkpoint, and it trains to the end again; the last counts."""
    expected = final_digests(reference)
    assert sorted(expected) == sorted(events) and all(len(d) == iterations for d in expected.values())
    assert final_digests(events) == expected
    for rank in events:
        done = events[rank][-1]
        assert done["event"] == "done", f"rank {rank} did not finish its last run: {done}"
        (reference_done,) = [e for e in reference[rank] if e["event"] == "done"]
        assert done["digest"] == reference_done["digest"], f"rank {rank}: final state differs"
