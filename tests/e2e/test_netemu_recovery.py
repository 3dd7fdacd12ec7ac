"""Recovery on the emulated cluster (tests/netemu.py): every machine (its agent, warm spares and training
process) runs in its own network namespace behind a 1 Gbit/s NIC; the root service listens only on the
harness's bridge address. Replicas, the gloo all-reduce and the rendezvous all cross the emulated links, at
the addresses the agents chose themselves (the local address towards the root: never loopback here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import wait_until
from tests.e2e.netcluster import NetCluster, hardware, machines, replace, settled
from tests.e2e.netcluster import net_cluster as open_net_cluster
from tests.e2e.recovery_checks import check_consistent_restore, newest_iteration, wait_for_iteration

pytestmark = pytest.mark.slow


@pytest.fixture
def net_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NetCluster]:
    with open_net_cluster(tmp_path, request, 6) as cluster:  # 4 machines and two spares for replacements
        yield cluster


def test_machine_loss_and_partitions_on_1_gbit_links(net_cluster: NetCluster, tmp_path: Path) -> None:
    """One job on 4 machines (m = 2), three faults in turn (one cluster: starting one costs half a minute).

    1. Machine loss: rank 2's machine dies with its memory; a spare machine takes rank 2, restored from its
       group peer's memory, bit-exact.
    2. Partition from the root (and etcd) but not the peers, right after that recovery: rank 1's heartbeats
       stop, the root declares it failed, and a second spare takes rank 1, restored from the peer's replica.
       When the partition heals, the old agent learns that its rank belongs to another instance and stops
       instead of training as a second rank 1.
    3. Partition from the peers but not the root: the collectives fail (software failures), and once healed
       every rank resumes from its local memory. Nothing counts the replicas that stopped arriving: the
       job's fully replicated iteration stays at or before the cut, no inventoried copy fails its checksum
       and the plan names only local copies."""
    cluster, emu = net_cluster, net_cluster.emu
    logs = tmp_path / "logs"
    cluster.start_root()
    cluster.create_job(machines=4, replicas=2)
    # gloo's collective timeout: a rank cut off from its peers fails in seconds, not torch's 30 minutes.
    command = cluster.training_command(logs, iterations=100_000, sleep=0.2, collective_timeout_s=30)
    for index in range(4):
        cluster.start_machine(index, command, rank=index)
    wait_for_iteration(logs, 3, timeout=180)

    # Each machine advertised its own NIC's address (the one towards the root), so MASTER_ADDR is rank 0's.
    addresses = {m["rank"]: m["address"] for m in machines(cluster)}
    assert addresses == {i: emu.machines[i].address for i in range(4)}

    # 1. Machine loss.
    lost = cluster.machines[2]
    cluster.kill_machine(lost)  # agent, training process and shared memory: gone
    reached = newest_iteration(logs)
    spare = replace(cluster, lost, 4, command, rank=2)
    hardware(settled(cluster, set()), rank=2, spare=spare)
    check_consistent_restore(logs, 4, reached, max_lost=None)

    # 2. Partition from the root, at once: before the new generation's first aligned round (until then a
    # replacement used to leave the job no aligned iteration, and this second failure no iteration in
    # common: once in CI the job restarted from scratch).
    known = {e["id"] for e in cluster.failures()}
    old = cluster.machines[1]
    emu.partition_from_root(emu.machines[1])
    wait_until(
        lambda: any(m["rank"] == 1 and m["state"] == "failed" for m in machines(cluster)),
        60,
        "machine 1 declared failed",
    )
    reached = newest_iteration(logs)
    assert old.process.poll() is None  # cut off, it cannot know yet
    spare = cluster.spare(5, command, rank=1)
    hardware(settled(cluster, known), rank=1, spare=spare)
    iteration = check_consistent_restore(logs, 4, reached, max_lost=None)
    wait_for_iteration(logs, iteration + 3, timeout=120)

    emu.heal()
    assert old.process.wait(60) == 1
    assert "this machine was replaced" in old.log_path.read_text()
    wait_for_iteration(logs, newest_iteration(logs) + 3, timeout=120)  # the job goes on without it
    addresses = {m["rank"]: m["address"] for m in machines(cluster)}
    assert addresses == {
        0: emu.machines[0].address,
        1: emu.machines[5].address,
        2: emu.machines[4].address,
        3: emu.machines[3].address,
    }

    # 3. Partition from the peers, not the root: training's collectives stall and, after gloo's timeout, fail
    # (a software failure on every rank; the agents still heartbeat); once healed, everyone resumes from
    # local memory at one iteration.
    known = {e["id"] for e in cluster.failures()}
    emu.partition_from_peers(emu.machines[3])
    cut_at = newest_iteration(logs)  # no replica of a later commit can cross the cut
    wait_until(lambda: any(e["id"] not in known for e in cluster.failures()), 120, "the collectives to fail")
    reached = newest_iteration(logs)
    assert all(m["state"] == "healthy" for m in machines(cluster))  # no machine is lost
    # Replicas to and from machine 3 stopped arriving: nothing counts one as fully replicated (the job's
    # figure is the newest iteration every machine's peers verified and committed).
    replicated = cluster.job_state()["replicated_iteration"]
    assert replicated is None or replicated <= cut_at, (replicated, cut_at)
    emu.heal()
    new = settled(cluster, known)
    assert {e["kind"] for e in new} == {"software"}, new
    assert all(set(e["details"]["tiers"].values()) == {"local"} for e in new if e["details"].get("tiers"))
    # The recovery counted no replica cut off mid-transfer: no copy was found corrupt (by the agents'
    # background checks or a restore), and the plan restores every rank from its own memory.
    assert not [c for e in new for c in e["details"].get("corrupt", [])], new
    plan = cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/recovery-plans")[0]
    assert {s["tier"] for s in plan["sources"]} == {"local"}, plan
    iteration = check_consistent_restore(logs, 4, reached, max_lost=None)
    wait_for_iteration(logs, iteration + 3, timeout=120)
