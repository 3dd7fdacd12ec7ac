"""Replication yields the CPU to training (worker_lib.agent.priority): the threads that send and receive
replicas run below the process's priority, the rest of the agent (its lease, its answers to the root) does
not, and the setting is refused with a clear error when it is out of range."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.cli import build_parser
from worker_lib import Checkpointer
from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.priority import NICE_ENV, REPLICATION_NICE, replication_nice
from worker_lib.agent.replication import Replicator

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")

JOB = "job-under-test"
KEY = data_plane_key("castor-job.abc.secret")


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def priority_of(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def replicate_once(shm: Path, sender_nice: int, receiver_nice: int) -> tuple[list[int], list[int]]:
    """One checkpoint replicated from a Replicator to a DataPlaneServer; the priorities of the sender's
    threads and of the receiver's connection threads while the connection is still open."""
    receiver = DataPlaneServer(Holdings(shm / "receiver"), KEY, JOB, host="127.0.0.1", nice=receiver_nice)
    receiver.start()
    holdings = Holdings(shm / "sender")
    replicator = Replicator(
        holdings, KEY, JOB, [1], lambda machine: ("127.0.0.1", receiver.port), streams=2, nice=sender_nice
    ).start()
    try:
        with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
            checkpointer.save(3, {"w": torch.arange(1 << 16, dtype=torch.float32)})
        replicator.notice_commit(0, 3)
        assert replicator.flush([0], timeout_s=30)
        with receiver.holdings.open_read(0, tier="replica") as (manifest, _):
            assert manifest.iteration == 3
        senders = threads_named("castor-replicate-to-1-")
        connections = [t for t in threads_named("castor-dataplane-") if t.name != "castor-dataplane"]
        assert len(senders) == 2 and connections, [t.name for t in threading.enumerate()]
        # A sender lowers itself when it starts: give the idle one a moment to have run at all.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len({priority_of(t) for t in senders}) > 1:
            time.sleep(0.01)
        return [priority_of(t) for t in senders], [priority_of(t) for t in connections]
    finally:
        replicator.stop()
        receiver.stop()
        holdings.close()
        receiver.holdings.close()


def test_the_threads_that_move_replicas_run_below_training_and_the_rest_does_not(shm: Path) -> None:
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    senders, connections = replicate_once(shm, sender_nice=7, receiver_nice=5)
    assert senders == [min(19, base + 7)] * 2
    assert set(connections) == {min(19, base + 5)}
    # The caller's thread (in the agent: the event loop that refreshes its lease) keeps its priority, and so
    # does the server's accept loop.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert all(
        priority_of(t) == base for t in threads_named("castor-dataplane") if t.name == "castor-dataplane"
    )


def test_nice_zero_replicates_at_the_process_priority(shm: Path) -> None:
    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    senders, connections = replicate_once(shm, sender_nice=0, receiver_nice=0)
    assert set(senders) == set(connections) == {base}


def test_the_setting_is_read_from_the_environment_and_out_of_range_values_are_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert replication_nice(None) == replication_nice("") == REPLICATION_NICE
    assert replication_nice(" 0 ") == 0 and replication_nice("19") == 19
    assert replication_nice(None, default=0) == 0 and replication_nice("4", default=0) == 4  # embedded mode
    for bad in ("20", "-1", "low", "2.5"):
        with pytest.raises(ValueError, match=f"{NICE_ENV} must be a whole number from 0 to 19, got '{bad}'"):
            replication_nice(bad)

    def parse(*options: str):  # type: ignore[no-untyped-def]
        argv = ["agent", "--root", "http://r", "--job", "j", *options, "--", "python"]
        return build_parser().parse_args(argv)

    monkeypatch.delenv(NICE_ENV, raising=False)
    assert parse().replication_nice == REPLICATION_NICE
    assert parse("--replication-nice", "3").replication_nice == 3
    monkeypatch.setenv(NICE_ENV, "0")
    assert parse().replication_nice == 0
    with pytest.raises(SystemExit):
        parse("--replication-nice", "42")
    assert "--replication-nice" in capsys.readouterr().err
