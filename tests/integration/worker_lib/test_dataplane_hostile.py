"""The data plane against hostile peers, on real sockets: strangers that send huge frames, open many
connections or drip their handshake; a peer whose manifest claims more memory than the rank is allowed; a
manifest swapped together with its bytes on the way; a source that offers another checkpoint than the one
the recovery plan chose."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import shutil
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from worker_lib import Checkpointer
from worker_lib.agent.agent import Agent, AgentConfig, RestoreFailure
from worker_lib.agent.dataplane import (
    MAX_PREAUTH_MESSAGE,
    DataPlaneError,
    DataPlaneServer,
    PeerConnection,
    _server_handshake,
    _signed_manifest,
    data_plane_key,
    recv_message,
    send_message,
)
from worker_lib.agent.holdings import Holdings, rank_capacity
from worker_lib.agent.replication import Replicator
from worker_lib.api.shared import PersistentTier, PlanSource
from worker_lib.api.worker import DirectiveOut, RegisterResponse
from worker_lib.errors import CheckpointError, CheckpointNotFoundError, ShmCapacityError
from worker_lib.persistent import LocalDirStore, shard_key
from worker_lib.store.manifest import Manifest, Stripe, content_digest
from worker_lib.store.slots import SlotStore, free_bytes

JOB = "job-under-test"
TOKEN = "castor-job.abc.secret"
KEY = data_plane_key(TOKEN)


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def save_checkpoints(directory: Path, iterations: list[int], numel: int = 1 << 18) -> None:
    with Checkpointer(directory, blocking=True) as checkpointer:
        for iteration in iterations:
            checkpointer.save(iteration, {"w": torch.full((numel,), float(iteration)), "step": iteration})


@pytest.fixture
def sender(shm: Path) -> Holdings:
    holdings = Holdings(shm / "sender")
    save_checkpoints(holdings.directory("local", 0), [1, 2])  # 1 MiB each
    return holdings


def start_server(root: Path, **options: object) -> DataPlaneServer:
    holdings = Holdings(root, replica_bytes_max=options.pop("replica_bytes_max", None))  # type: ignore[arg-type]
    return DataPlaneServer(holdings, KEY, JOB, host="127.0.0.1", **options).start()  # type: ignore[arg-type]


@pytest.fixture
def receiver(shm: Path) -> Iterator[DataPlaneServer]:
    server = start_server(shm / "receiver")
    yield server
    server.stop()


def closed_by_peer(sock: socket.socket, within_s: float = 10.0) -> bool:
    """Whether the other end closed `sock` (reading whatever it still sent first)."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def tampered(manifest: Manifest, data: memoryview) -> tuple[Manifest, bytearray]:
    """Other bytes with a manifest that matches them: every xxh3 checksum and the content digest agree."""
    forged = bytearray(data)
    forged[len(forged) // 2] ^= 0x40
    stripes = tuple(
        Stripe(s.start, s.end, xxhash.xxh3_64_hexdigest(memoryview(forged)[s.start : s.end]))
        for s in manifest.stripes
    )
    return dataclasses.replace(
        manifest, stripes=stripes, digest=content_digest(s.digest for s in stripes)
    ), forged


def committed(store: SlotStore) -> list[int]:
    return [m.iteration for m in store.committed()]


# -- (a) pre-authentication frames ----------------------------------------------------------------------


def test_a_stranger_announcing_a_large_frame_is_dropped_before_anything_is_allocated(
    receiver: DataPlaneServer,
) -> None:
    with socket.create_connection(("127.0.0.1", receiver.port)) as stranger:
        hello = recv_message(stranger)
        assert "nonce" in hello
        # 1 MiB announced (today's limit was 64 MiB): refused on the length alone, no body awaited.
        stranger.sendall(struct.pack("!I", 1 << 20))
        assert closed_by_peer(stranger), "the server waited for (and would have allocated) the frame"
    assert receiver.counters.handshakes_dropped == 1
    # A frame of the handshake's real size still works: a peer with the secret gets in.
    assert MAX_PREAUTH_MESSAGE <= 8 << 10
    with PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer:
        assert peer.inventory() == []


@pytest.mark.parametrize(
    "answer",
    [
        json.dumps(
            {"nonce": "00" * 32, "proof": "\u00e9" * 64}
        ).encode(),  # beyond ASCII: compare_digest raised
        b"[" * 3000
        + b"]" * 1000,  # nested thousands deep, within the 4 KiB frame: json raised RecursionError
    ],
    ids=["non-ascii-proof", "deep-json"],
)
def test_a_stranger_s_malformed_hello_answer_is_counted_and_the_server_goes_on(
    receiver: DataPlaneServer, answer: bytes
) -> None:
    """Before, these escaped the handshake's error handling: the thread died with a traceback and nothing
    was counted."""
    assert len(answer) <= MAX_PREAUTH_MESSAGE
    with socket.create_connection(("127.0.0.1", receiver.port)) as stranger:
        recv_message(stranger)
        stranger.sendall(struct.pack("!I", len(answer)) + answer)
        assert closed_by_peer(stranger)
    counters = receiver.counters
    assert counters.auth_failures + counters.handshakes_dropped == 1
    with PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer:
        assert peer.inventory() == []


def test_the_data_plane_goes_on_accepting_after_accept_fails(
    receiver: DataPlaneServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors or buffers for a moment (EMFILE, ENOBUFS): before, the accept loop ended silently,
    the listening socket stayed open, and every fetch from this machine timed out in its handshake."""
    listener = receiver._listener
    failures = iter([OSError(errno.ENOBUFS, "No buffer space available"), OSError(errno.EMFILE, "Too many")])

    class Failing:
        def accept(self) -> tuple[socket.socket, tuple[str, int]]:
            failure = next(failures, None)
            if failure is not None:
                raise failure
            return listener.accept()

        def __getattr__(self, name: str) -> object:
            return getattr(listener, name)

    monkeypatch.setattr(receiver, "_listener", Failing())
    with socket.create_connection(("127.0.0.1", receiver.port)):
        pass  # wakes the blocked accept(); the next one fails twice
    with PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer:
        assert peer.inventory() == []
    assert receiver.counters.accept_errors == 2


# -- (b) unauthenticated connections: how many, how long ----------------------------------------------------


def test_unauthenticated_connections_are_bounded_in_number_and_in_time(shm: Path) -> None:
    server = start_server(shm / "receiver", max_unauthenticated=4, handshake_timeout_s=2.0)
    before = set(threading.enumerate())
    strangers = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(24)]
    try:
        # The first four get a hello (and a thread each); the others are closed at once, threadless.
        greeted = []
        for stranger in strangers:
            stranger.settimeout(10)
            first = stranger.recv(1)
            greeted.append(first != b"")
        assert sum(greeted) == 4
        threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("castor-dataplane-")]
        assert len(threads) <= 4
        assert server.counters.connections_refused == 20
        # Silent ones are dropped at the handshake deadline, not after the 120 s read timeout.
        for stranger, was_greeted in zip(strangers, greeted, strict=True):
            if was_greeted:
                assert closed_by_peer(stranger, within_s=15), "an idle stranger kept its place"
        assert server.counters.handshakes_dropped == 4
        # The places are free again: a peer with the secret gets in.
        with PeerConnection("127.0.0.1", server.port, KEY, JOB) as peer:
            assert peer.inventory() == []
    finally:
        for stranger in strangers:
            stranger.close()
        server.stop()


def test_a_stranger_dripping_its_handshake_is_dropped_at_the_deadline(shm: Path) -> None:
    server = start_server(shm / "receiver", handshake_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as stranger:
            recv_message(stranger)
            stranger.sendall(struct.pack("!I", 200))  # a plausible answer, sent one byte at a time
            dropped = False
            for _ in range(100):  # 20 s of dripping at most: far past the 1 s deadline
                try:
                    stranger.sendall(b" ")
                except (BrokenPipeError, ConnectionResetError):
                    dropped = True
                    break
                stranger.settimeout(0.2)
                try:
                    if stranger.recv(1) == b"":
                        dropped = True
                        break
                except ConnectionResetError:
                    # Closed with a dripped byte still unread in its buffer, the server's kernel answers with
                    # a reset instead of an end of stream: dropped all the same.
                    dropped = True
                    break
                except TimeoutError:
                    pass
            assert dropped, "each byte restarted the timeout: the stranger kept the connection"
        assert server.counters.handshakes_dropped == 1
    finally:
        server.stop()


# -- (c) a peer's checkpoint size ---------------------------------------------------------------------------


def test_a_replica_larger_than_the_rank_is_allowed_is_refused_and_never_sized(
    shm: Path, sender: Holdings
) -> None:
    cap = 2 << 20  # the rank's checkpoints are 1 MiB; 2 MiB is what this machine keeps for it
    server = start_server(shm / "receiver", replica_bytes_max=lambda rank: cap)
    try:
        with (
            sender.open_read(0, iteration=2) as (manifest, data),
            PeerConnection("127.0.0.1", server.port, KEY, JOB) as peer,
        ):
            # A peer with the secret claims 64 GiB for the rank: refused before any slot is sized.
            huge = dataclasses.replace(
                manifest, data_bytes=64 << 30, stripes=(Stripe(0, 64 << 30, "0" * 16),)
            )
            with pytest.raises(DataPlaneError) as refused:
                peer.send_put(0, huge, data)
            assert refused.value.code == "too_large" and "CASTOR_REPLICA_BYTES_MAX" in str(refused.value)
            # The stream stayed framed, and a checkpoint of the allowed size goes through.
            peer.put(0, manifest, data)
        replicas = server.holdings.directory("replica", 0)
        assert committed(server.holdings.replica_store(0)) == [2]
        assert all(f.stat().st_size <= cap for f in replicas.glob("slot-*.bin"))
        assert server.counters.replicas_rejected == 1
    finally:
        server.stop()


def test_a_replicator_refused_for_size_says_so_as_an_error_and_sends_what_fits(
    shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(shm / "receiver", replica_bytes_max=lambda rank: 64 << 10)
    holdings = Holdings(shm / "sender")
    replicator = Replicator(holdings, KEY, JOB, [1], lambda machine: ("127.0.0.1", server.port)).start()
    try:
        with caplog.at_level(logging.WARNING, logger="worker_lib.agent.replication"):
            save_checkpoints(holdings.directory("local", 0), [1], numel=1 << 16)  # 256 KiB: too large
            replicator.notice_commit(0, 1)
            assert not replicator.flush([0], timeout_s=2)
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert errors and "exceeds" in errors[0].getMessage()
        assert server.holdings.ranks("replica") == [] or committed(server.holdings.replica_store(0)) == []
        save_checkpoints(holdings.directory("local", 0), [2], numel=1 << 10)  # 4 KiB fits
        replicator.notice_commit(0, 2)
        assert replicator.flush([0], timeout_s=30)
        assert committed(server.holdings.replica_store(0)) == [2]
    finally:
        replicator.stop()
        server.stop()
        holdings.close()


def test_replica_slots_never_grow_beyond_their_bound(shm: Path) -> None:
    store = SlotStore(shm / "replicas" / "rank-0")
    store.max_bytes = 1 << 20
    with pytest.raises(CheckpointError, match="exceeds"):
        store.open_write(1, 8 << 20)
    assert all(f.stat().st_size == 0 for f in store.directory.glob("slot-*.bin"))
    writer = store.open_write(1, 1 << 20)
    assert writer is not None
    writer.abort()
    store.close()


def test_the_rank_capacity_is_checked_against_shared_memory_or_is_a_fair_share(shm: Path) -> None:
    free, _ = free_bytes(Path("/dev/shm"))
    # Configured: checked up front for every rank the machine keeps (its own and its replicas, 2 slots).
    assert rank_capacity(shm, ranks=4, configured=1 << 20) == 1 << 20
    with pytest.raises(ShmCapacityError):
        rank_capacity(shm, ranks=4, configured=free // 4)
    # Not configured: an equal share, so the replicas a peer sends cannot take the machine's own share.
    share = rank_capacity(shm, ranks=4)
    # Free memory read on both sides: a test running beside this one may free some meanwhile.
    free = max(free, free_bytes(Path("/dev/shm"))[0])
    assert 0 < share <= free // 8 + (1 << 20)


# -- (d) manifests authenticated with the job key -------------------------------------------------------


def test_a_manifest_swapped_together_with_its_bytes_is_refused(
    sender: Holdings, receiver: DataPlaneServer
) -> None:
    with (
        sender.open_read(0, iteration=2) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer,
    ):
        forged_manifest, _ = tampered(manifest, data)
        # An on-path attacker without the key replaces manifest and bytes; the MAC is the sender's.
        genuine = _signed_manifest(KEY, peer.session, "put", 0, manifest)
        forged = {**genuine, "manifest": forged_manifest.to_json().decode()}
        send_message(peer.sock, {"op": "put", "rank": 0, **forged})
        refusal = recv_message(peer.sock)
        assert (refusal["ok"], refusal["code"]) == (False, "manifest_unauthenticated")
        # Without any MAC (the unauthenticated format): refused too.
        send_message(peer.sock, {"op": "put", "rank": 0, "manifest": forged_manifest.to_json().decode()})
        assert recv_message(peer.sock)["code"] == "manifest_unauthenticated"
        # Replayed from this connection into another one: refused (bound to the nonces).
        with PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as other:
            send_message(other.sock, {"op": "put", "rank": 0, **genuine})
            assert recv_message(other.sock)["code"] == "manifest_unauthenticated"
        # Nothing was stored; the genuine one still goes through on the same stream.
        assert committed(receiver.holdings.replica_store(0)) == []
        peer.put(0, manifest, data)
    assert committed(receiver.holdings.replica_store(0)) == [2]
    assert receiver.counters.replicas_rejected == 3


def serve_once(handler: object) -> tuple[socket.socket, threading.Thread]:
    """A hostile server that authenticates (it has the key) and then runs `handler(connection, session)`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        connection, _ = listener.accept()
        with connection:
            session = _server_handshake(connection, KEY, JOB, lambda: None)
            assert session is not None
            request = recv_message(connection)
            with contextlib.suppress(OSError):  # the client hangs up once it refused what it got
                handler(connection, session, request)  # type: ignore[operator]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def test_a_fetched_manifest_that_fails_its_mac_is_refused(sender: Holdings, shm: Path) -> None:
    with sender.open_read(0, iteration=2) as (manifest, data):
        forged_manifest, forged_data = tampered(manifest, data)

    def swap(connection: socket.socket, session: bytes, request: dict[str, object]) -> None:
        signed = _signed_manifest(KEY, session, "get", 0, manifest)
        send_message(connection, {"ok": True, **signed, "manifest": forged_manifest.to_json().decode()})
        connection.sendall(forged_data)

    listener, thread = serve_once(swap)
    destination = SlotStore(shm / "replacement" / "local" / "rank-0")
    try:
        with (
            PeerConnection("127.0.0.1", listener.getsockname()[1], KEY, JOB) as peer,
            pytest.raises(DataPlaneError) as refused,
        ):
            peer.get(0, destination, iteration=2)
        assert refused.value.code == "manifest_unauthenticated"
        assert committed(destination) == []
    finally:
        listener.close()
        thread.join(timeout=10)


# -- (e) restores check the digest the plan chose -------------------------------------------------------


def test_a_peer_offering_another_checkpoint_than_the_planned_digest_is_refused(
    sender: Holdings, receiver: DataPlaneServer, shm: Path
) -> None:
    with (
        sender.open_read(0, iteration=2) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer,
    ):
        peer.put(0, manifest, data)
        planned = manifest.digest
    destination = SlotStore(shm / "replacement" / "local" / "rank-0")
    # An honest holder serves only the planned content: it holds no iteration 2 with another digest.
    with (
        PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer,
        pytest.raises(DataPlaneError) as missing,
    ):
        peer.get(0, destination, iteration=2, digest="0123456789abcdef")
    assert missing.value.code == "not_found"
    # A hostile one ignores the digest asked for and sends another history's iteration 2, correctly signed.
    with sender.open_read(0, iteration=2) as (manifest, data):
        other_manifest, other_data = tampered(manifest, data)

    def other_history(connection: socket.socket, session: bytes, request: dict[str, object]) -> None:
        send_message(connection, {"ok": True, **_signed_manifest(KEY, session, "get", 0, other_manifest)})
        connection.sendall(other_data)

    listener, thread = serve_once(other_history)
    try:
        with (
            PeerConnection("127.0.0.1", listener.getsockname()[1], KEY, JOB) as peer,
            pytest.raises(DataPlaneError) as refused,
        ):
            peer.get(0, destination, iteration=2, digest=planned)
        assert refused.value.code == "digest_mismatch"
    finally:
        listener.close()
        thread.join(timeout=10)
    assert committed(destination) == []
    # With the planned digest, the honest holder delivers.
    with PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer:
        assert peer.get(0, destination, iteration=2, digest=planned).digest == planned
    assert committed(destination) == [2]


def restore_with(agent: Agent, source: dict[str, object], iteration: int) -> dict[str, object]:
    # The fields of the directive a restore reads (model_construct: the others are the root's business).
    sources = [PlanSource.model_validate({"rank": 0, **source})]
    plan = DirectiveOut.model_construct(iteration=iteration, sources=sources)
    return asyncio.run(agent._restore(plan))


@pytest.fixture
def agent(shm: Path) -> Iterator[Agent]:
    config = AgentConfig(
        root_urls=["http://127.0.0.1:9"], job_id=JOB, token=TOKEN, command=["true"], shm_root=shm / "agent"
    )
    agent = Agent(config)
    agent.machine.registration = RegisterResponse.model_construct(rank=0, procs_per_machine=1)
    yield agent
    agent.machine.holdings.close()


def test_the_agent_restores_only_the_planned_digest_locally_and_from_peers(
    agent: Agent, sender: Holdings, receiver: DataPlaneServer
) -> None:
    holdings = agent.machine.holdings
    save_checkpoints(holdings.directory("local", 0), [2], numel=16)  # its own iteration 2: this history's
    own = holdings.newest("local", 0)
    assert own is not None
    # Local memory: iteration 2 is there, but the plan chose another content (another history's 2).
    with pytest.raises(CheckpointNotFoundError, match="digest"):
        restore_with(agent, {"tier": "local", "digest": "0123456789abcdef"}, 2)
    assert restore_with(agent, {"tier": "local", "digest": own.digest}, 2)["0"]["tier"] == "local"  # type: ignore[index]

    # A peer: it holds rank 0's iteration 2 of another history; the plan names that one's digest or not.
    with (
        sender.open_read(0, iteration=2) as (manifest, data),
        PeerConnection("127.0.0.1", receiver.port, KEY, JOB) as peer,
    ):
        peer.put(0, manifest, data)
    source = {"tier": "peer", "address": "127.0.0.1", "data_port": receiver.port}
    with pytest.raises(DataPlaneError):
        restore_with(agent, {**source, "digest": "0123456789abcdef"}, 2)
    assert holdings.newest("local", 0) == own, "nothing replaced the local copy"
    restore_with(agent, {**source, "digest": manifest.digest}, 2)
    newest = holdings.newest("local", 0)
    assert newest is not None and newest.digest == manifest.digest


def persisted_shard_planned(agent: Agent, shm: Path) -> tuple[Path, dict[str, object]]:
    """Rank 0's iteration 4 in a local-directory persistent tier, and the plan source naming it: returns
    the shard's directory and the source."""
    tier = shm / "tier"
    source = shm / "source"
    save_checkpoints(source, [4], numel=1 << 12)
    key = shard_key("castor", JOB, 4, 0)
    with SlotStore(source).open_read(4) as (manifest, data):
        asyncio.run(LocalDirStore(tier).put(key, manifest, data))
        digest = manifest.digest
    persistent = PersistentTier(kind="local", prefix="castor", path=str(tier))
    agent.machine.registration = RegisterResponse.model_construct(
        rank=0, procs_per_machine=1, persistent=persistent
    )
    return tier / key, {"tier": "persistent", "location": key, "digest": digest}


def flip_a_bit_of(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("damaged", ["data", "manifest"])
def test_a_persisted_shard_that_fails_its_checksums_is_reported_unusable(
    agent: Agent, shm: Path, damaged: str
) -> None:
    """The restore from the persistent tier finds the object corrupt: the failure names the shard (rank,
    iteration, digest), which the root condemns so that its next plan does not name it again. A manifest
    that does not decode is corrupt too (before, a plain ValueError: nothing reported, nothing condemned,
    and every plan named the same object until the job failed)."""
    shard, planned = persisted_shard_planned(agent, shm)
    if damaged == "data":
        flip_a_bit_of(shard / "data.bin")  # at rest: every read fails
    else:
        (shard / "manifest.json").write_bytes((shard / "manifest.json").read_bytes()[:-20])  # cut short
    with pytest.raises(RestoreFailure) as failed:
        restore_with(agent, planned, 4)
    (unusable,) = failed.value.unusable_persisted
    assert (unusable["rank"], unusable["iteration"], unusable["digest"]) == (0, 4, planned["digest"])
    assert ("checksum" if damaged == "data" else "manifest.json is unreadable") in unusable["problem"]
    # Missing here is not proof: a directory not mounted on this machine, another endpoint. The restore
    # fails without condemning the shard, which the others may still read.
    shutil.rmtree(shard)
    with pytest.raises(CheckpointNotFoundError, match="no persisted checkpoint") as missing:
        restore_with(agent, planned, 4)
    assert not isinstance(missing.value, RestoreFailure)


def test_a_persisted_shard_that_fails_one_read_is_read_again_not_reported(
    agent: Agent, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root condemns a shard reported unusable for good (and retention may then delete its checkpoint):
    before, one failed read did it, though a fault of the reading machine (its memory, a damaged transfer)
    fails a read of a good shard too. Here the first read sees a flipped bit and the second a good shard."""
    shard, planned = persisted_shard_planned(agent, shm)
    flip_a_bit_of(shard / "data.bin")
    reads = []
    get = LocalDirStore.get

    async def once_damaged(store: LocalDirStore, *args: object, **kwargs: object) -> Manifest:
        reads.append(args[0])
        try:
            return await get(store, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            if len(reads) == 1:
                flip_a_bit_of(shard / "data.bin")  # the damage was in this read, not at rest

    monkeypatch.setattr(LocalDirStore, "get", once_damaged)
    restored = restore_with(agent, planned, 4)
    assert restored["0"]["tier"] == "persistent" and len(reads) == 2  # type: ignore[index]
    newest = agent.machine.holdings.newest("local", 0)
    assert newest is not None and newest.digest == planned["digest"]
