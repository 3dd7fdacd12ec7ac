"""The emulated cluster (tests/netemu.py): real namespaces, veth pairs, a bridge and tc limits. The rate
checks are loose bands around the configured rate: they check that the limiter is there and that the link
still carries traffic, not how fast this host is."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import netemu
from worker_lib.agent.address import default_address


@pytest.fixture
def emu() -> Iterator[netemu.NetEmu]:
    netemu.require()
    with netemu.cluster(3, rate_gbit=1.0) as cluster:
        yield cluster


def _names(prefix: str) -> tuple[str, str]:
    return netemu._ip("netns", "list").stdout, netemu._ip("-o", "link", "show").stdout


def test_require_skips_with_the_reason_or_fails_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netemu, "unavailable", lambda: "`ip netns add` fails (Operation not permitted)")
    monkeypatch.delenv(netemu.REQUIRE_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="Operation not permitted"):
        netemu.require()
    monkeypatch.setenv(netemu.REQUIRE_VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception, match=r"CASTOR_REQUIRE_NETNS=1.*Operation not permitted"):
        netemu.require()
    monkeypatch.setattr(netemu, "unavailable", lambda: None)
    netemu.require()  # available: neither


def test_scripts_test_requires_the_emulated_cluster() -> None:
    script = Path(netemu.__file__).resolve().parents[1] / "scripts" / "test"
    assert 'export CASTOR_REQUIRE_NETNS="${CASTOR_REQUIRE_NETNS:-1}"' in script.read_text()


@pytest.mark.parametrize("rate_gbit", [0.25, 1.0])
def test_a_machine_nic_runs_near_its_configured_rate(rate_gbit: float) -> None:
    netemu.require()
    with netemu.cluster(2, rate_gbit=rate_gbit) as emu:
        a, b = emu.machines
        gbps = netemu.measure_gbps(emu, a, b, megabytes=int(64 * rate_gbit))
    # Above 1.2x would mean no limiter; far below would mean a broken link (or a badly sized bucket).
    assert 0.4 * rate_gbit < gbps < 1.2 * rate_gbit, gbps


def test_closing_removes_every_namespace_and_link() -> None:
    netemu.require()
    with netemu.cluster(2, rate_gbit=1.0) as emu:
        netns, links = _names(emu.prefix)
        assert emu.prefix + "br" in netns and emu.prefix + "m1" in netns
        assert emu.host_link in links
    netns, links = _names(emu.prefix)
    assert emu.prefix not in netns
    assert emu.host_link not in links


def test_the_sweep_removes_leftovers_of_a_dead_run_only() -> None:
    netemu.require()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs: a killed run's
    leftover, alive = f"castor-{dead.pid}-0-m0", f"castor-{os.getpid()}-99-m0"
    netemu._ip("netns", "add", leftover)
    netemu._ip("netns", "add", alive)
    try:
        removed = netemu.sweep()
        netns, _ = _names("castor-")
        assert leftover in removed and leftover not in netns
        assert alive in netns  # this process is alive: its namespaces are its own business
    finally:
        netemu._ip("netns", "del", leftover, check=False)
        netemu._ip("netns", "del", alive, check=False)


def test_a_killed_run_is_cleaned_by_the_next_sweep_and_sigterm_cleans_up() -> None:
    netemu.require()
    code = (
        "import os, signal, sys, time\n"
        "from tests import netemu\n"
        "emu = netemu.NetEmu(1, 1.0).start()\n"
        "print(emu.prefix, emu.host_link, flush=True)\n"
        "time.sleep(60)\n"
    )
    root = netemu.__file__.rsplit("/tests/", 1)[0]
    for signum in ("SIGTERM", "SIGKILL"):
        child = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        prefix, link = child.stdout.readline().split()
        assert prefix in _names(prefix)[0]
        child.send_signal(getattr(__import__("signal"), signum))
        child.wait(30)
        if signum == "SIGKILL":  # nothing of the child ran: the next sweep finds its leftovers
            assert prefix in _names(prefix)[0]
            netemu.sweep()
        netns, links = _names(prefix)
        assert prefix not in netns, signum
        assert link not in links, signum


def test_partitions_block_the_intended_traffic_and_heal_restores_it(emu: netemu.NetEmu) -> None:
    a, b, c = emu.machines
    with socket.create_server((emu.host, 0)) as root_service:  # stands for the root, etcd and Postgres
        port = root_service.getsockname()[1]
        peer_port = 9  # nothing listens: a refusal proves the peer is reachable, a timeout that it is not
        assert netemu.can_connect(emu, a, emu.host, port)
        assert netemu.can_connect(emu, a, b.address, peer_port)

        emu.partition_from_root(a)
        assert not netemu.can_connect(emu, a, emu.host, port)
        assert netemu.can_connect(emu, a, b.address, peer_port)
        assert netemu.can_connect(emu, b, a.address, peer_port)
        assert netemu.can_connect(emu, b, emu.host, port)  # the others still reach the root

        emu.heal(a)
        emu.partition_from_peers(a)
        assert netemu.can_connect(emu, a, emu.host, port)
        assert not netemu.can_connect(emu, a, b.address, peer_port)
        assert not netemu.can_connect(emu, c, a.address, peer_port)
        assert netemu.can_connect(emu, b, c.address, peer_port)  # the others still reach each other

        emu.heal()
        assert netemu.can_connect(emu, a, emu.host, port)
        assert netemu.can_connect(emu, a, b.address, peer_port)
        assert netemu.can_connect(emu, c, a.address, peer_port)


def test_expose_makes_a_loopback_server_reachable_from_the_machines(emu: netemu.NetEmu) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = emu.expose(server.getsockname()[1])
        code = (
            "import socket\n"
            f"s = socket.create_connection(({emu.host!r}, {port}), timeout=10)\n"
            "s.sendall(b'ping'); print(s.recv(4).decode())\n"
        )
        client = emu.popen(emu.machines[0], [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            assert connection.recv(4) == b"ping"
            connection.sendall(b"pong")
            out, _ = client.communicate(timeout=30)
        assert out.strip() == "pong"


def test_the_advertised_address_is_the_one_towards_the_root_not_loopback(emu: netemu.NetEmu) -> None:
    """Item 4: inside a machine whose root is remote, the default address is the machine's own NIC's."""
    machine = emu.machines[1]
    code = (
        "from worker_lib.agent.address import default_address\n"
        f"print(default_address(['http://{emu.host}:8000']))\n"
    )
    root = netemu.__file__.rsplit("/tests/", 1)[0]
    out = emu.run(machine, [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == machine.address
    assert default_address(["http://127.0.0.1:8000"]) == "127.0.0.1"  # a root on this host: loopback
