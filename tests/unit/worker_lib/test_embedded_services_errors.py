"""Embedded mode: when the machine's services stop on an error (not a replacement), training goes on
without replication, and the log says so; before, the heartbeat task's exception was dropped unsaid."""

from __future__ import annotations

import logging
import time

import pytest

from worker_lib.embedded import EmbeddedServices


class BrokenServices:
    closed = False

    async def start(self) -> None:
        return None

    async def heartbeats(self) -> None:
        raise RuntimeError("the heartbeat loop hit a bug")

    async def close(self) -> None:
        self.closed = True


def test_services_that_stop_on_an_error_say_so(caplog: pytest.LogCaptureFixture) -> None:
    services = BrokenServices()
    embedded = EmbeddedServices(services)  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="worker_lib.embedded"):
        embedded.start(timeout_s=10)
        deadline = time.monotonic() + 10
        while not services.closed and time.monotonic() < deadline:
            time.sleep(0.01)
    assert services.closed
    assert any("services stopped" in r.getMessage() and "hit a bug" in r.getMessage() for r in caplog.records)
