"""The suite's wait_for_port must wait for the server it started, not for whoever holds the port."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.harness import free_port, stop_process, wait_for_port

_SERVE = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(60)\n"
)
_IDLE = "import time; time.sleep(60)\n"


def test_returns_once_the_started_process_listens() -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", _SERVE, str(port)])
    try:
        wait_for_port(port, process, timeout=20)
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        stop_process(process)


def test_another_listener_on_the_port_does_not_pass_for_the_started_process() -> None:
    with socket.socket() as intruder:
        intruder.bind(("127.0.0.1", 0))
        intruder.listen()
        port = intruder.getsockname()[1]
        process = subprocess.Popen([sys.executable, "-c", _IDLE])
        try:
            with pytest.raises(TimeoutError, match=str(port)):
                wait_for_port(port, process, timeout=1.5)
        finally:
            stop_process(process)


def test_a_server_that_cannot_bind_is_reported_as_exited() -> None:
    with socket.socket() as intruder:
        intruder.bind(("127.0.0.1", 0))
        intruder.listen()
        port = intruder.getsockname()[1]
        process = subprocess.Popen([sys.executable, "-c", _SERVE, str(port)], stderr=subprocess.DEVNULL)
        try:
            with pytest.raises(RuntimeError, match="exited"):
                wait_for_port(port, process, timeout=20)
        finally:
            stop_process(process)


def test_postgres_starts_on_another_port_when_its_first_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is free when chosen, not necessarily when Postgres binds it; a lost race errored every
    Postgres-backed test of the run."""
    from tests import harness

    with socket.socket() as intruder:
        intruder.bind(("127.0.0.1", 0))
        intruder.listen()
        taken = intruder.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or free_port())
        with harness.postgres() as server:
            assert server.port != taken
            with socket.create_connection(("127.0.0.1", server.port), timeout=5):
                pass
