"""A peer fetch (a recovery restoring a lost machine's rank from a peer's memory) survives a handshake the
peer dropped after its deadline: on a loaded host (benchmarks/network.py at a load average of 30) the
client's proof can arrive after the server's HANDSHAKE_TIMEOUT_S, the server closes the connection, and the
client sees "connection closed by the peer mid-message". Before worker_lib.agent.dataplane.fetch the restore
gave up on the peer's copy there (one machine loss of 12 fell back in the benchmark); now it asks again on a
new connection, and only for such transport failures: an answer (not found) is not asked again."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worker_lib import Checkpointer
from worker_lib.agent import dataplane
from worker_lib.agent.dataplane import DataPlaneError, DataPlaneServer, data_plane_key, fetch
from worker_lib.agent.holdings import Holdings
from worker_lib.store.slots import SlotStore

JOB = "job-under-test"
KEY = data_plane_key("castor-job.abc.secret")
DEADLINE_S = 0.3  # the server's handshake deadline here (HANDSHAKE_TIMEOUT_S is 5 s)


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def holder(shm: Path) -> Iterator[DataPlaneServer]:
    holdings = Holdings(shm / "holder")
    with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
        checkpointer.save(7, {"w": torch.full((1 << 16,), 7.0)})
    server = DataPlaneServer(holdings, KEY, JOB, host="127.0.0.1", handshake_timeout_s=DEADLINE_S).start()
    yield server
    server.stop()
    holdings.close()


def test_a_handshake_dropped_by_a_slow_peer_is_tried_again(
    shm: Path, holder: DataPlaneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    handshake, calls = dataplane._client_handshake, []

    def slow_first(*args: Any, **kwargs: Any) -> bytes:
        calls.append(1)
        if len(calls) == 1:
            # This side starved until the server dropped the handshake; the next connection then gets a
            # deadline that a loaded host (the suite runs two tests at a time) does not miss.
            waited = time.monotonic() + 30
            while (
                holder.counters.handshakes_dropped == 0 or holder._connections
            ) and time.monotonic() < waited:
                time.sleep(0.01)
            holder.handshake_timeout_s = dataplane.HANDSHAKE_TIMEOUT_S
        return handshake(*args, **kwargs)

    monkeypatch.setattr(dataplane, "_client_handshake", slow_first)
    retried: list[Exception] = []
    destination = SlotStore(shm / "restored", 2)
    try:
        manifest = fetch(
            "127.0.0.1", holder.port, KEY, JOB, 0, destination, 7, on_retry=retried.append, retry_delay_s=0
        )
        assert manifest.iteration == 7
        assert [m.iteration for m in destination.committed()] == [7]
    finally:
        destination.close()
    assert holder.counters.handshakes_dropped == 1, "the first connection's handshake was dropped"
    # The server closed the connection (a proof sent just before its close may turn that into a reset).
    assert len(retried) == 1 and isinstance(retried[0], DataPlaneError | ConnectionResetError), retried
    assert not isinstance(retried[0], DataPlaneError) or retried[0].code == "connection_closed"


def test_an_answer_is_not_asked_again(shm: Path, holder: DataPlaneServer) -> None:
    holder.handshake_timeout_s = dataplane.HANDSHAKE_TIMEOUT_S  # no drop, however slow this side is now
    retried: list[Exception] = []
    destination = SlotStore(shm / "restored", 2)
    try:
        with pytest.raises(DataPlaneError) as raised:
            fetch("127.0.0.1", holder.port, KEY, JOB, 0, destination, 8, on_retry=retried.append)
    finally:
        destination.close()
    assert raised.value.code == "not_found"
    assert retried == [], "the peer answered: no second connection"
