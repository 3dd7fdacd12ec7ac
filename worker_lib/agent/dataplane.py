"""The agents' checkpoint data plane: TCP between agents, a framed protocol, mutual authentication.

Wire format: control messages are a 4-byte big-endian length and a JSON object; checkpoint data follows a
control message as raw bytes (exactly the manifest's `data_bytes`). Every connection starts with a
challenge-response handshake in both directions, keyed with HMAC-SHA256 by a key derived from the job's
worker token, so a peer that cannot prove it knows the secret receives nothing and can write nothing.

What a peer can make the server do before it authenticated is bounded: its frames are at most
MAX_PREAUTH_MESSAGE bytes (checked before anything is allocated), at most `max_unauthenticated` connections
are in the handshake at once (further ones are closed at accept, no thread is started for them), and a
handshake not completed within `handshake_timeout_s` (one deadline for the whole exchange, so a peer
dripping a byte at a time gains nothing) is dropped.

After the handshake every manifest on the wire (a put's, a get's answer) travels as its exact JSON bytes
with an HMAC-SHA256 bound to the job key, this connection's two nonces, the operation and the rank. The
manifest lists the xxh3 digest of every stripe, and the receiver checks each stripe against it, so data and
manifest cannot be swapped together on the way without the job's key; the bytes themselves are not MACed
(that would cost the fast path a cryptographic hash of every byte).

Operations after the handshake:
* put: push a checkpoint (manifest, then data) into the receiver's replica store for that rank. The receiver
  writes straight into its slot, verifies each stripe's checksum as it arrives, and commits only after
  every byte arrived and verified; a bad stripe aborts the transfer and the slot stays empty.
* get: fetch a checkpoint the server holds (its own or a replica), manifest first so the receiver verifies
  as it goes.
* inventory: what the server holds (rank, iteration, tier, digest, verified).
* check: verify one copy the server holds (a fetch of it failed its checksums); a corrupt one is condemned.

Transfers run in threads with blocking sockets: sendall/recv_into on a memoryview of the shared-memory slot
move bytes with no Python-level copy, and both release the GIL, as xxh3 hashing does.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from worker_lib.agent.holdings import Holdings, Version, abandoned, version
from worker_lib.agent.priority import REPLICATION_NICE, lower_thread_priority
from worker_lib.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from worker_lib.store.integrity import check_structure
from worker_lib.store.manifest import Manifest
from worker_lib.store.slots import SlotStore

log = logging.getLogger(__name__)

# 2: a put's MAC names the sender's rollback (_put_op). Agents of another version fail the handshake, naming
# both, instead of refusing every put after a recovery as unauthenticated.
PROTOCOL = "castor-dataplane/2"
_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 64 << 20  # manifests of states with very many tensors stay far below this
# Handshake frames are a few hundred bytes: nothing larger is read (or allocated) from a stranger.
MAX_PREAUTH_MESSAGE = 4 << 10
MAX_UNAUTHENTICATED = 16  # connections in the handshake at once; more are closed at accept
HANDSHAKE_TIMEOUT_S = 5.0
ACCEPT_RETRY_S = 0.1  # after accept() failed: out of descriptors or memory, for a moment
REPLICA_BYTES_MAX_ENV = "CASTOR_REPLICA_BYTES_MAX"
_RECV_CHUNK = 8 << 20
_RECV_BATCH = 512 << 10  # bytes a receiving thread waits for per wake-up (see _recv_into)
_STALL_CHECK_S = 0.05


class DataPlaneError(Exception):
    """A transfer failed: the peer refused it, the connection broke, or the bytes did not verify."""

    def __init__(self, message: str, code: str = "transfer_failed"):
        super().__init__(message)
        self.code = code


class AuthenticationFailed(DataPlaneError):
    def __init__(self, message: str):
        super().__init__(message, code="authentication_failed")


def data_plane_key(worker_token: str) -> bytes:
    """The HMAC key agents share: derived from the job's worker token, never the token itself on the wire."""
    return hmac.new(worker_token.encode(), b"castor data plane v1", hashlib.sha256).digest()


# -- framing --------------------------------------------------------------------------------------------


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    payload = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def recv_message(
    sock: socket.socket, limit: int = _MAX_MESSAGE, deadline: float | None = None
) -> dict[str, Any]:
    """One control message of at most `limit` bytes (refused before anything is allocated for it), all of
    it received before `deadline` (time.monotonic()) when one is given."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if length > limit:
        raise DataPlaneError(
            f"control message of {length} bytes exceeds the {limit} byte limit", code="message_too_large"
        )
    try:
        message = json.loads(_recv_exact(sock, length, deadline))
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested thousands deep
        raise DataPlaneError(f"control message is not JSON: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise DataPlaneError("control message is not a JSON object")
    return message


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float | None = None) -> bytes:
    buffer = bytearray(nbytes)
    _recv_into(sock, memoryview(buffer), deadline)
    return bytes(buffer)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None, batch: int = 0) -> None:
    """Fill `view` from `sock`. With `batch`, the socket wakes this thread only once that many bytes (or the
    rest of `view`, when fewer) have arrived (SO_RCVLOWAT; reset to 1 at the end): on a link slower than
    memory, bytes trickle in a packet at a time, and a wake-up and a pass of this loop per packet cost more
    CPU than the copies themselves."""
    received, lowat = 0, 1
    while received < len(view):
        if batch and (wanted := min(batch, len(view) - received)) != lowat:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
            lowat = wanted
        if deadline is not None:
            # The socket timeout bounds one recv; a peer sending a byte at a time must not extend it.
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DataPlaneError("the handshake did not complete in time", code="handshake_timeout")
            sock.settimeout(remaining)
        try:
            count = sock.recv_into(view[received : received + _RECV_CHUNK])
        except TimeoutError:
            if deadline is None:
                raise
            raise DataPlaneError("the handshake did not complete in time", code="handshake_timeout") from None
        if count == 0:
            raise DataPlaneError("connection closed by the peer mid-message", code="connection_closed")
        received += count
    if lowat != 1:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def _expect_ok(sock: socket.socket) -> dict[str, Any]:
    reply = recv_message(sock)
    if not reply.get("ok"):
        raise DataPlaneError(str(reply.get("error", "refused")), code=str(reply.get("code", "refused")))
    return reply


# -- authentication -------------------------------------------------------------------------------------


def _proof(key: bytes, role: bytes, *nonces: bytes) -> str:
    return hmac.new(key, role + b"".join(nonces), hashlib.sha256).hexdigest()


def _client_handshake(sock: socket.socket, key: bytes, job_id: str, deadline: float | None = None) -> bytes:
    """Authenticate both ways; returns the session id (both nonces) that manifest MACs are bound to."""
    hello = recv_message(sock, MAX_PREAUTH_MESSAGE, deadline)
    if hello.get("protocol") != PROTOCOL or hello.get("job") != job_id:
        raise DataPlaneError(f"peer speaks {hello.get('protocol')!r} for job {hello.get('job')!r}")
    server_nonce = bytes.fromhex(str(hello["nonce"]))
    client_nonce = os.urandom(32)
    send_message(
        sock, {"nonce": client_nonce.hex(), "proof": _proof(key, b"client", server_nonce, client_nonce)}
    )
    reply = recv_message(sock, MAX_PREAUTH_MESSAGE, deadline)
    if not reply.get("ok"):
        raise AuthenticationFailed(f"peer refused us: {reply.get('error', 'authentication failed')}")
    if not hmac.compare_digest(
        str(reply.get("proof", "")), _proof(key, b"server", client_nonce, server_nonce)
    ):
        raise AuthenticationFailed("peer could not prove it knows the job's secret")
    return server_nonce + client_nonce


def _server_handshake(
    sock: socket.socket,
    key: bytes,
    job_id: str,
    on_failure: Callable[[], None],
    deadline: float | None = None,
) -> bytes | None:
    """Authenticate both ways; the session id (both nonces), or None when the peer failed to."""
    server_nonce = os.urandom(32)
    send_message(sock, {"protocol": PROTOCOL, "job": job_id, "nonce": server_nonce.hex()})
    answer = recv_message(sock, MAX_PREAUTH_MESSAGE, deadline)
    client_nonce = bytes.fromhex(str(answer.get("nonce", "")))
    expected = _proof(key, b"client", server_nonce, client_nonce)
    # Compared as bytes: compare_digest refuses str with characters beyond ASCII (a stranger's proof).
    proof = str(answer.get("proof", "")).encode()
    if len(client_nonce) != 32 or not hmac.compare_digest(proof, expected.encode()):
        on_failure()  # counted before the peer hears about it
        send_message(sock, {"ok": False, "code": "authentication_failed", "error": "authentication failed"})
        return None
    send_message(sock, {"ok": True, "proof": _proof(key, b"server", client_nonce, server_nonce)})
    return server_nonce + client_nonce


# -- manifest authentication ----------------------------------------------------------------------------


def manifest_mac(key: bytes, session: bytes, op: str, rank: int, manifest_json: bytes) -> str:
    """HMAC of a manifest's exact bytes, bound to this connection (its nonces), the operation and the rank,
    so a manifest can be neither altered nor replayed into another connection, operation or rank."""
    header = b"castor manifest v1\0" + session + f"\0{op}\0{rank}\0".encode()
    return hmac.new(key, header + manifest_json, hashlib.sha256).hexdigest()


def _put_op(rolled_back: Version | None) -> str:
    """The operation a put's MAC names: with the sender's rollback in it, so that it cannot be altered."""
    return "put" if rolled_back is None else f"put after rollback {rolled_back[0]}:{rolled_back[1]}"


def _rollback_of(request: dict[str, Any]) -> Version | None:
    """The rollback a put request says its sender restored, checked for shape (its MAC checks the rest)."""
    raw = request.get("rolled_back")
    if raw is None:
        return None
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or not all(type(v) is int and v >= 0 for v in raw)  # bool is no int here
    ):
        raise DataPlaneError(
            f"rolled_back must be [generation, iteration], not {raw!r}", code="invalid_request"
        )
    return raw[0], raw[1]


def _signed_manifest(key: bytes, session: bytes, op: str, rank: int, manifest: Manifest) -> dict[str, str]:
    text = manifest.to_json()
    return {"manifest": text.decode("ascii"), "mac": manifest_mac(key, session, op, rank, text)}


def _authentic_manifest(message: dict[str, Any], key: bytes, session: bytes, op: str, rank: int) -> Manifest:
    """The manifest a message carries, only if its MAC is right (checked before the JSON is parsed)."""
    text, mac = message.get("manifest"), message.get("mac")
    if not isinstance(text, str) or not isinstance(mac, str):
        raise DataPlaneError("the manifest carries no MAC", code="manifest_unauthenticated")
    raw = text.encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(mac, manifest_mac(key, session, op, rank, raw)):
        raise DataPlaneError(
            f"the manifest of rank {rank} failed its MAC (altered on the way, or not from this job's peer)",
            code="manifest_unauthenticated",
        )
    try:
        return Manifest.from_json(raw)
    except ValueError as exc:
        raise DataPlaneError(str(exc), code="invalid_manifest") from exc


# -- client side ----------------------------------------------------------------------------------------


class PeerConnection:
    """An authenticated connection to another agent's data plane."""

    def __init__(self, address: str, port: int, key: bytes, job_id: str, timeout_s: float = 30.0):
        self.peer = f"{address}:{port}"
        self.key = key
        self.sock = socket.create_connection((address, port), timeout=timeout_s)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.session = _client_handshake(self.sock, key, job_id, time.monotonic() + timeout_s)
            self.sock.settimeout(timeout_s)
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> PeerConnection:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def put(
        self, rank: int, manifest: Manifest, data: memoryview, rolled_back: Version | None = None
    ) -> None:
        """Push `rank`'s checkpoint; returns once the peer verified and committed it."""
        if self.send_put(rank, manifest, data, rolled_back=rolled_back) == "sent":
            self.finish_put()

    def send_put(
        self,
        rank: int,
        manifest: Manifest,
        data: memoryview,
        superseded: Callable[[], bool] = lambda: False,
        pace: Callable[[int], int] | None = None,
        rolled_back: Version | None = None,
    ) -> Literal["sent", "stale", "superseded"]:
        """The part of a put that reads `data`: the request, then every stripe. "stale": the peer already
        holds this checkpoint or a newer one. "superseded": `superseded()` turned true between stripes, or
        while the peer stalled, and the transfer was abandoned; the caller must close the connection (the
        peer then drops the partial replica and keeps its previous one). After "sent", `finish_put()` waits
        for the peer's verdict while the caller's slot is already free again. `pace(n)`, when given, is asked
        before each piece with the bytes left of the stripe and answers how many to send now (0: ask again;
        worker_lib/agent/pacing.py: the job's replication policy). `rolled_back`: (plan generation, iteration)
        of this machine's last restore, which a holder that has not restored yet learns from it
        (DataPlaneServer._held_instead)."""
        signed = _signed_manifest(self.key, self.session, _put_op(rolled_back), rank, manifest)
        request: dict[str, Any] = {"op": "put", "rank": rank, **signed}
        if rolled_back is not None:
            request["rolled_back"] = list(rolled_back)
        send_message(self.sock, request)
        try:
            _expect_ok(self.sock)
        except DataPlaneError as exc:
            if exc.code == "stale":
                return "stale"
            raise
        for stripe in manifest.stripes:
            view = data[stripe.start : stripe.end]
            while len(view):
                if superseded():
                    return "superseded"
                size = len(view) if pace is None else min(len(view), pace(len(view)))
                if size <= 0:
                    continue
                if not self._send_unless(superseded, view[:size]):
                    return "superseded"
                view = view[size:]
        return "sent"

    def _send_unless(self, superseded: Callable[[], bool], view: memoryview) -> bool:
        """sendall, but a peer that stops taking bytes (a stalled receiver) is no reason to keep holding the
        slot once a newer commit superseded this transfer: asked every _STALL_CHECK_S of stall. False when
        abandoned; TimeoutError after the connection's timeout without progress."""
        patience = self.sock.gettimeout()
        self.sock.settimeout(_STALL_CHECK_S)
        try:
            sent, stalled_since = 0, None
            while sent < len(view):
                try:
                    sent += self.sock.send(view[sent:])
                    stalled_since = None
                except TimeoutError:
                    if superseded():
                        return False
                    stalled_since = stalled_since or time.monotonic()
                    if patience is not None and time.monotonic() - stalled_since > patience:
                        raise TimeoutError(f"{self.peer} took no data for {patience:g} s") from None
            return True
        finally:
            self.sock.settimeout(patience)

    def finish_put(self) -> None:
        """Wait until the peer verified and committed the checkpoint `send_put` sent."""
        _expect_ok(self.sock)

    def get(
        self,
        rank: int,
        destination: SlotStore,
        iteration: int | None = None,
        tier: str = "any",
        *,
        digest: str | None = None,
        max_bytes: int | None = None,
    ) -> Manifest:
        """Fetch `rank`'s checkpoint (the newest, or exactly `iteration`, with content `digest` when given)
        into `destination`, verifying each stripe as it arrives; nothing is committed unless all of it
        verified. A manifest that fails its MAC, is not the `digest` asked for or is larger than
        `max_bytes` is refused before any of its data is stored, and the connection is closed (the data
        that follows is not drained: it may be anything)."""
        send_message(
            self.sock, {"op": "get", "rank": rank, "iteration": iteration, "tier": tier, "digest": digest}
        )
        reply = _expect_ok(self.sock)
        try:
            manifest = _authentic_manifest(reply, self.key, self.session, "get", rank)
            if iteration is not None and manifest.iteration != iteration:
                raise DataPlaneError(
                    f"{self.peer} sent iteration {manifest.iteration} of rank {rank}, not {iteration}",
                    code="wrong_checkpoint",
                )
            if digest is not None and manifest.digest != digest:
                raise DataPlaneError(
                    f"{self.peer} sent rank {rank}'s checkpoint with digest {manifest.digest}, not the "
                    f"{digest} asked for",
                    code="digest_mismatch",
                )
            _check_size(manifest, rank, max_bytes)
        except DataPlaneError:
            self.close()
            raise
        receive_checkpoint(self.sock, manifest, destination)
        return manifest

    def check(self, rank: int, iteration: int | None, digest: str) -> str | None:
        """Ask the peer to verify the bytes of its copy of `rank`'s checkpoint (after a fetch of it failed
        its checksums here: corrupt in the peer's memory, which condemns it there, or only in transit);
        None when intact, else the problem."""
        send_message(self.sock, {"op": "check", "rank": rank, "iteration": iteration, "digest": digest})
        problem = _expect_ok(self.sock).get("problem")
        return None if problem is None else str(problem)

    def inventory(self, verify: bool = False) -> list[dict[str, Any]]:
        send_message(self.sock, {"op": "inventory", "verify": verify})
        holdings: list[dict[str, Any]] = _expect_ok(self.sock)["holdings"]
        return holdings


# A fetch is tried again on a fresh connection when the transport failed and the peer never answered: it
# closed or reset the connection (a handshake it dropped after its deadline because this machine, the peer
# or the link between them was too slow: a loaded host, a congested NIC; a transfer cut mid-way). Never when
# the peer answered (not found, refused, a bad checksum) nor when nobody listens there or it does not answer
# at all (connection refused, a timeout: a lost machine, a partition), so a recovery falls back at once.
FETCH_ATTEMPTS = 3
# (Not this side's own handshake timeout: a peer that accepts and never speaks, a hung agent, would make a
# recovery wait a connection timeout per attempt.)
_FETCH_RETRY_CODES = ("connection_closed",)


def fetch(
    address: str,
    port: int,
    key: bytes,
    job_id: str,
    rank: int,
    destination: SlotStore,
    iteration: int | None = None,
    tier: str = "any",
    *,
    digest: str | None = None,
    max_bytes: int | None = None,
    attempts: int = FETCH_ATTEMPTS,
    retry_delay_s: float = 0.2,
    on_retry: Callable[[Exception], None] = lambda exc: None,
) -> Manifest:
    """`PeerConnection(...).get(...)` (see there), on a new connection up to `attempts` times in all while the
    transport fails as described at FETCH_ATTEMPTS; `on_retry(exc)` hears of each failure tried again.
    A checkpoint that fails its checksums here is not fetched again: the peer is asked to check its copy
    (corrupt in its memory, which condemns it there so that no plan names it again, or only on the way),
    and the error says which."""
    for attempt in range(1, attempts + 1):
        try:
            with PeerConnection(address, port, key, job_id) as peer:
                return peer.get(rank, destination, iteration, tier, digest=digest, max_bytes=max_bytes)
        except (DataPlaneError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
            if isinstance(exc, DataPlaneError) and exc.code == "checksum_mismatch" and digest is not None:
                raise _with_source_verdict(exc, address, port, key, job_id, rank, iteration, digest) from exc
            transient = not isinstance(exc, DataPlaneError) or (
                exc.code in _FETCH_RETRY_CODES and not isinstance(exc, AuthenticationFailed)
            )
            if not transient or attempt >= attempts:
                raise
            log.warning(
                "fetching rank %d iteration %s from %s:%d failed (%s): trying again (%d of %d)",
                rank,
                iteration,
                address,
                port,
                exc,
                attempt + 1,
                attempts,
            )
            on_retry(exc)
            time.sleep(retry_delay_s * attempt)
    raise AssertionError("unreachable")  # the loop returns or raises


def _with_source_verdict(
    failed: DataPlaneError,
    address: str,
    port: int,
    key: bytes,
    job_id: str,
    rank: int,
    iteration: int | None,
    digest: str,
) -> DataPlaneError:
    """`failed` (a fetch that failed its checksums), with what the source found checking its own copy."""
    try:
        with PeerConnection(address, port, key, job_id) as peer:
            problem = peer.check(rank, iteration, digest)
    except (DataPlaneError, OSError) as exc:
        return DataPlaneError(f"{failed}; the source could not check its copy: {exc}", failed.code)
    verdict = (
        "intact at the source: damaged on the way" if problem is None else f"corrupt at the source: {problem}"
    )
    return DataPlaneError(f"{failed}; {verdict}", failed.code)


def receive_checkpoint(sock: socket.socket, manifest: Manifest, destination: SlotStore) -> None:
    """Receive `manifest.data_bytes` into a slot of `destination`, checking every stripe as it completes.

    A connection dropped or a stripe that does not match aborts the slot (it stays empty, the previous
    checkpoint untouched); the sender is told why when the connection still works."""
    _check_manifest(manifest)
    try:
        writer = destination.open_write(manifest.iteration, manifest.data_bytes, on_busy="wait")
    except CheckpointError as exc:  # no room in shared memory, typically: the sender hears why
        _drain(sock, manifest.data_bytes)
        raise DataPlaneError(f"cannot store the checkpoint here: {exc}", code="store_failed") from exc
    assert writer is not None  # on_busy="wait" blocks instead of returning None
    committed = False
    try:
        view = memoryview(writer.buffer)
        for index, stripe in enumerate(manifest.stripes):
            _recv_into(sock, view[stripe.start : stripe.end], batch=_RECV_BATCH)
            if xxhash.xxh3_64_hexdigest(view[stripe.start : stripe.end]) != stripe.digest:
                # Drain the rest so the stream stays framed, then report which stripe was bad.
                _drain(sock, manifest.data_bytes - stripe.end)
                raise DataPlaneError(
                    f"stripe {index} (bytes {stripe.start}..{stripe.end}) of rank checkpoint iteration "
                    f"{manifest.iteration} failed its {manifest.checksum} check; not committed",
                    code="checksum_mismatch",
                )
        writer.commit(manifest)
        committed = True
    finally:
        if not committed:
            writer.abort()


def _check_manifest(manifest: Manifest) -> None:
    """Per-stripe checksums alone would let a malformed manifest leave bytes of the slot unchecked."""
    try:
        check_structure(manifest)
    except CheckpointCorruptError as exc:
        raise DataPlaneError(str(exc), code="invalid_manifest") from exc


def _check_size(manifest: Manifest, rank: int, max_bytes: int | None) -> None:
    """A peer's manifest sizes the slots it is written into: never beyond what this machine keeps for a
    rank, or one peer could fill shared memory and starve the training processes of this machine."""
    if max_bytes is not None and manifest.data_bytes > max_bytes:
        raise DataPlaneError(
            f"a checkpoint of rank {rank} of {manifest.data_bytes} bytes exceeds the {max_bytes} bytes this "
            "machine keeps per rank (the job's checkpoint_bytes_max; without one, "
            f"{REPLICA_BYTES_MAX_ENV} or an equal share of /dev/shm)",
            code="too_large",
        )


def _drain(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, _RECV_CHUNK) or 1))
    while nbytes > 0:
        count = sock.recv_into(scratch[: min(nbytes, len(scratch))])
        if count == 0:
            return
        nbytes -= count


# -- server side ----------------------------------------------------------------------------------------


@dataclass
class ServerCounters:
    replicas_received: int = 0
    replicas_rejected: int = 0
    checkpoints_served: int = 0
    auth_failures: int = 0
    handshakes_dropped: int = 0  # oversized frames, deadline passed, malformed hello answers
    connections_refused: int = 0  # closed at accept: too many peers in the handshake already
    accept_errors: int = 0  # accept() failed (out of descriptors or memory): tried again


class DataPlaneServer:
    """Accepts authenticated peers: replicas pushed to this machine, and fetches of what it holds."""

    def __init__(
        self,
        holdings: Holdings,
        key: bytes,
        job_id: str,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        accepts_replica_of: Callable[[int], bool] = lambda rank: True,
        on_replica: Callable[[int, Manifest], None] = lambda rank, manifest: None,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        nice: int = REPLICATION_NICE,
    ):
        """How large a replica of a rank may be is the holdings' `replica_bytes_max(rank)`. The connections'
        threads run `nice` steps below the process (worker_lib.agent.priority)."""
        self.holdings = holdings
        self.key = key
        self.job_id = job_id
        # (plan generation, iteration) of this machine's last restore (the agent sets it): a replica of an
        # earlier generation past that iteration is of the history the recovery abandoned, newer in number
        # only, and the restored iteration replaces it.
        self.rolled_back: Version | None = None
        self._rollback_lock = threading.Lock()
        self.accepts_replica_of = accepts_replica_of
        self.on_replica = on_replica
        self.max_unauthenticated = max_unauthenticated
        self.handshake_timeout_s = handshake_timeout_s
        self.nice = nice
        self._unauthenticated = 0  # connections accepted and not yet through the handshake
        self.counters = ServerCounters()
        self._rank_locks: dict[int, threading.Lock] = {}
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="castor-dataplane", daemon=True)
        # Open peer connections, so that stop() can end them before the caller closes the holdings
        # they read from and write into.
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._connections_lock = threading.Lock()
        # Every connection thread not known to have ended: one that leaves its connection as stop() begins
        # (it saw the closing flag) is out of `_connections` before it has returned, and stop() waits for
        # it too.
        self._threads: set[threading.Thread] = set()

    def start(self) -> DataPlaneServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        with self._connections_lock:
            connections, threads = list(self._connections), list(self._threads)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5
        for thread in threads:
            if thread.ident is not None:  # started (the accept loop starts each right after listing it)
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _count_auth_failure(self) -> None:
        self.counters.auth_failures += 1

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError as exc:
                if self._closing.is_set():
                    return  # close() shut the listener
                # Out of descriptors or memory (EMFILE, ENOBUFS), or a connection that failed before it was
                # accepted: this machine must go on serving its checkpoints, or every restore that reads
                # from it fails. Said, and tried again shortly.
                self.counters.accept_errors += 1
                errors = self.counters.accept_errors
                if errors & (errors - 1) == 0:  # 1, 2, 4, 8...: said, without flooding the log
                    log.warning("the data plane could not accept a connection (%s); trying again", exc)
                self._closing.wait(ACCEPT_RETRY_S)
                continue
            thread = threading.Thread(
                target=self._serve, args=(sock, peer), name=f"castor-dataplane-{peer[1]}", daemon=True
            )
            with self._connections_lock:
                if self._closing.is_set():
                    sock.close()
                    return
                if self._unauthenticated >= self.max_unauthenticated:
                    # Strangers cannot make us start threads without bound: closed without a word.
                    self.counters.connections_refused += 1
                    refused = self.counters.connections_refused
                    sock.close()
                    if refused & (refused - 1) == 0:  # 1, 2, 4, 8...: said, without flooding the log
                        log.warning(
                            "closed data-plane connection from %s:%s: %d peers already in the handshake "
                            "(%d refused so far)",
                            peer[0],
                            peer[1],
                            self.max_unauthenticated,
                            refused,
                        )
                    continue
                self._unauthenticated += 1
                self._connections[sock] = thread
                self._threads = {t for t in self._threads if t.is_alive()}
                self._threads.add(thread)
            thread.start()

    def _serve(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        lower_thread_priority(self.nice)  # receiving replicas yields the cores to training
        try:
            self._serve_peer(sock, peer)
        finally:
            with self._connections_lock:
                self._connections.pop(sock, None)
            sock.close()

    def _handshake(self, sock: socket.socket, peer: tuple[str, int]) -> bytes | None:
        """The session id, or None (the peer is dropped); either way it is no longer unauthenticated."""
        try:
            sock.settimeout(self.handshake_timeout_s)
            session = _server_handshake(
                sock,
                self.key,
                self.job_id,
                self._count_auth_failure,
                deadline=time.monotonic() + self.handshake_timeout_s,
            )
            if session is None:
                log.warning("refused data-plane peer %s:%s: authentication failed", *peer)
            return session
        except (OSError, DataPlaneError, ValueError) as exc:
            self.counters.handshakes_dropped += 1
            # A peer that just hung up (a port probe) is routine; one that overstepped a bound is not.
            quiet = isinstance(exc, DataPlaneError) and exc.code == "connection_closed"
            log.log(
                logging.INFO if quiet else logging.WARNING,
                "dropped data-plane peer %s:%s during the handshake: %s",
                peer[0],
                peer[1],
                exc,
            )
            return None
        finally:
            with self._connections_lock:
                self._unauthenticated -= 1

    def _serve_peer(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = self._handshake(sock, peer)
        if session is None:
            return
        try:
            sock.settimeout(120)
            while not self._closing.is_set():
                try:
                    request = recv_message(sock)
                except DataPlaneError as exc:
                    if exc.code == "connection_closed":
                        return
                    raise
                self._dispatch(sock, session, request)
        except (OSError, DataPlaneError, ValueError) as exc:
            log.info("data-plane connection from %s:%s ended: %s", peer[0], peer[1], exc)
        except Exception:  # e.g. shared memory full while writing a replica: say so, drop the peer
            log.exception("data-plane connection from %s:%s failed", peer[0], peer[1])

    def _dispatch(self, sock: socket.socket, session: bytes, request: dict[str, Any]) -> None:
        op = request.get("op")
        if op == "put":
            self._put(sock, session, int(request["rank"]), request)
        elif op == "get":
            iteration, digest = request.get("iteration"), request.get("digest")
            self._get(
                sock,
                session,
                int(request["rank"]),
                None if iteration is None else int(iteration),
                request["tier"],
                None if digest is None else str(digest),
            )
        elif op == "inventory":
            holdings = self.holdings.inventory(verify_checksums=bool(request.get("verify")))
            send_message(sock, {"ok": True, "holdings": [h.to_json() for h in holdings]})
        elif op == "check":
            iteration = request.get("iteration")
            problem = self.holdings.check_copy(
                int(request["rank"]), None if iteration is None else int(iteration), str(request["digest"])
            )
            send_message(sock, {"ok": True, "problem": problem})
        else:
            send_message(sock, {"ok": False, "code": "unknown_op", "error": f"unknown operation {op!r}"})

    def _refuse(self, sock: socket.socket, exc: DataPlaneError) -> None:
        self.counters.replicas_rejected += 1
        send_message(sock, {"ok": False, "code": exc.code, "error": str(exc)})

    def _put(self, sock: socket.socket, session: bytes, rank: int, request: dict[str, Any]) -> None:
        # Refusals come before any data is sent, so the stream stays framed.
        try:
            offered_rollback = _rollback_of(request)
            manifest = _authentic_manifest(request, self.key, session, _put_op(offered_rollback), rank)
        except DataPlaneError as exc:
            log.error("refused a replica of rank %d: %s", rank, exc)
            self._refuse(sock, exc)
            return
        if not self.accepts_replica_of(rank):
            self.counters.replicas_rejected += 1
            send_message(
                sock,
                {
                    "ok": False,
                    "code": "not_a_replica_holder",
                    "error": f"this machine does not hold replicas of rank {rank}",
                },
            )
            return
        try:
            _check_size(manifest, rank, self.holdings.replica_bytes_max(rank))
            _check_manifest(manifest)
        except DataPlaneError as exc:
            if exc.code == "too_large":
                log.error("refused a replica: %s", exc)
            self._refuse(sock, exc)
            return
        # A sender that restored in a newer plan than this machine knows of: this machine restores in that
        # plan too (its agent has not got the directive yet), at the same iteration (a plan restores one
        # iteration for every rank). Learnt now, its restored iteration is taken in place of a newer replica
        # of the abandoned history, instead of being refused as stale and held nowhere here.
        if offered_rollback is not None:
            self.learn_rollback(offered_rollback)
        # One writer per rank's replica store at a time, and never an older checkpoint over a newer one of
        # the same history (a slow, superseded transfer arriving last must not roll the replica back).
        with self._rank_locks.setdefault(rank, threading.Lock()):
            held = self._held_instead(rank, manifest)
            if held is not None:
                send_message(
                    sock,
                    {
                        "ok": False,
                        "code": "stale",
                        "error": f"already holds iteration {held.iteration} of rank {rank}",
                    },
                )
                return
            send_message(sock, {"ok": True})
            try:
                receive_checkpoint(sock, manifest, self.holdings.replica_store(rank))
            except DataPlaneError as exc:
                self.counters.replicas_rejected += 1
                send_message(sock, {"ok": False, "code": exc.code, "error": str(exc)})
                return
        self.counters.replicas_received += 1
        send_message(sock, {"ok": True, "iteration": manifest.iteration})
        self.on_replica(rank, manifest)

    def learn_rollback(self, rolled_back: Version) -> None:
        """A recovery restored iteration `rolled_back[1]` as plan generation `rolled_back[0]`: this machine's
        own restore, or a peer's that restored in a newer plan. The newest plan's stands."""
        with self._rollback_lock:  # the agent's restore and the connections' threads
            if self.rolled_back is None or rolled_back > self.rolled_back:
                self.rolled_back = rolled_back

    def _held_instead(self, rank: int, offered: Manifest) -> Manifest | None:
        """The replica of `rank` held here that makes `offered` stale (as new or newer, of the current
        history), or None: then `offered` is taken. A checkpoint of the history the last recovery abandoned
        (an earlier generation past the restored iteration: `rolled_back`) is newer in number only: it never
        makes an offer stale, and is never taken itself."""
        if not self.holdings.directory("replica", rank).is_dir():
            return None
        try:
            held = self.holdings.replica_store(rank).committed()
        except CheckpointCorruptError:
            return None
        rolled_back = self.rolled_back  # one reading: another connection may teach it a newer one
        current = [m for m in held if not abandoned(version(m), rolled_back)]
        newest = max(current, key=version, default=None)
        if abandoned(version(offered), rolled_back):
            return newest or (held[0] if held else offered)
        return newest if newest is not None and version(newest) >= version(offered) else None

    def _get(
        self,
        sock: socket.socket,
        session: bytes,
        rank: int,
        iteration: int | None,
        tier: Literal["local", "replica", "any"],
        digest: str | None,
    ) -> None:
        try:
            with self.holdings.open_read(rank, iteration, tier, digest=digest) as (manifest, data):
                signed = _signed_manifest(self.key, session, "get", rank, manifest)
                send_message(sock, {"ok": True, **signed})
                for stripe in manifest.stripes:
                    sock.sendall(data[stripe.start : stripe.end])
        except CheckpointNotFoundError as exc:
            send_message(sock, {"ok": False, "code": "not_found", "error": str(exc)})
            return
        except CheckpointError as exc:
            send_message(sock, {"ok": False, "code": "unreadable", "error": str(exc)})
            return
        self.counters.checkpoints_served += 1
