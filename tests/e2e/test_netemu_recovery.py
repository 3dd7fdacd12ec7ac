"""Recovery on the emulated cluster (tests/netemu.py): every machine (its agent, warm spares and training
process) runs in its own network namespace behind a 1 Gbit/s NIC; the root service listens only on the
harness's bridge address. Replicas, the gloo all-reduce and the rendezvous all cross the emulated links, at
the addresses the agents chose themselves (the local address towards the root: never loopback here)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netemu
from tests.e2e.cluster import REPO, LocalCluster, Machine, Root, wait_until
from tests.e2e.recovery_checks import (
    check_consistent_restore,
    check_event,
    newest_iteration,
    wait_for_iteration,
)
from tests.harness import free_port

pytestmark = pytest.mark.slow

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


class NetCluster(LocalCluster):
    """LocalCluster whose root binds on the emulated network's host address and whose machines run in
    the emulated cluster's namespaces (machine `index` in namespace `index`)."""

    emu: netemu.NetEmu

    def start_root(self, port: int | None = None, **settings: str) -> Root:
        assert port is None and not settings, "not needed here"
        return _start_root_on(self)

    def start_machine(
        self,
        index: int,
        command: list[str],
        *,
        instance_id: str | None = None,
        rank: int | None = None,
        keep_shm: bool = True,
        extra_args: list[str] | None = None,
    ) -> Machine:
        instance_id = instance_id or f"machine-{index}-{self.shm_base.name.rsplit('-', 1)[-1]}"
        shm_dir = self.shm_base / instance_id
        log_path = self.workdir / f"{instance_id}.log"
        token_file = self.workdir / f"worker-token-{self.job['id']}"
        token_file.touch(mode=0o600)
        token_file.write_text(self.job["worker_token"])
        args = [
            sys.executable, "-m", "services.cli", "agent",
            "--root", self.root_urls, "--job", self.job["id"], "--token-file", str(token_file),
            "--instance-id", instance_id, "--shm-dir", str(shm_dir),
            *(["--machine-rank", str(rank)] if rank is not None else []),
            *(["--keep-shm"] if keep_shm else []),
            *(extra_args or []),
            "--", *command,
        ]  # fmt: skip
        process = self.emu.popen(
            self.emu.machines[index],
            args,
            cwd=REPO,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        machine = Machine(index, instance_id, shm_dir, process, log_path)
        self.machines.append(machine)
        return machine


def _start_root_on(cluster: NetCluster) -> Root:
    """The root service bound to the harness's host address only (CASTOR_HOST), as machines reach it."""
    port = free_port()
    env = {
        **os.environ,
        "CASTOR_STATE_DIR": str(cluster.workdir / "root-state"),
        "CASTOR_ADMIN_TOKEN": cluster.admin_token,
        "CASTOR_HOST": cluster.emu.host,
        "CASTOR_PORT": str(port),
        "CASTOR_LOCAL_SHM_BASE": str(cluster.shm_base),
        "CASTOR_HEARTBEAT_TIMEOUT_S": "3",
        "CASTOR_HEARTBEAT_INTERVAL_S": "0.5",
    }
    log_path = cluster.workdir / "root-0.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the root exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((cluster.emu.host, port), timeout=0.2):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the root is not listening on {cluster.emu.host}:{port}")
        time.sleep(0.1)
    root = Root(process, f"http://{cluster.emu.host}:{port}", log_path)
    cluster.roots.append(root)
    return root


@pytest.fixture
def net_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[NetCluster]:
    netemu.require()
    with netemu.cluster(6, rate_gbit=1.0) as emu:  # 4 machines and two spares for replacements
        local = NetCluster(tmp_path)
        local.emu = emu
        try:
            yield local
        finally:
            failed = getattr(request.node, "rep_call", None)
            if failed is not None and failed.failed:
                ARTIFACTS.mkdir(exist_ok=True)
                (ARTIFACTS / f"{request.node.name}.log").write_text(local.logs(tail=200))
            local.close()


def _machines(cluster: NetCluster) -> list[dict[str, Any]]:
    return list(cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/machines"))


def _settled(cluster: NetCluster, known: set[int], timeout: float = 180) -> list[dict[str, Any]]:
    """The failures recorded since `known` once every one of them is recovered. A fault may record several:
    the survivors' training processes fail too when a peer vanishes, before the root declares it lost."""

    def done() -> list[dict[str, Any]] | None:
        new = [e for e in cluster.failures() if e["id"] not in known]
        return new if new and all(e["state"] == "recovered" for e in new) else None

    try:
        return list(wait_until(done, timeout, "the new failures recovered", interval=0.5))
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\nfailures: {cluster.failures()}\n{cluster.logs()}") from exc


def _hardware(events: list[dict[str, Any]], rank: int, spare: Machine) -> dict[str, Any]:
    """The machine loss among `events`: recovered, with `spare` in the lost machine's place, which fetched
    the rank's checkpoint from a peer's memory. (Its tier may read "local" when a later failure in the same
    recovery, e.g. a slow restart here, restarted everyone again after that fetch.)"""
    (event,) = [e for e in events if e["kind"] == "hardware"]
    check_event(event, kind="hardware", tier=event["tier"])
    assert event["rank"] == rank and event["details"]["replaced_by"] == spare.instance_id, event
    fetched = re.search(rf"rank {rank}: iteration \d+ ready \(peer", spare.log_path.read_text())
    assert fetched, f"the replacement did not restore rank {rank} from a peer:\n{spare.log_path.read_text()}"
    return event


def test_machine_loss_and_partitions_on_1_gbit_links(net_cluster: NetCluster, tmp_path: Path) -> None:
    """One job on 4 machines (m = 2), three faults in turn (one cluster: starting one costs half a minute).

    1. Machine loss: rank 2's machine dies with its memory; a spare machine takes rank 2, restored from its
       group peer's memory, bit-exact.
    2. Partition from the root (and etcd) but not the peers: rank 1's heartbeats stop, the root declares it
       failed, and a second spare takes rank 1, restored from the peer's replica. When the partition heals,
       the old agent learns that its rank belongs to another instance and stops instead of training as a
       second rank 1.
    3. Partition from the peers but not the root: the collectives fail (software failures), and once healed
       every rank resumes from its local memory."""
    cluster, emu = net_cluster, net_cluster.emu
    logs = tmp_path / "logs"
    cluster.start_root()
    job = cluster.create_job(machines=4, replicas=2)
    # gloo's collective timeout: a rank cut off from its peers fails in seconds, not torch's 30 minutes.
    command = cluster.training_command(logs, iterations=100_000, sleep=0.2, collective_timeout_s=30)
    for index in range(4):
        cluster.start_machine(index, command, rank=index)
    wait_for_iteration(logs, 3, timeout=180)

    # Each machine advertised its own NIC's address (the one towards the root), so MASTER_ADDR is rank 0's.
    addresses = {m["rank"]: m["address"] for m in _machines(cluster)}
    assert addresses == {i: emu.machines[i].address for i in range(4)}

    # 1. Machine loss.
    cluster.kill_machine(cluster.machines[2])  # agent, training process and shared memory: gone
    reached = newest_iteration(logs)
    spare = cluster.start_machine(4, command, rank=2, instance_id=f"spare-4-{job['id'][:8]}")
    _hardware(_settled(cluster, set()), rank=2, spare=spare)
    iteration = check_consistent_restore(logs, 4, reached, max_lost=None)
    wait_for_iteration(logs, iteration + 3, timeout=120)

    # 2. Partition from the root.
    known = {e["id"] for e in cluster.failures()}
    old = cluster.machines[1]
    emu.partition_from_root(emu.machines[1])
    wait_until(
        lambda: any(m["rank"] == 1 and m["state"] == "failed" for m in _machines(cluster)),
        60,
        "machine 1 declared failed",
    )
    reached = newest_iteration(logs)
    assert old.process.poll() is None  # cut off, it cannot know yet
    spare = cluster.start_machine(5, command, rank=1, instance_id=f"spare-5-{job['id'][:8]}")
    _hardware(_settled(cluster, known), rank=1, spare=spare)
    iteration = check_consistent_restore(logs, 4, reached, max_lost=None)
    wait_for_iteration(logs, iteration + 3, timeout=120)

    emu.heal()
    assert old.process.wait(60) == 1
    assert "this machine was replaced" in old.log_path.read_text()
    wait_for_iteration(logs, newest_iteration(logs) + 3, timeout=120)  # the job goes on without it
    addresses = {m["rank"]: m["address"] for m in _machines(cluster)}
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
    wait_until(lambda: any(e["id"] not in known for e in cluster.failures()), 120, "the collectives to fail")
    reached = newest_iteration(logs)
    assert all(m["state"] == "healthy" for m in _machines(cluster))  # no machine is lost
    emu.heal()
    new = _settled(cluster, known)
    assert {e["kind"] for e in new} == {"software"}, new
    assert all(set(e["details"]["tiers"].values()) == {"local"} for e in new if e["details"].get("tiers"))
    iteration = check_consistent_restore(logs, 4, reached, max_lost=None)
    wait_for_iteration(logs, iteration + 3, timeout=120)
