"""The address an agent advertises (data plane, MASTER_ADDR) defaults to its address towards the root."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from worker_lib.agent import address
from worker_lib.agent.cli import add_arguments


def test_a_root_on_loopback_gives_loopback() -> None:
    assert address.default_address(["http://127.0.0.1:8000"]) == "127.0.0.1"
    assert address.default_address("http://localhost:8000,http://127.0.0.1:8001") == "127.0.0.1"


def test_a_remote_root_gives_the_source_address_of_the_route_to_it() -> None:
    # A documentation address (TEST-NET-3): routed by the default route, and nothing is sent (UDP connect).
    route = subprocess.run(["ip", "-4", "route", "get", "203.0.113.7"], capture_output=True, text=True)
    if route.returncode != 0 or " src " not in route.stdout:
        pytest.skip("no IPv4 route out of this host")
    source = route.stdout.split(" src ")[1].split()[0]
    chosen = address.default_address(["http://203.0.113.7:8000"])
    assert chosen == source
    assert not address.is_loopback(chosen)


def test_the_first_root_that_resolves_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def towards(host: str, port: int = 443) -> str:
        calls.append((host, port))
        if host == "down.invalid":
            raise OSError("no route")
        return "10.1.2.3"

    monkeypatch.setattr(address, "address_towards", towards)
    assert address.default_address("http://down.invalid:1,https://root.example") == "10.1.2.3"
    assert calls == [("down.invalid", 1), ("root.example", 443)]


def test_the_cli_no_longer_defaults_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASTOR_ADDRESS", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--root", "http://10.0.0.1:8000", "--job", "j", "--", "true"])
    assert args.address is None  # resolved by the agent: default_address(root URLs)
