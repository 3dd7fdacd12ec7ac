"""The e2e harness's root start-up (tests/e2e/cluster.py): free_port() only finds a port free, and another
process may bind it before the root does (seconds later, after its imports and migrations); the root then
exits with EADDRINUSE. A harness-chosen port is chosen again; a port the test gave is its failure, with the
root's own log in the message (a root that exits before listening says why)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests import harness
from tests.e2e import cluster as cluster_module
from tests.e2e.cluster import LocalCluster, PortTaken


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: nothing answers there, and the root cannot bind
        yield int(sock.getsockname()[1])


def test_a_root_whose_port_was_taken_meanwhile_starts_on_another(
    cluster: LocalCluster, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = iter([taken_port])  # the first port the harness picks is taken by the time the root binds it
    monkeypatch.setattr(cluster_module, "free_port", lambda: next(ports, None) or harness.free_port())
    root = cluster.start_root()
    assert root.url != f"http://127.0.0.1:{taken_port}"
    assert cluster.api("GET", "/api/v1/jobs")["items"] == []


def test_a_root_that_cannot_bind_the_given_port_fails_with_its_log(
    cluster: LocalCluster, taken_port: int
) -> None:
    with pytest.raises(PortTaken, match="address already in use") as failed:
        cluster.start_root(port=taken_port)
    assert "before listening" in str(failed.value)
    assert cluster.roots == [], "nothing left to stop"
