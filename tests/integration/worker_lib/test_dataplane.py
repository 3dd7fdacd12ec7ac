"""The agents' data plane on real sockets: authenticated push and fetch, refusal of peers without the
job's secret, corruption detected before anything is exposed, and a receiver killed mid-transfer keeping
its previous replica."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from worker_lib import Checkpointer
from worker_lib.agent.dataplane import (
    _RECV_BATCH,
    AuthenticationFailed,
    DataPlaneError,
    DataPlaneServer,
    PeerConnection,
    _expect_ok,
    _recv_into,
    _server_handshake,
    _signed_manifest,
    data_plane_key,
    fetch,
    recv_message,
    send_message,
)
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.replication import Replicator
from worker_lib.store.slots import SlotStore

JOB = "job-under-test"
TOKEN = "castor-job.abc.secret"


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def save_checkpoints(directory: Path, iterations: list[int], numel: int = 1 << 20) -> None:
    """Checkpoints with recognisable content (every value is the iteration) in a local store."""
    with Checkpointer(directory, blocking=True) as checkpointer:
        for iteration in iterations:
            state = {"w": torch.full((numel,), float(iteration)), "step": iteration}
            checkpointer.save(iteration, state)


def replica_bytes(store: SlotStore, iteration: int | None = None) -> tuple[int, bytes]:
    with store.open_read(iteration) as (manifest, data):
        return manifest.iteration, bytes(data)


@pytest.fixture
def sender(shm: Path) -> Holdings:
    holdings = Holdings(shm / "sender")
    save_checkpoints(holdings.directory("local", 0), [1, 2])
    return holdings


@pytest.fixture
def receiver(shm: Path) -> Iterator[DataPlaneServer]:
    server = DataPlaneServer(
        Holdings(shm / "receiver"),
        data_plane_key(TOKEN),
        JOB,
        host="127.0.0.1",
        accepts_replica_of=lambda r: r == 0,
    ).start()
    yield server
    server.stop()


def test_push_then_fetch_is_bit_exact(sender: Holdings, receiver: DataPlaneServer, shm: Path) -> None:
    with (
        sender.open_read(0) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, data_plane_key(TOKEN), JOB) as peer,
    ):
        peer.put(0, manifest, data)
        source = bytes(data)
    assert replica_bytes(receiver.holdings.replica_store(0)) == (2, source)
    assert receiver.counters.replicas_received == 1

    # A replacement machine fetches rank 0 back from the replica holder, verified as it arrives.
    fresh = SlotStore(shm / "replacement" / "local" / "rank-0")
    with PeerConnection("127.0.0.1", receiver.port, data_plane_key(TOKEN), JOB) as peer:
        fetched = peer.get(0, fresh, iteration=2)
    assert fetched.digest == manifest.digest
    assert replica_bytes(fresh) == (2, source)
    restored = Checkpointer(shm / "replacement" / "local" / "rank-0").restore()
    assert restored is not None and restored.state["step"] == 2 and torch.all(restored.state["w"] == 2.0)


def test_peer_without_the_secret_gets_nothing_and_writes_nothing(
    sender: Holdings, receiver: DataPlaneServer
) -> None:
    with pytest.raises(AuthenticationFailed):
        PeerConnection("127.0.0.1", receiver.port, data_plane_key("castor-job.abc.guessed"), JOB)
    assert receiver.counters.auth_failures == 1
    assert receiver.holdings.ranks("replica") == [], "nothing was written"
    # Nor does a fake server learn anything: the client checks the server's proof before sending.
    impostor = DataPlaneServer(
        Holdings(receiver.holdings.root.parent / "impostor"), b"x" * 32, JOB, host="127.0.0.1"
    )
    impostor.start()
    try:
        with pytest.raises(AuthenticationFailed):
            PeerConnection("127.0.0.1", impostor.port, data_plane_key(TOKEN), JOB)
        assert impostor.holdings.ranks("replica") == []
    finally:
        impostor.stop()


def test_receiver_refuses_ranks_it_does_not_hold(sender: Holdings, receiver: DataPlaneServer) -> None:
    save_checkpoints(sender.directory("local", 5), [1], numel=16)
    with (
        sender.open_read(5) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, data_plane_key(TOKEN), JOB) as peer,
        pytest.raises(DataPlaneError) as refused,
    ):
        peer.put(5, manifest, data)
    assert refused.value.code == "not_a_replica_holder"
    assert receiver.holdings.ranks("replica") == []


def test_corrupted_chunk_is_detected_and_not_exposed(sender: Holdings, receiver: DataPlaneServer) -> None:
    key = data_plane_key(TOKEN)
    with (
        sender.open_read(0, iteration=1) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer,
    ):
        peer.put(0, manifest, data)
    with sender.open_read(0, iteration=2) as (manifest, data):
        corrupted = bytearray(data)
        corrupted[len(corrupted) // 2] ^= 0x40  # one bit flipped in transit
        with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
            with pytest.raises(DataPlaneError) as failed:
                peer.put(0, manifest, memoryview(corrupted))
            assert failed.value.code == "checksum_mismatch" and "stripe" in str(failed.value)
            # The connection stays usable: the intact checkpoint goes through afterwards.
            peer.put(0, manifest, data)
    store = receiver.holdings.replica_store(0)
    assert [m.iteration for m in store.committed()] == [2, 1]
    assert receiver.counters.replicas_rejected == 1


RECEIVER_SCRIPT = """
import sys, time
from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
from worker_lib.agent.holdings import Holdings
holdings, key, job = Holdings(sys.argv[1]), data_plane_key(sys.argv[2]), sys.argv[3]
server = DataPlaneServer(holdings, key, job, host="127.0.0.1").start()
print(server.port, flush=True)
time.sleep(600)
"""


def test_receiver_killed_mid_transfer_keeps_its_previous_replica(shm: Path) -> None:
    sender = Holdings(shm / "sender")
    save_checkpoints(sender.directory("local", 0), [1, 2], numel=48 << 20)  # 192 MiB each
    receiver_root = shm / "receiver"
    process = subprocess.Popen(
        [sys.executable, "-c", RECEIVER_SCRIPT, str(receiver_root), TOKEN, JOB],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        key = data_plane_key(TOKEN)
        with (
            sender.open_read(0, iteration=1) as (manifest, data),
            PeerConnection("127.0.0.1", port, key, JOB) as peer,
        ):
            peer.put(0, manifest, data)
            first = bytes(data)
        with (
            sender.open_read(0, iteration=2) as (manifest, data),
            PeerConnection("127.0.0.1", port, key, JOB) as peer,
        ):
            half = manifest.data_bytes // 2
            signed = _signed_manifest(key, peer.session, "put", 0, manifest)
            send_message(peer.sock, {"op": "put", "rank": 0, **signed})
            assert recv_message(peer.sock)["ok"]
            peer.sock.sendall(data[:half])
            time.sleep(0.2)
            os.kill(process.pid, signal.SIGKILL)  # the receiving machine dies mid-transfer
            process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    store = SlotStore(receiver_root / "replicas" / "rank-0")
    assert [m.iteration for m in store.committed()] == [1], "the torn replica never became visible"
    assert replica_bytes(store) == (1, first)


def test_an_older_checkpoint_never_replaces_a_newer_replica(
    sender: Holdings, receiver: DataPlaneServer
) -> None:
    key = data_plane_key(TOKEN)
    with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
        for iteration in (2, 1):  # a slow, superseded transfer arriving last
            with sender.open_read(0, iteration=iteration) as (manifest, data):
                peer.put(0, manifest, data)
    assert [m.iteration for m in receiver.holdings.replica_store(0).committed()] == [2]


def test_a_superseded_transfer_is_abandoned_and_the_previous_replica_stays(
    sender: Holdings, receiver: DataPlaneServer
) -> None:
    key = data_plane_key(TOKEN)
    with (
        sender.open_read(0, iteration=2) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer,
    ):
        peer.put(0, manifest, data)
    save_checkpoints(sender.directory("local", 0), [3], numel=5 << 20)  # 20 MiB: several stripes
    checks: list[int] = []

    def superseded() -> bool:  # a newer commit arrives while the first stripe is on its way
        checks.append(1)
        return len(checks) > 1

    with sender.open_read(0, iteration=3) as (manifest, data):
        assert len(manifest.stripes) >= 2
        peer = PeerConnection("127.0.0.1", receiver.port, key, JOB)
        assert peer.send_put(0, manifest, data, superseded) == "superseded"
        peer.close()
    store = receiver.holdings.replica_store(0)
    assert [m.iteration for m in store.committed()] == [2], "the partial transfer is never exposed"
    # The receiver let go of the partial slot: the next transfer goes through.
    with (
        sender.open_read(0, iteration=3) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer,
    ):
        peer.put(0, manifest, data)
    assert [m.iteration for m in store.committed()] == [3, 2]


def test_a_malformed_manifest_is_refused_before_any_data(sender: Holdings, receiver: DataPlaneServer) -> None:
    with (
        sender.open_read(0, iteration=2) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, data_plane_key(TOKEN), JOB) as peer,
    ):
        # Stripe checksums all valid, but the last stripe is left out: its bytes would go unchecked.
        truncated = dataclasses.replace(manifest, stripes=manifest.stripes[:-1])
        with pytest.raises(DataPlaneError) as refused:
            peer.put(0, truncated, data)
        assert refused.value.code == "invalid_manifest" and "do not cover" in str(refused.value)
        peer.put(0, manifest, data)  # the stream stayed framed: the intact one goes through
    assert [m.iteration for m in receiver.holdings.replica_store(0).committed()] == [2]


def test_after_a_rollback_the_same_iteration_number_is_replicated_again(
    shm: Path, receiver: DataPlaneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation 2 resumed from iteration 4 and committed its own iteration 5: the peer's replica of
    generation 1's iteration 5 is another history and must be replaced."""
    holdings = Holdings(shm / "sender")
    replicator = Replicator(
        holdings, data_plane_key(TOKEN), JOB, [1], lambda machine: ("127.0.0.1", receiver.port)
    ).start()
    try:
        for generation in (1, 2):
            monkeypatch.setenv("CASTOR_GENERATION", str(generation))
            with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
                checkpointer.save(5, {"w": torch.full((16,), float(generation))})
            replicator.notice_commit(0, 5)
            assert replicator.flush([0], timeout_s=30)
            with receiver.holdings.open_read(0, tier="replica") as (manifest, _):
                assert (manifest.iteration, manifest.meta["generation"]) == (5, generation)
    finally:
        replicator.stop()
        holdings.close()


def test_a_replicator_tells_its_holders_of_the_rollback_it_restored(
    shm: Path, receiver: DataPlaneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After generation 2 restored iteration 4 here, every replica this machine sends says so: a holder
    whose own agent has not restored yet learns the rollback from it (see the test below)."""
    holdings = Holdings(shm / "sender")
    replicator = Replicator(
        holdings, data_plane_key(TOKEN), JOB, [1], lambda machine: ("127.0.0.1", receiver.port)
    ).start()
    try:
        for generation, iteration in ((1, 4), (1, 5), (2, 5)):
            if generation == 2:
                replicator.pause()
                replicator.resume(restored=4, digests={}, generation=2)
            monkeypatch.setenv("CASTOR_GENERATION", str(generation))
            with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
                checkpointer.save(iteration, {"w": torch.full((16,), float(iteration))})
            replicator.notice_commit(0, iteration)
            assert replicator.flush([0], timeout_s=30)
            assert receiver.rolled_back == (None if generation == 1 else (2, 4))
    finally:
        replicator.stop()
        holdings.close()


def test_after_a_rollback_the_restored_iteration_replaces_a_newer_replica_of_the_abandoned_history(
    shm: Path, receiver: DataPlaneServer
) -> None:
    """Generation 2 restored iteration 2, and this holder's newest replica is generation 1's iteration 3
    (its round completed here, but not for every rank, so the recovery went back to 2; the holder's other
    slot held 1). Told of the rollback, the holder takes iteration 2 in place of 3, which no recovery can
    use; told nothing, it would answer that it holds something newer, and hold no copy of 2."""
    sender = Holdings(shm / "sender")
    sender.prepare_local([0], 4)
    save_checkpoints(sender.directory("local", 0), [1, 2, 3])
    key = data_plane_key(TOKEN)
    with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
        for iteration in (1, 3):
            with sender.open_read(0, iteration=iteration) as (manifest, data):
                peer.put(0, manifest, data)
        with sender.open_read(0, iteration=2) as (manifest, data):
            assert peer.send_put(0, manifest, data) == "stale", "no rollback known: 3 is newer"
    store = receiver.holdings.replica_store(0)
    assert [m.iteration for m in store.committed()] == [3, 1]

    receiver.learn_rollback((2, 2))  # the holder's agent restored iteration 2 as generation 2
    with (
        sender.open_read(0, iteration=2) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer,
    ):
        peer.put(0, manifest, data)
        assert peer.send_put(0, manifest, data) == "stale", "held now: asked again, it says so"
        with sender.open_read(0, iteration=3) as (abandoned, data3):
            assert peer.send_put(0, abandoned, data3) == "stale", "the abandoned history never comes back"
    assert store.committed()[0].digest == manifest.digest
    assert [m.iteration for m in store.committed()] == [2, 1]
    sender.close()


def test_a_holder_that_has_not_restored_yet_learns_the_rollback_from_the_offer(
    shm: Path, receiver: DataPlaneServer
) -> None:
    """The same holder, but its agent has not got the new plan's directive yet (so it knows of no rollback)
    when a faster peer, already restored as generation 2 at iteration 2, offers it that iteration. The offer
    says so, under its MAC: the holder takes iteration 2 in place of the abandoned 3 and knows the rollback
    from then on; its own restore, later, says the same. Before, it answered "stale" and held no copy of 2.
    A rollback field altered on the way fails the MAC, and nothing is learnt from it."""
    sender = Holdings(shm / "sender")
    sender.prepare_local([0], 4)
    save_checkpoints(sender.directory("local", 0), [1, 2, 3])
    key = data_plane_key(TOKEN)
    store = receiver.holdings.replica_store(0)
    with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
        for iteration in (1, 3):
            with sender.open_read(0, iteration=iteration) as (manifest, data):
                peer.put(0, manifest, data)
    assert receiver.rolled_back is None

    with sender.open_read(0, iteration=2) as (manifest, data):
        with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
            signed = _signed_manifest(key, peer.session, "put", 0, manifest)
            forged = {"op": "put", "rank": 0, **signed, "rolled_back": [2, 2]}  # MAC'd without it
            send_message(peer.sock, forged)
            with pytest.raises(DataPlaneError) as refused:
                _expect_ok(peer.sock)
            assert refused.value.code == "manifest_unauthenticated"
        assert receiver.rolled_back is None and [m.iteration for m in store.committed()] == [3, 1]

        with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
            peer.put(0, manifest, data, rolled_back=(2, 2))
    assert receiver.rolled_back == (2, 2)
    assert [m.iteration for m in store.committed()] == [2, 1]
    receiver.learn_rollback((1, 9))  # an older plan's never replaces a newer one's
    assert receiver.rolled_back == (2, 2)
    sender.close()


def test_a_stalled_peer_does_not_hold_the_slot_once_a_newer_commit_exists(sender: Holdings) -> None:
    """A receiver that accepts a put and then stops reading: the sender gives the transfer up as soon as
    it is superseded, instead of holding the slot (and the training process's next save) until timeout."""
    key = data_plane_key(TOKEN)
    save_checkpoints(sender.directory("local", 0), [3], numel=16 << 20)  # 64 MiB: more than socket buffers
    listener = socket.create_server(("127.0.0.1", 0))
    stalled = threading.Event()

    def stalling_peer() -> None:
        connection, _ = listener.accept()
        with connection:
            assert _server_handshake(connection, key, JOB, lambda: None)
            recv_message(connection)  # the put request
            send_message(connection, {"ok": True})
            stalled.set()
            time.sleep(30)  # never reads the data

    threading.Thread(target=stalling_peer, daemon=True).start()
    peer = PeerConnection("127.0.0.1", listener.getsockname()[1], key, JOB)
    try:
        with sender.open_read(0, iteration=3) as (manifest, data):
            started = time.monotonic()
            newer = lambda: stalled.is_set() and time.monotonic() - started > 0.5  # noqa: E731
            assert peer.send_put(0, manifest, data, newer) == "superseded"
            assert time.monotonic() - started < 5, "gave up within moments, not after the 30 s timeout"
    finally:
        peer.close()
        listener.close()


def test_stop_ends_open_peer_connections(sender: Holdings, shm: Path) -> None:
    server = DataPlaneServer(Holdings(shm / "stopping"), data_plane_key(TOKEN), JOB, host="127.0.0.1").start()
    before = set(threading.enumerate())
    with PeerConnection("127.0.0.1", server.port, data_plane_key(TOKEN), JOB) as peer:
        # An authenticated peer idles between requests: its connection thread waits in recv.
        connections = [
            t for t in set(threading.enumerate()) - before if t.name.startswith("castor-dataplane-")
        ]
        assert connections, "the server serves the peer on a thread of its own"
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 5, "stop() does not wait for the peer's 120 s read timeout"
        assert not any(t.is_alive() for t in connections), "no connection thread outlives stop()"
        with pytest.raises((DataPlaneError, OSError)):
            peer.get(0, SlotStore(shm / "nowhere" / "rank-0"))


def test_closing_the_holdings_stops_their_verification_threads(sender: Holdings) -> None:
    before = set(threading.enumerate())
    assert all(h.verified for h in sender.inventory(verify_checksums=True))
    pool = [t for t in set(threading.enumerate()) - before if t.name.startswith("castor-copy")]
    assert pool, "verification hashes on a pool of threads"
    sender.close()
    assert not any(t.is_alive() for t in pool)


def flip_a_bit(directory: Path, iteration: int) -> None:
    """One bit of the committed checkpoint `iteration` in `directory` flips in memory."""
    (slot,) = [
        p for p in directory.glob("slot-*.json") if json.loads(p.read_bytes())["iteration"] == iteration
    ]
    offset = json.loads(slot.read_bytes())["tensors"][0]["offset"]
    with open(slot.with_suffix(".bin"), "r+b") as data:
        data.seek(offset)
        byte = data.read(1)[0]
        data.seek(offset)
        data.write(bytes([byte ^ 0x01]))


def test_a_copy_corrupt_in_memory_is_checked_on_complaint_condemned_and_never_served_again(
    sender: Holdings, receiver: DataPlaneServer, shm: Path
) -> None:
    key = data_plane_key(TOKEN)
    for iteration in (1, 2):
        with (
            sender.open_read(0, iteration) as (manifest, data),
            PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer,
        ):
            peer.put(0, manifest, data)
    flip_a_bit(receiver.holdings.directory("replica", 0), 2)
    # A recovery's inventory reads no byte: the damage is not known yet.
    assert [(h.iteration, h.verified) for h in receiver.holdings.inventory()] == [(2, None), (1, None)]
    # The replacement's fetch finds it, stripe by stripe, commits nothing, and asks the holder to check its
    # copy: corrupt in the holder's memory (not only on the way), so the holder condemns it there.
    fresh = SlotStore(shm / "replacement" / "local" / "rank-0")
    with pytest.raises(DataPlaneError) as failed:
        fetch("127.0.0.1", receiver.port, key, JOB, 0, fresh, 2, digest=manifest.digest)
    assert failed.value.code == "checksum_mismatch" and fresh.committed() == []
    assert "; corrupt at the source: checkpoint of iteration 2 is corrupt" in str(failed.value)
    with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
        assert "stripe" in (peer.check(0, 2, manifest.digest) or "")
        assert peer.check(0, 2, "no-such-digest") == (
            "this machine holds no iteration 2 of rank 0 with digest no-such-digest"
        )
    held, older = receiver.holdings.inventory()
    assert (
        (held.iteration, older.verified) == (2, None)
        and held.verified is False
        and held.problem
        and "stripe" in held.problem
    )
    # Never served again: refused before a byte is sent.
    with (
        PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer,
        pytest.raises(DataPlaneError) as refused,
    ):
        peer.get(0, fresh, iteration=2, digest=manifest.digest)
    assert refused.value.code == "unreadable" and "corrupt" in str(refused.value)
    # An intact copy checked on complaint (damaged only in transit) is remembered as verified.
    with PeerConnection("127.0.0.1", receiver.port, key, JOB) as peer:
        assert peer.check(0, 1, older.digest) is None
    assert [h.verified for h in receiver.holdings.inventory()] == [False, True]
    fresh.close()


def test_background_checks_go_newest_first_and_stop_when_asked(sender: Holdings) -> None:
    flip_a_bit(sender.directory("local", 0), 1)
    stop = threading.Event()
    stop.set()
    assert sender.check_unverified(stop) == [], "asked to stop before the first copy: nothing checked"
    assert [h.verified for h in sender.inventory()] == [None, None]
    (corrupt,) = sender.check_unverified()
    assert (corrupt.iteration, corrupt.verified) == (1, False) and "stripe" in (corrupt.problem or "")
    # Both results are kept: the intact copy is reported verified, the corrupt one condemned.
    assert {h.iteration: h.verified for h in sender.inventory()} == {2: True, 1: False}
    assert sender.local_copy_problem(0, 2) is None
    assert "iteration 1 here is corrupt: checkpoint of iteration 1 is corrupt" in (
        sender.local_copy_problem(0, 1) or ""
    )
    assert sender.local_copy_problem(0, 3) == "rank 0 no longer holds iteration 3 (digest None) locally"
    assert sender.check_unverified() == [], "nothing left to check"


class _CountingSocket(socket.socket):
    """A TCP socket that counts its recv_into calls (each one a wake-up of the receiving thread)."""

    calls = 0

    def recv_into(self, *args: object, **kwargs: object) -> int:  # type: ignore[override]
        self.calls += 1
        return super().recv_into(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch, most_calls", [(0, None), (_RECV_BATCH, 12)])
def test_a_stripe_trickling_in_wakes_the_receiver_once_per_batch_not_per_packet(
    batch: int, most_calls: int | None
) -> None:
    # A link slower than memory delivers a stripe a few packets at a time. Without a batch the receiving
    # thread woke for each (hundreds of passes of Python per stripe); with one, it wakes once per batch
    # (SO_RCVLOWAT) and still takes a tail shorter than the batch without waiting for more.
    payload = os.urandom(2 * _RECV_BATCH + 12345)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        receiver = _CountingSocket(fileno=accepted.detach())
        receiver.settimeout(10)  # as the data plane's sockets: recv goes through poll()

        def trickle() -> None:
            sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for start in range(0, len(payload), 16 << 10):
                sender.sendall(payload[start : start + (16 << 10)])
                time.sleep(0.0005)

        thread = threading.Thread(target=trickle)
        thread.start()
        received = bytearray(len(payload))
        try:
            _recv_into(receiver, memoryview(received), batch=batch)
        finally:
            thread.join()
            sender.close()
        assert bytes(received) == payload
        # The batch is undone: a small control message after the data still wakes the receiver.
        assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        receiver.close()
    if most_calls is None:
        assert receiver.calls > 12, "without a batch, the 16 KiB pieces arrive one wake-up at a time"
    else:
        assert receiver.calls <= most_calls, receiver.calls
