"""The emulated cluster's e2e harness (tests/netemu.py), shared by test_netemu_recovery.py and
test_netemu_matrix.py: a LocalCluster whose root listens only on the harness's bridge address and whose
machines (agent, warm spares, training processes) each run in their own network namespace behind a
rate-limited NIC, plus the recovery checks those tests share."""

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
from tests.e2e.cluster import REPO, LocalCluster, Machine, Root, keep_logs, wait_until
from tests.e2e.recovery_checks import check_event
from tests.harness import free_port


class NetCluster(LocalCluster):
    """LocalCluster whose root binds on the emulated network's host address and whose machines run in
    the emulated cluster's namespaces (machine `index` in namespace `index`). `agent_env` is added to
    every agent's environment."""

    emu: netemu.NetEmu
    agent_env: dict[str, str]

    def start_root(self, port: int | None = None, **settings: str) -> Root:
        assert port is None, "not needed here"
        return _start_root_on(self, settings)

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
            env={**os.environ, **self.agent_env},
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        machine = Machine(index, instance_id, shm_dir, process, log_path)
        self.machines.append(machine)
        return machine

    def spare(self, index: int, command: list[str], rank: int) -> Machine:
        """A replacement machine for `rank` in namespace `index` (the root refuses it while the rank's
        old machine still counts as live: see replace)."""
        return self.start_machine(
            index, command, rank=rank, instance_id=f"spare-{index}-{self.job['id'][:8]}"
        )


def replace(cluster: NetCluster, lost: Machine, index: int, command: list[str], rank: int) -> Machine:
    """A spare in namespace `index` for `rank`, once the root declared `lost` (which held it) failed: a
    machine registering for a rank its live holder still has is refused (409 rank_taken)."""
    wait_until(
        lambda: any(
            m["instance_id"] == lost.instance_id and m["state"] == "failed" for m in machines(cluster)
        ),
        120,
        f"{lost.instance_id} declared failed",
        0.25,
    )
    return cluster.spare(index, command, rank)


def _start_root_on(cluster: NetCluster, settings: dict[str, str]) -> Root:
    """The root service bound to the harness's host address only (CASTOR_HOST), as machines reach it;
    `settings` as CASTOR_<NAME> variables."""
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
        **{f"CASTOR_{k.upper()}": v for k, v in settings.items()},
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


@contextlib.contextmanager
def net_cluster(
    tmp_path: Path, request: pytest.FixtureRequest, machines: int, rate_gbit: float = 1.0, **agent_env: str
) -> Iterator[NetCluster]:
    """For a fixture: `machines` namespaces at `rate_gbit`; a failed test's logs go to test-artifacts/."""
    netemu.require()
    with netemu.cluster(machines, rate_gbit=rate_gbit) as emu:
        local = NetCluster(tmp_path)
        local.emu, local.agent_env = emu, agent_env
        try:
            yield local
        finally:
            keep_logs(request, local.logs(tail=200))
            local.close()


def machines(cluster: NetCluster) -> list[dict[str, Any]]:
    return list(cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/machines"))


def settled(cluster: NetCluster, known: set[int], timeout: float = 180) -> list[dict[str, Any]]:
    """The failures recorded since `known` once every one of them is recovered. A fault may record several:
    the survivors' training processes fail too when a peer vanishes, before the root declares it lost."""

    def done() -> list[dict[str, Any]] | None:
        new = [e for e in cluster.failures() if e["id"] not in known]
        return new if new and all(e["state"] == "recovered" for e in new) else None

    try:
        return list(wait_until(done, timeout, "the new failures recovered", interval=0.5))
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\nfailures: {cluster.failures()}\n{cluster.logs()}") from exc


def hardware(events: list[dict[str, Any]], rank: int, spare: Machine) -> dict[str, Any]:
    """The machine loss among `events`: recovered, with `spare` in the lost machine's place, which fetched
    the rank's checkpoint from a peer's memory. (Its tier may read "local" when a later failure in the same
    recovery, e.g. a slow restart here, restarted everyone again after that fetch.)"""
    (event,) = [e for e in events if e["kind"] == "hardware"]
    check_event(event, kind="hardware", tier=event["tier"])
    assert event["rank"] == rank and event["details"]["replaced_by"] == spare.instance_id, event
    fetched = re.search(rf"rank {rank}: iteration \d+ ready \(peer", spare.log_path.read_text())
    assert fetched, f"the replacement did not restore rank {rank} from a peer:\n{spare.log_path.read_text()}"
    return event
