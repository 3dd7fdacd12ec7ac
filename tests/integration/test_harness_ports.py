"""The test servers (etcd, moto) start again on other ports when one they were given was taken before they
bound it: another process's outgoing connection can take a port between free_port() and the bind, and a
session fixture that failed on it errored every test that needed the server."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from tests import harness


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def hand_out_first(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """free_port() returns `port` once (as if it were taken right after it was found free), then free ones."""
    real, given = harness.free_port, []

    def free_port() -> int:
        if not given:
            given.append(port)
            return port
        return real()

    monkeypatch.setattr(harness, "free_port", free_port)


def test_moto_starts_on_another_port_when_its_first_was_taken(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    hand_out_first(monkeypatch, taken_port)
    with harness.moto() as server:
        assert server.port != taken_port
        assert httpx.get(f"{server.url}/moto-api/").status_code < 500


def test_etcd_starts_on_other_ports_when_its_client_port_was_taken(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    hand_out_first(monkeypatch, taken_port)
    with harness.etcd() as server:
        assert server.port != taken_port
        assert harness.etcd_status(server.endpoint)["header"]["revision"] >= 1
