"""Replication of committed checkpoints to placement-group peers, newest first, never blocking training.

One sender thread per peer machine. A commit notice marks the rank as pending for every peer; a sender
takes the rank's newest committed checkpoint at the moment it starts (so when commits arrive faster than
a peer can take them, the newest wins and the ones in between are skipped and counted) and streams it
straight from shared memory, holding the slot's shared lock so the training process cannot overwrite it
mid-transfer. The lock is held only while the bytes are read, and a transfer that a newer commit
superseded is abandoned between stripes, so the training process gets the slot back within a stripe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker_lib.agent.dataplane import DataPlaneError, PeerConnection
from worker_lib.agent.holdings import Holdings, manifest_generation
from worker_lib.errors import CheckpointError
from worker_lib.store.manifest import Manifest

log = logging.getLogger(__name__)

PeerAddress = tuple[str, int]
REFUSALS = ("too_large", "manifest_unauthenticated")  # codes of a receiver that will refuse again
Version = tuple[int, int]  # (plan generation, iteration): after a rollback an iteration number recurs


def version(manifest: Manifest) -> Version:
    return manifest_generation(manifest), manifest.iteration


@dataclass
class ReplicationStats:
    sent: int = 0  # checkpoints a peer verified and committed
    skipped: int = 0  # commits superseded by a newer one before they were sent
    failed: int = 0
    bytes_sent: int = 0
    last_lag_s: float | None = None  # from the commit to the peer's verified replica
    replicated: dict[int, int] = field(default_factory=dict)  # rank -> newest iteration every peer holds


class _PeerSender:
    def __init__(self, replicator: Replicator, machine: int):
        self.replicator = replicator
        self.machine = machine
        self.pending: dict[int, int] = {}  # rank -> newest iteration noticed
        self.sent: dict[int, Version] = {}  # rank -> the checkpoint this peer holds
        self.condition = threading.Condition()
        self.connection: PeerConnection | None = None
        self.thread = threading.Thread(target=self._run, name=f"castor-replicate-to-{machine}", daemon=True)

    def notice(self, rank: int, iteration: int) -> None:
        with self.condition:
            if rank in self.pending:
                self.replicator.stats.skipped += 1
            self.pending[rank] = max(iteration, self.pending.get(rank, iteration))
            self.condition.notify()

    def _next(self) -> tuple[int, int] | None:
        with self.condition:
            while not self.pending and not self.replicator.stopping.is_set():
                self.condition.wait(0.5)
            if self.replicator.stopping.is_set():
                return None
            rank = min(self.pending)
            return rank, self.pending.pop(rank)

    def _run(self) -> None:
        backoff = 0.2
        while (item := self._next()) is not None:
            rank, iteration = item
            address = self.replicator.peer_address(self.machine)
            if address is None:  # the peer has not registered yet
                self._retry_later(rank, iteration, 0.5)
                continue
            try:
                self._send(rank, address)
                backoff = 0.2
            except Exception as exc:  # the thread must outlive any one transfer, a bug's too
                self.replicator.stats.failed += 1
                expected = isinstance(exc, OSError | DataPlaneError | CheckpointError)
                # A peer that refuses the checkpoint itself (larger than it keeps for the rank, or a MAC that
                # fails: another job's key) will refuse it again: an operator has to act, not the network.
                refused = isinstance(exc, DataPlaneError) and exc.code in REFUSALS
                log.log(
                    logging.ERROR if refused else logging.WARNING,
                    "replicating rank %d to machine %d failed: %s",
                    rank,
                    self.machine,
                    exc,
                    exc_info=None if expected else exc,
                )
                self._disconnect()
                self._retry_later(rank, iteration, backoff)
                backoff = min(backoff * 2, 5.0)
        self._disconnect()

    def _send(self, rank: int, address: PeerAddress) -> None:
        replicator = self.replicator
        # The slot is held (shared lock) only while its bytes are read: the training process writes its
        # next checkpoint into the other slot, and the one after into this one, which it can then do as
        # soon as a newer commit made this transfer pointless (the newest wins).
        with replicator.holdings.open_read(rank, tier="local") as (manifest, data):
            if self.sent.get(rank) == version(manifest):
                return
            if self.connection is None:
                self.connection = PeerConnection(*address, replicator.key, replicator.job_id)
            outcome = self.connection.send_put(
                rank, manifest, data, superseded=lambda: self._superseded(rank, manifest.iteration)
            )
        if outcome == "superseded":
            self._disconnect()  # the peer drops the partial replica and keeps its previous one
            replicator.stats.skipped += 1
            return
        if outcome == "sent":
            self.connection.finish_put()
        self.sent[rank] = version(manifest)
        replicator.stats.sent += 1
        replicator.stats.bytes_sent += manifest.data_bytes
        replicator.stats.last_lag_s = max(0.0, time.time() - manifest.committed_at)
        replicator.on_replicated(self.machine, rank, manifest.iteration)

    def _superseded(self, rank: int, iteration: int) -> bool:
        with self.condition:
            return self.pending.get(rank, -1) > iteration

    def _retry_later(self, rank: int, iteration: int, delay: float) -> None:
        if self.replicator.stopping.wait(delay):
            return
        with self.condition:
            self.pending.setdefault(rank, iteration)
            self.condition.notify()

    def _disconnect(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


class Replicator:
    """Sends this machine's committed checkpoints to the peer machines the placement names."""

    def __init__(
        self,
        holdings: Holdings,
        key: bytes,
        job_id: str,
        targets: list[int],
        peer_address: Callable[[int], PeerAddress | None],
    ):
        self.holdings = holdings
        self.key = key
        self.job_id = job_id
        self.peer_address = peer_address
        self.stats = ReplicationStats()
        self.stopping = threading.Event()
        self._senders = [_PeerSender(self, machine) for machine in targets]
        self._replicated_by: dict[int, dict[int, int]] = {}  # rank -> {machine: iteration}
        self._lock = threading.Lock()

    def start(self) -> Replicator:
        for sender in self._senders:
            sender.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for sender in self._senders:
            with sender.condition:
                sender.condition.notify()
            if sender.thread.is_alive():
                sender.thread.join(timeout=5)

    def flush(self, ranks: list[int], timeout_s: float = 60.0) -> bool:
        """Block until every peer holds the newest committed checkpoint of each of `ranks` (False on
        timeout): a machine whose training finished replicates its last checkpoint before it says so."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            newest = {rank: m for rank in ranks if (m := self.holdings.newest("local", rank)) is not None}
            if all(
                sender.sent.get(rank) == version(manifest)
                for sender in self._senders
                for rank, manifest in newest.items()
            ):
                return True
            for sender in self._senders:
                for rank, manifest in newest.items():
                    if sender.sent.get(rank) != version(manifest):
                        sender.notice(rank, manifest.iteration)
            time.sleep(0.05)
        return False

    def notice_commit(self, rank: int, iteration: int) -> None:
        for sender in self._senders:
            sender.notice(rank, iteration)

    def on_replicated(self, machine: int, rank: int, iteration: int) -> None:
        with self._lock:
            per_peer = self._replicated_by.setdefault(rank, {})
            per_peer[machine] = iteration
            if len(per_peer) == len(self._senders):
                self.stats.replicated[rank] = min(per_peer.values())
