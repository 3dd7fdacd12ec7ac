"""Agents with real training processes (torch.distributed, gloo on CPU), several "machines" on this host."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from services.root.domain.placement import plan_placement
from tests import harness
from tests.e2e.cluster import WORKLOAD, LocalCluster, read_events, wait_until
from worker_lib import Checkpointer
from worker_lib.agent.holdings import Holdings

pytestmark = pytest.mark.slow

# No machine is lost in these tests: a generous REST heartbeat timeout keeps a 2-core host, busy starting
# five machines' training processes at once, from looking like a lost machine (3 s in the recovery tests).
QUIET_HEARTBEATS = {"heartbeat_timeout_s": "15"}


@pytest.mark.parametrize(("machines", "strategy"), [(4, "group"), (5, "mixed")])
def test_every_machine_holds_exactly_the_replicas_the_placement_says(
    cluster: LocalCluster, tmp_path: Path, machines: int, strategy: str
) -> None:
    iterations = 6
    cluster.start_root(**QUIET_HEARTBEATS)
    job = cluster.create_job(machines=machines, replicas=2)
    assert job["placement_strategy"] == strategy
    command = cluster.training_command(tmp_path / "logs", iterations=iterations)
    for index in range(machines):
        cluster.start_machine(index, command, rank=index)
    assert cluster.wait_for_machines(timeout=240) == [0] * machines, cluster.logs()

    events = read_events(tmp_path / "logs")
    assert sorted(events) == list(range(machines))
    assert all(e[-1]["iteration"] == iterations - 1 for e in events.values()), (
        "every rank saved every iteration"
    )

    placement = plan_placement(machines, 2)
    holdings = {m.index: Holdings(m.shm_dir) for m in cluster.machines}
    for machine, held in holdings.items():
        expected = set(placement.held_by(machine)) - {machine}
        assert set(held.ranks("replica")) == expected, f"machine {machine} holds the replicas of {expected}"
        assert held.ranks("local") == [machine]
        for rank in expected:
            with (
                held.open_read(rank, tier="replica") as (replica, replica_data),
                holdings[rank].open_read(rank, tier="local") as (source, source_data),
            ):
                assert replica.iteration == source.iteration == iterations - 1
                assert replica.digest == source.digest
                assert bytes(replica_data) == bytes(source_data), "bit-exact with the source"
        assert all(h.verified for h in held.inventory(verify_checksums=True))
    job_state = cluster.api("GET", f"/api/v1/jobs/{job['id']}")
    assert job_state["state"] == "completed"


def test_killed_training_process_is_reported_at_once_and_its_checkpoint_survives(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.start_root(**QUIET_HEARTBEATS)
    job = cluster.create_job(machines=2, replicas=2)
    command = cluster.training_command(tmp_path / "logs", iterations=10_000, sleep=0.2)
    for index in range(2):
        cluster.start_machine(index, command, rank=index)
    events = wait_until(
        lambda: (e := read_events(tmp_path / "logs")) and len(e.get(1, [])) >= 4 and e, 180, "four iterations"
    )
    os.kill(events[1][-1]["pid"], signal.SIGKILL)
    killed_at = time.time()
    # The survivor's gloo error can reach the root first and open the event; the killed rank's exit joins
    # it a moment later and becomes its cause (failures.join_exit): wait for that, not for any event.
    reported = wait_until(
        lambda: next(
            (
                e
                for e in cluster.api("GET", f"/api/v1/jobs/{job['id']}/failures")
                if e["rank"] == 1 and "SIGKILL" in e["cause"]
            ),
            None,
        ),
        10,
        "a failure event of rank 1's SIGKILL",
    )
    assert reported["kind"] == "software", reported
    detected = datetime.fromisoformat(reported["detected_at"]).timestamp()
    assert detected - killed_at < 2.0, "reported at once, not after a heartbeat timeout"

    # The checkpoint lives in the agent's shared memory, not in the dead process: intact and restorable.
    logged = {
        e["iteration"]: e["digest"] for e in read_events(tmp_path / "logs")[1] if e["event"] == "iteration"
    }
    restored = Checkpointer(cluster.machines[1].shm_dir / "local" / "rank-1").restore()
    assert restored is not None and restored.iteration >= max(logged) - 1
    assert restored.state["iteration"] == restored.iteration


def test_unmodified_torchrun_code_runs_under_the_agent(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.start_root(**QUIET_HEARTBEATS)
    cluster.create_job(machines=2, replicas=2, procs_per_machine=2)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, str(Path(WORKLOAD).with_name("plain_torchrun.py")), str(out)]
    for index in range(2):
        cluster.start_machine(index, command, rank=index)
    assert cluster.wait_for_machines(timeout=180) == [0, 0], cluster.logs()
    seen = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(s["sum_of_ranks"] == 6.0 for s in seen.values()), "all four ranks met in one process group"
    assert seen[3]["env"] == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
    }


def test_an_agent_that_was_replaced_while_unreachable_stops(
    cluster: LocalCluster, tmp_path: Path, etcd_server: harness.Etcd
) -> None:
    """etcd mode has no heartbeat reply to say "replaced": the directive tells the agent that its rank now
    belongs to another instance, and it stops instead of training as a second rank 1."""
    cluster.start_root(
        etcd_endpoints=etcd_server.endpoint, etcd_prefix=f"/castor-{uuid.uuid4().hex[:8]}", lease_ttl_s="1"
    )
    job = cluster.create_job(machines=2, replicas=2)
    command = cluster.training_command(tmp_path / "logs", iterations=100_000, sleep=0.2)
    machines = [cluster.start_machine(index, command, rank=index) for index in range(2)]
    wait_until(lambda: len(read_events(tmp_path / "logs").get(1, [])) >= 3, 180, "training")

    os.kill(machines[1].process.pid, signal.SIGSTOP)  # unreachable: its etcd lease expires
    try:
        wait_until(
            lambda: any(
                m["rank"] == 1 and m["state"] == "failed"
                for m in cluster.api("GET", f"/api/v1/jobs/{job['id']}/machines")
            ),
            30,
            "machine 1 declared failed",
        )
        registered = httpx.post(
            f"{cluster.roots[0].url}/api/v1/worker/jobs/{job['id']}/machines",
            json={"instance_id": "machine-1b", "address": "127.0.0.1", "data_port": 9, "rank": 1},
            headers={"Authorization": f"Bearer {job['worker_token']}"},
        )
        assert registered.status_code == 200 and registered.json()["rank"] == 1, registered.text
    finally:
        os.kill(machines[1].process.pid, signal.SIGCONT)
    assert machines[1].process.wait(60) == 1
    assert "this machine was replaced" in machines[1].log_path.read_text()


def test_a_signalled_agent_forwards_it_to_training_and_exits_with_its_status(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """SIGTERM to an agent (the agent's STOPPING state): its training processes get the signal, and the
    agent exits with their status (a process killed by SIGTERM: 128 + 15, as a shell says it)."""
    cluster.start_root(**QUIET_HEARTBEATS)
    cluster.create_job(machines=1, replicas=1)
    command = cluster.training_command(tmp_path / "logs", iterations=100_000, sleep=0.2)
    machine = cluster.start_machine(0, command, rank=0)
    events = wait_until(
        lambda: (e := read_events(tmp_path / "logs")) and len(e.get(0, [])) >= 2 and e, 180, "training"
    )
    trainer = events[0][-1]["pid"]
    # The agent notices the commits on its own schedule: two iterations in, it may still be resuming (a
    # fresh-clone run signalled it there). The RUNNING state is the one this test stops.
    wait_until(lambda: "-> RUNNING" in machine.log_path.read_text(), 60, "the agent running")
    os.kill(machine.process.pid, signal.SIGTERM)
    assert machine.process.wait(60) == 128 + signal.SIGTERM, cluster.logs()
    log = machine.log_path.read_text()
    assert "received SIGTERM: stopping training" in log and "RUNNING -> STOPPING" in log, log
    with pytest.raises(ProcessLookupError):
        os.kill(trainer, 0)


def test_a_hung_training_process_is_stopped_with_its_stacks_and_the_job_recovers(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Rank 1 stops in an endless wait after committing iteration 4 (alive, silent; rank 0 then blocks in
    the next all-reduce, for gloo's 30 minutes). Machine 1's hang watchdog (10 s here) asks it for its stacks,
    kills it and reports a failure that says why and where it hung; the job recovers from memory and
    completes. Machine 0's watchdog is off, so the only hang reported is rank 1's. The limit is 10 s, not
    less: a fixed limit must exceed the slowest iteration, and a loaded 2-core host can stall one for
    seconds."""
    cluster.start_root(**QUIET_HEARTBEATS)
    job = cluster.create_job(machines=2, replicas=2)
    command = cluster.training_command(tmp_path / "logs", iterations=12, sleep=0.1, hang_at=4)
    cluster.start_machine(0, command, rank=0, extra_args=["--hang-timeout=0"])
    cluster.start_machine(1, command, rank=1, extra_args=["--hang-timeout=10"])
    assert cluster.wait_for_machines(timeout=240) == [0, 0], cluster.logs()

    (failure,) = cluster.api("GET", f"/api/v1/jobs/{job['id']}/failures")
    assert failure["kind"] == "software" and failure["rank"] == 1, failure
    assert "hang watchdog" in failure["cause"] and "after iteration 4" in failure["cause"], failure["cause"]
    error = failure["details"]["error"]
    assert error["type"] == "Hung"
    assert "_stuck_in_a_deadlock" in error["traceback"], "the hung process's own stack, from faulthandler"
    restarts = [e for e in read_events(tmp_path / "logs")[1] if e["event"] == "start"]
    assert [e["restored"] for e in restarts] == [None, 4], "resumed from the iteration it hung after"
    assert cluster.api("GET", f"/api/v1/jobs/{job['id']}")["state"] == "completed"
