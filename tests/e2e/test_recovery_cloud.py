"""Recovery with the production-shaped parts: two root replicas on Postgres with etcd leader election and
etcd heartbeats, and the AWS operator against a moto server (Auto Scaling Group replacement, S3 tier)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests import harness
from tests.aws_group import create_group, group_instances, instance_state
from tests.e2e.cluster import LocalCluster, PortTaken, wait_until
from tests.e2e.recovery_checks import (
    check_consistent_restore,
    check_event,
    kill_training_process,
    newest_iteration,
    recovered_events,
    replicated_iteration,
    wait_for_iteration,
    wait_for_pause,
)

pytestmark = pytest.mark.slow

PAUSE = 8  # --pause-at: every rank waits after this iteration's save (no multiple of persist_every)


def leader(cluster: LocalCluster) -> int | None:
    for index, root in enumerate(cluster.roots):
        if root.process.poll() is not None:
            continue
        try:
            if httpx.get(root.url + "/healthz", timeout=2).json()["leader"]:
                return index
        except httpx.HTTPError:
            continue
    return None


def start_two_roots(
    cluster: LocalCluster, postgres_server: harness.Postgres, etcd_server: harness.Etcd
) -> None:
    """Two root replicas, each told the other's URL, so both ports are chosen before either root starts.
    free_port() only finds a port free: until the second root binds its own, another process (an outgoing
    connection's ephemeral port) may take it, and start_root re-raises PortTaken for a port the test chose.
    Then stop what started and choose both again (a fresh database and etcd prefix: nothing of the first
    try's roots lingers)."""
    for attempt in range(3):
        database = postgres_server.create_database(f"ha_{uuid.uuid4().hex[:8]}")
        ports = [harness.free_port(), harness.free_port()]
        shared = {
            "database_url": database,
            "etcd_endpoints": etcd_server.endpoint,
            "etcd_prefix": f"/castor-{uuid.uuid4().hex[:8]}",
            "root_urls": ",".join(f"http://127.0.0.1:{p}" for p in ports),
            "lease_ttl_s": "1",
        }
        try:
            for port in ports:
                cluster.start_root(port=port, **shared)
            return
        except PortTaken:
            for root in cluster.roots:
                root.stop()
            cluster.roots.clear()
            if attempt == 2:
                raise


def test_root_leader_loss_does_not_stop_training_and_a_later_failure_is_recovered(
    cluster: LocalCluster, tmp_path: Path, postgres_server: harness.Postgres, etcd_server: harness.Etcd
) -> None:
    logs = tmp_path / "logs"
    start_two_roots(cluster, postgres_server, etcd_server)
    first = wait_until(lambda: (found := leader(cluster)) is not None and [found], 30, "a leader")[0]
    cluster.roots = [cluster.roots[first], cluster.roots[1 - first]]  # create the job through the leader
    cluster.launch_job(cluster.training_command(logs, iterations=100_000, sleep=0.2), machines=4, replicas=2)
    cluster.wait_until_warm()
    wait_for_iteration(logs, 3)

    cluster.roots[0].kill()  # the leader dies (SIGKILL): no clean hand-over
    killed_at, before = time.monotonic(), newest_iteration(logs)
    wait_until(lambda: leader(cluster) == 1, 30, "the other replica to take over")
    takeover_s = time.monotonic() - killed_at
    assert takeover_s < 10, f"leadership moved in {takeover_s:.1f}s"
    wait_for_iteration(logs, before + 10)  # training went on without a leader, and goes on under the new one
    assert cluster.failures() == [], "losing the root is not a training failure"
    # The job's counters come from the summaries the agents keep in etcd (no REST heartbeats here).
    counted = wait_until(
        lambda: (j := cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}"))["newest_iteration"] and j,
        30,
        "job counters from etcd heartbeats",
    )
    assert counted["checkpoints_committed"] > 0 and counted["checkpoints_per_minute"]

    kill_training_process(logs, rank=2)
    reached = newest_iteration(logs)
    (event,) = recovered_events(cluster, 1)
    check_event(event, kind="software", tier="local")
    check_consistent_restore(logs, 4, reached, max_lost=1)


async def test_aws_replaces_the_failed_instance_through_its_auto_scaling_group(
    cluster: LocalCluster, tmp_path: Path, moto_server: harness.Moto
) -> None:
    logs = tmp_path / "logs"
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 2)
    cluster.start_root(
        cloud="aws",
        asg_name=group,
        aws_endpoint_url=moto_server.url,
        s3_bucket=group,
        s3_endpoint_url=moto_server.url,
    )
    cluster.create_job(machines=2, replicas=2, persist_every=5)
    command = cluster.training_command(logs, iterations=100_000, sleep=0.2, pause_at=PAUSE)
    # Each instance's boot script starts the agent with the instance id as the machine's identity.
    for rank, instance in enumerate(instances):
        cluster.start_machine(rank, command, instance_id=instance, rank=rank)
    cluster.wait_until_warm()
    # The instance fails while both ranks wait after iteration PAUSE, once its replicas reached the peer:
    # PAUSE is no multiple of persist_every, so the newest iteration is in memory only and the replacement
    # restores it from its peer. (Struck while training runs, a loss right after a persisted iteration
    # completed can find that one newer than the replicas, and the planner takes the newest.)
    wait_for_pause(logs, 2, PAUSE)
    wait_until(
        lambda: (replicated_iteration(cluster) or -1) >= PAUSE, 120, f"iteration {PAUSE} replicated", 0.1
    )
    victim = next(m for m in cluster.machines if m.instance_id == instances[1])
    cluster.kill_machine(victim)
    (logs / f"go-{PAUSE}").touch()

    async def replacement() -> str | None:
        fresh = [i for i in await group_instances(moto_server, group) if i not in instances]
        return fresh[0] if fresh else None

    deadline = time.monotonic() + 60
    while (new_instance := await replacement()) is None:
        assert time.monotonic() < deadline, f"no replacement instance\n{cluster.logs()}"
        await asyncio.sleep(0.5)
    assert await instance_state(moto_server, instances[1]) == "terminated"
    cluster.start_machine(2, command, instance_id=new_instance)  # the new instance boots its agent

    events = recovered_events(cluster, 1)
    assert len(events) == 1, events
    (event,) = events
    check_event(event, kind="hardware", tier="peer", replaced=True)
    assert event["details"]["replacement"]["instance"] == new_instance
    assert event["details"]["replaced_by"] == new_instance
    machines = cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/machines")
    assert {m["rank"]: m["instance_id"] for m in machines} == {0: instances[0], 1: new_instance}
    assert check_consistent_restore(logs, 2, PAUSE, max_lost=0) == PAUSE
    persisted = cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/checkpoints")
    assert persisted and persisted[0]["location"].startswith(f"s3://{group}/"), "the S3 tier got checkpoints"
