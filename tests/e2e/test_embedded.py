"""Embedded mode: training launched by plain torchrun calls worker_lib.attach(); local rank 0 runs the
machine's Castor services on a thread, checkpoints replicate to peers, and a relaunch after a crash resumes
every rank from the same iteration in shared memory.

(torchrun's own in-place restart, --max-restarts, cannot be used here: with torch 2.13 and gloo the
restarted workers fail to reconnect ("Gloo connectFullMesh failed ... Connection refused") even for a
script without Castor. The tests relaunch torchrun instead, which exercises the same restore path.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import WORKLOAD, LocalCluster, read_events
from tests.e2e.recovery_checks import check_consistent_restore
from tests.harness import free_port
from worker_lib.agent.holdings import Holdings

pytestmark = pytest.mark.slow


def torchrun(
    cluster: LocalCluster, tmp_path: Path, node: int, nodes: int, nproc: int, port: int, *extra: str
):  # type: ignore[no-untyped-def]
    env = {
        **os.environ,
        "CASTOR_ROOT_URL": cluster.root_urls,
        "CASTOR_JOB_ID": cluster.job["id"],
        "CASTOR_WORKER_TOKEN": cluster.job["worker_token"],
        "CASTOR_INSTANCE_ID": f"node-{node}",
        "CASTOR_AGENT_SHM_DIR": str(cluster.shm_base / f"node-{node}"),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=0",
        str(WORKLOAD),
        f"--log-dir={tmp_path / 'logs'}",
        "--embedded",
        *extra,
    ]
    log = (tmp_path / f"torchrun-{node}.log").open("wb")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def torchrun_logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(tmp_path.glob("torchrun-*.log")))


def test_torchrun_nodes_replicate_to_their_placement_peers(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.start_root()
    cluster.create_job(machines=2, replicas=2)
    port = free_port()
    runs = [torchrun(cluster, tmp_path, node, 2, 1, port, "--iterations=8") for node in range(2)]
    assert [run.wait(240) for run in runs] == [0, 0], torchrun_logs(tmp_path) + cluster.logs()
    machines = cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/machines")
    assert sorted((m["rank"], m["instance_id"]) for m in machines) == [(0, "node-0"), (1, "node-1")]
    for node in range(2):
        held = Holdings(cluster.shm_base / f"node-{node}")
        peer = 1 - node
        assert held.ranks("replica") == [peer], f"node {node} holds its group peer's checkpoints"
        source = Holdings(cluster.shm_base / f"node-{peer}")
        with (
            held.open_read(peer, tier="replica") as (replica, data),
            source.open_read(peer, tier="local") as (
                original,
                original_data,
            ),
        ):
            # Each machine replicated its last checkpoint before reporting that it finished, and served its
            # peer's until the job completed.
            assert replica.iteration == original.iteration == 7
            assert bytes(data) == bytes(original_data)
    assert cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}")["state"] == "completed"


def test_relaunch_after_a_crash_resumes_every_rank_from_one_iteration(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.start_root()
    cluster.create_job(machines=1, replicas=1, procs_per_machine=2)
    crashed = torchrun(cluster, tmp_path, 0, 1, 2, free_port(), "--iterations=14", "--crash-at=6")
    crashed.wait(240)  # rank 1 exits with 17 at iteration 6 (torchrun's own exit status varies)
    assert (tmp_path / "logs" / "crashed").exists()
    job_url = f"/api/v1/jobs/{cluster.job['id']}"
    assert cluster.api("GET", job_url)["state"] == "running", "a crash does not finish the job"
    run = torchrun(cluster, tmp_path, 0, 1, 2, free_port(), "--iterations=14", "--crash-at=6")
    assert run.wait(240) == 0, torchrun_logs(tmp_path) + cluster.logs()
    events = read_events(tmp_path / "logs")
    assert all(e[-1]["iteration"] == 13 for e in events.values()), "training finished after the restart"
    # Rank 1 crashed right after committing iteration 6; rank 0 may have committed 6 or not: the ranks
    # agree on the newest iteration both hold and resume from it together.
    iteration = check_consistent_restore(tmp_path / "logs", 2, reached=6, max_lost=1)
    assert iteration in (5, 6)
    # The crashed run did not finish the job; the relaunch did, every rank's Checkpointer closing cleanly.
    assert cluster.api("GET", job_url)["state"] == "completed"
    # The root saw the relaunch (a one-machine job is never declared lost on its silence alone) and the
    # failure ended when the relaunched training committed (or, at the latest, when the job completed).
    (failure,) = cluster.api("GET", f"{job_url}/failures")
    assert failure["kind"] == "software" and "relaunched" in failure["cause"], failure
    assert failure["state"] == "recovered" and failure["resumed_at"] is not None, failure
    # What the relaunch rolled back, as the relaunched ranks told it: from iteration 6 (rank 1's last commit)
    # to the one both resumed from, out of the machine's shared memory.
    assert (failure["tier"], failure["iterations_lost"]) == ("local", 6 - iteration), failure
