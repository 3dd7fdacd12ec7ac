"""A machine's Castor services, shared by the agent and the embedded mode: registration with the root,
the data plane (replicas in, checkpoints out), replication of local commits to placement peers, commit
notices from the training processes, and heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_lib.agent.dataplane import REPLICA_BYTES_MAX_ENV, DataPlaneServer, data_plane_key
from worker_lib.agent.heartbeat import etcd_heartbeats, rest_heartbeats
from worker_lib.agent.holdings import SLOTS, Holdings, local_slots, manifest_generation, rank_capacity
from worker_lib.agent.pacing import replication_pacer
from worker_lib.agent.priority import REPLICATION_NICE
from worker_lib.agent.replication import Replicator, aligned_rounds
from worker_lib.agent_ipc import FRESH_START, notify_socket_path, prepare_notify_socket
from worker_lib.api.shared import INT32_MAX, MAX_CHECKPOINTS_PER_MINUTE, Peer, RankPlacement
from worker_lib.api.worker import DirectiveOut, HeartbeatResponse, RegisterResponse, ReplicationAlignment
from worker_lib.client import RootClient, RootRejected, RootUnavailable, UnexpectedAnswer
from worker_lib.errors import CheckpointCorruptError, CheckpointNotFoundError
from worker_lib.persistent import ObjectStore, object_store, shard_key
from worker_lib.store.integrity import verify
from worker_lib.store.manifest import Manifest
from worker_lib.store.slots import storage_filesystem

log = logging.getLogger(__name__)

# 4xx answers worth sending again: a request timeout, too many requests, and the root's "conflict" (a race
# between two writers it asks the client to retry). Any other 4xx refuses the request for good.
RETRIED_STATUSES = frozenset({408, 429})
RETRIED_CODES = frozenset({"conflict"})


def _identity(status: os.stat_result) -> tuple[int, int]:
    return status.st_dev, status.st_ino


def refused_for_good(exc: BaseException) -> bool:
    """Whether the root refused a request in a way that sending it again cannot change."""
    return (
        isinstance(exc, RootRejected) and exc.status not in RETRIED_STATUSES and exc.code not in RETRIED_CODES
    )


# The directive long poll's answers (changed or not) keep the peers' addresses current. They are fetched
# apart only while a peer this machine sends to has no address yet, or once the long poll has been silent
# for its wait plus PEERS_REFRESH_S (the agent is busy acting on a directive), then every PEERS_REFRESH_S.
PEERS_REFRESH_S = 10.0
PEERS_REFRESH_MISSING_S = 1.0
# Aligned rounds: the alignment long poll's wait (the root answers as soon as the job's alignment changes),
# and the pause after a poll that failed (the heartbeats' answers still carry the alignment meanwhile).
ALIGNMENT_WAIT_S = 5.0
ALIGNMENT_RETRY_S = 1.0


@dataclass
class MachineIdentity:
    """Who this machine is and where its peers reach it."""

    instance_id: str
    address: str = "127.0.0.1"
    bind: str = "0.0.0.0"
    data_port: int = 0
    machine_rank: int | None = None  # ask for this rank; default: the root picks
    embedded: bool = False  # torchrun runs the training processes (see worker_lib.embedded)
    replication_nice: int = REPLICATION_NICE  # replication's threads run below training (agent.priority)


def follow(replicator: Replicator, alignment: ReplicationAlignment | None) -> None:
    """Act on the root's alignment of the job; None: the job does not align (not yet, or a machine replicates
    free rounds), so neither does this machine."""
    if alignment is None:
        replicator.unalign()
    else:
        replicator.align(alignment.aligned_iteration, alignment.target, alignment.go)


class MachineServices:
    def __init__(self, client: RootClient, token: str, identity: MachineIdentity, shm_root: Path):
        self.client = client
        self.identity = identity
        self.key = data_plane_key(token)
        # This process's id for the root: a registration sent again (a retry whose answer was lost, a
        # re-registration) is not an agent restart, in which the training processes died.
        self.session = uuid.uuid4().hex
        self.holdings = Holdings(shm_root, replica_bytes_max=lambda rank: self.capacity)
        self.capacity: int | None = None  # bytes of one rank's checkpoint, set at registration
        self.registration: RegisterResponse | None = None  # the root's answer, once registered
        self.addresses: dict[int, tuple[str, int]] = {}
        self.long_poll_answered_at: float | None = None  # monotonic: the directive long poll's last answer
        self.server: DataPlaneServer | None = None
        self.replicator: Replicator | None = None
        # rank -> its training process's recent commit times: the last minute's, and at least the newest two
        # (an iteration longer than a minute still has a rate), of one process (a restart's gap is no
        # iteration)
        self.commits: dict[int, deque[float]] = {}
        self._commit_pids: dict[int, int] = {}
        self.committed = 0
        # rank -> the iteration its newest training process restored, and the newest one it held then
        self.restored: dict[int, int] = {}
        self.newest_at_restore: dict[int, int] = {}
        self.skipped = 0
        # What checkpointing cost each local rank's training thread (Checkpointer stats: seconds blocked in
        # Castor, over save() calls), summed over its training processes since the agent started: the
        # processes that ended, and the current one as (pid, seconds, calls).
        self._stall_ended: dict[int, tuple[float, int]] = {}
        self._stall_current: dict[int, tuple[int, float, int]] = {}
        self.on_commit: Callable[[int, int], None] | None = None  # the agent watches for resumption
        self.finished_ranks: set[int] = set()  # ranks whose Checkpointer closed without an exception
        self.extra_summary: Callable[[], dict[str, Any]] = dict
        # The filesystem of the machine's checkpoint directory when it is on storage, not memory.
        self.store_filesystem: str | None = None
        # Checkpoints on a disk filesystem cost training a writeback at every save, and each training
        # process warns on its own stderr only: every heartbeat says so, and the job's page shows it.
        on_storage = storage_filesystem(self.holdings.root)
        if on_storage is not None:
            self.store_filesystem = on_storage[1]
            log.warning(
                "the checkpoint directory %s is on %s (mounted at %s), not in memory: every save and "
                "replica is written back to storage; point --shm-dir (CASTOR_AGENT_SHM_DIR) at a tmpfs such "
                "as /dev/shm",
                self.holdings.root,
                on_storage[1],
                on_storage[0],
            )
        self.uploads = Uploads(self)
        self._notices: asyncio.DatagramTransport | None = None
        self._notices_bound: tuple[int, int] | None = None  # (device, inode) of the socket it bound

    @property
    def job_id(self) -> str:
        return self.client.job_id

    @property
    def notify_socket(self) -> Path:
        return notify_socket_path(self.holdings.root)

    async def start(self) -> None:
        """Listen on the data plane, register, start replicating and listening for commits."""
        self.holdings.root.mkdir(parents=True, exist_ok=True)
        self.server = DataPlaneServer(
            self.holdings,
            self.key,
            self.job_id,
            host=self.identity.bind,
            port=self.identity.data_port,
            accepts_replica_of=self.holds_replicas_of,
            nice=self.identity.replication_nice,
        ).start()
        await self.register()
        if not self.identity.embedded:
            # Before any training process opens its store: a round pins two slots of each, the training
            # process rotates over the others (torchrun's processes may have opened theirs already).
            self.holdings.prepare_local(self.local_ranks(), self.local_slots)
        self.replicator = Replicator(
            self.holdings,
            self.key,
            self.job_id,
            self.sends_to(),
            self.addresses.get,
            nice=self.identity.replication_nice,
        )
        # The job's replication policy (interleaved or eager) and cap, as the root handed them over.
        self.replicator.pacer = replication_pacer(self.registered, self.replicator.boards)
        self.replicator.start()
        self._notices = await self._listen_for_commits()

    async def close(self) -> None:
        await self.uploads.close()
        if self._notices is not None:
            self._notices.close()
            # Removed (outside the machine directory when its path is too long), unless another agent of
            # the same machine directory has bound the path since: its socket stays.
            with contextlib.suppress(FileNotFoundError):
                if _identity(os.stat(self.notify_socket)) == self._notices_bound:
                    os.unlink(self.notify_socket)
        if self.replicator is not None:
            # Not through an executor: at interpreter exit (the embedded mode's atexit) none is left.
            self.replicator.stop()
        if self.server is not None:
            self.server.stop()
        await self.client.close()

    # -- registration and placement ----------------------------------------------------------------------

    async def register(self) -> RegisterResponse:
        assert self.server is not None
        fields: dict[str, Any] = {
            "instance_id": self.identity.instance_id,
            "address": self.identity.address,
            "data_port": self.server.port,
            "hostname": socket.gethostname(),
            "rank": self.identity.machine_rank,
            "rendezvous_port": free_port(),
            "embedded": self.identity.embedded,
        }
        try:
            registration = await self.client.register(**fields, agent_session=self.session)
        except RootRejected as exc:
            # A root from before agent sessions refuses the field it does not know (422): register as
            # before, without it (a retried registration then counts as a restart there, as it did).
            if exc.status != 422 or "agent_session" not in exc.message:
                raise
            registration = await self.client.register(**fields)
        self.registration = registration
        self.update_addresses(registration.peers)
        self.capacity = self._rank_capacity()
        log.info(
            "registered as machine %d of job %s (checkpoints of up to %d bytes per rank)",
            self.machine_rank,
            self.job_id,
            self.capacity,
        )
        return registration

    def _rank_capacity(self) -> int:
        """What a peer may store here per rank: the job's figure (or $CASTOR_REPLICA_BYTES_MAX), checked
        against /dev/shm for this machine's own ranks and the replicas the placement puts here; without
        one, an equal share of the free shared memory (see holdings.rank_capacity)."""
        configured = self.registered.checkpoint_bytes_max
        if configured is None and os.environ.get(REPLICA_BYTES_MAX_ENV, "").strip():
            try:
                configured = int(os.environ[REPLICA_BYTES_MAX_ENV])
            except ValueError:
                value = os.environ[REPLICA_BYTES_MAX_ENV]
                raise ValueError(f"{REPLICA_BYTES_MAX_ENV}={value!r}: expected a number of bytes") from None
        held = sum(
            self.procs
            for machine in range(self.registered.machines)
            if machine != self.machine_rank and self.machine_rank in self._placement_of(machine).holders
        )
        extra = (self.local_slots - SLOTS) * len(self.local_ranks())
        return rank_capacity(self.holdings.root, len(self.local_ranks()) + held, configured, extra)

    @property
    def local_slots(self) -> int:
        return SLOTS if self.identity.embedded else local_slots()

    async def report_progress(
        self, generation: int, event: str, details: dict[str, Any] | None = None
    ) -> None:
        """This machine's progress through plan `generation` (`restored`, `resumed`, `finished`, ...)."""
        if event == "finished":
            # The final figures first (newest iteration, counters, stalls): training just ended, possibly
            # less than a heartbeat interval after its last commit, and a finished job gets no more beats.
            await self.client.heartbeat(self.machine_rank, self.identity.instance_id, self.summary())
        body = {
            "instance_id": self.identity.instance_id,
            "generation": generation,
            "event": event,
            "details": details or {},
        }
        await self.client.report_progress(self.machine_rank, body)

    @property
    def machine_rank(self) -> int:
        return self.registered.rank

    @property
    def procs(self) -> int:
        return self.registered.procs_per_machine

    def local_ranks(self) -> list[int]:
        return [self.machine_rank * self.procs + local for local in range(self.procs)]

    @property
    def registered(self) -> RegisterResponse:
        """The root's registration answer (an error before start() registered)."""
        if self.registration is None:
            raise RuntimeError("this machine has not registered with the root yet")
        return self.registration

    def _placement_of(self, machine: int) -> RankPlacement:
        return self.registered.placement.ranks[machine]

    def sends_to(self) -> list[int]:
        return list(self._placement_of(self.machine_rank).sends_to)

    def holds_replicas_of(self, global_rank: int) -> bool:
        """Whether the placement puts replicas of `global_rank` on this machine."""
        if self.registration is None:
            return False
        machine = global_rank // self.procs
        return (
            0 <= machine < self.registration.machines
            and machine != self.machine_rank
            and self.machine_rank in self._placement_of(machine).holders
        )

    def update_addresses(self, machines: list[Peer]) -> None:
        for machine in machines:
            if machine.address and machine.data_port:
                self.addresses[machine.rank] = (machine.address, machine.data_port)

    # -- commits from the training processes -------------------------------------------------------------

    async def _listen_for_commits(self) -> asyncio.DatagramTransport:
        prepare_notify_socket(self.notify_socket)
        path = str(self.notify_socket)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        services = self

        class Notices(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                services.on_notice(data)

        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            Notices, local_addr=path, family=socket.AF_UNIX
        )
        self._notices_bound = _identity(os.stat(path))
        return transport

    def on_notice(self, data: bytes) -> None:
        try:
            notice = json.loads(data)
            rank, iteration = int(notice["rank"]), int(notice["iteration"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed notice from a training process")
            return
        self._note_stall(rank, notice)
        if notice.get("event") == "skip":
            self.skipped += 1
            return
        if notice.get("event") == "finished":
            self.finished_ranks.add(rank)  # the embedded mode's sign that training ended cleanly
            return
        if notice.get("event") == "restored":
            newest = notice.get("newest")
            if FRESH_START <= iteration <= INT32_MAX:  # what the root accepts (CheckpointSummary)
                self.restored[rank] = iteration
                if type(newest) is int and FRESH_START <= newest <= INT32_MAX:
                    self.newest_at_restore[rank] = newest
                else:
                    self.newest_at_restore.pop(rank, None)
            return
        self.committed += 1
        now = time.monotonic()
        recent = self.commits.setdefault(rank, deque())
        pid = notice.get("pid")
        if isinstance(pid, int) and self._commit_pids.get(rank, pid) != pid:
            recent.clear()  # a new training process: the time since the last one's commit was a restart
        if isinstance(pid, int):
            self._commit_pids[rank] = pid
        recent.append(now)
        while len(recent) > 2 and recent[0] < now - 60:
            recent.popleft()
        if self.replicator is not None:
            self.replicator.notice_commit(rank, iteration)
        self.uploads.notice_commit(rank, iteration)
        if self.on_commit is not None:
            self.on_commit(rank, iteration)

    def _note_stall(self, rank: int, notice: dict[str, Any]) -> None:
        """Every notice carries its process's stall so far; a new pid is a restarted training process,
        whose count starts again from 0."""
        try:
            pid, seconds, calls = int(notice["pid"]), float(notice["stalled_s"]), int(notice["save_calls"])
        except (KeyError, TypeError, ValueError):
            return  # a worker library from before the figure
        if not math.isfinite(seconds) or seconds < 0 or calls < 0:
            return
        current = self._stall_current.get(rank)
        if current is not None and current[0] != pid:
            ended = self._stall_ended.get(rank, (0.0, 0))
            self._stall_ended[rank] = (ended[0] + current[1], ended[1] + current[2])
        elif current is not None:
            # Notices leave from two threads (training, background copy): the figures only grow.
            seconds, calls = max(seconds, current[1]), max(calls, current[2])
        self._stall_current[rank] = (pid, seconds, calls)

    def stalls(self) -> dict[int, tuple[float, int]]:
        """rank -> (seconds its training thread was blocked in Castor, save() calls), since the agent
        started, over all its training processes."""
        totals = dict(self._stall_ended)
        for rank, (_, seconds, calls) in self._stall_current.items():
            ended = totals.get(rank, (0.0, 0))
            totals[rank] = (ended[0] + seconds, ended[1] + calls)
        return totals

    def summary(self) -> dict[str, Any]:
        """What heartbeats carry: newest iteration per rank held here, saves taken and skipped, rate."""
        held = self.holdings.summary()
        stalls = self.stalls()
        # Commits per minute over the last minute's commits, or the newest two when iterations take longer
        # (not their count: a machine that started a few seconds ago is not checkpointing slowly), at most
        # what the root accepts.
        rates = [
            min(60 * (len(times) - 1) / (times[-1] - times[0]), MAX_CHECKPOINTS_PER_MINUTE)
            for times in self.commits.values()
            if len(times) >= 2 and times[-1] > times[0]
        ]
        return {
            "local": held["local"],
            "replicas": held["replicas"],
            "committed": self.committed,
            "restored": {str(rank): iteration for rank, iteration in sorted(self.restored.items())},
            "newest_at_restore": {str(rank): it for rank, it in sorted(self.newest_at_restore.items())},
            "session": self.session,
            # Two different things, counted apart: saves the training skipped (their slot was still being
            # read when training needed the state back) and commits no replication round sent (the rounds
            # skip the iterations committed while one is under way).
            "skipped": self.skipped,
            "replicas_skipped": self.replicator.stats.skipped if self.replicator else 0,
            "per_minute": min(rates) if rates else None,
            "replicated": self.replicator.stats.sent if self.replicator else 0,
            "replication_lag_s": self.replicator.stats.last_lag_s if self.replicator else None,
            # The achieved replication interval, the newest fully replicated iteration and how far it lags
            # behind the newest commit, in iterations (see replication.Replicator.summary).
            **(self.replicator.summary() if self.replicator else {}),
            "uploaded": self.uploads.uploaded,
            "persist_missed": self.uploads.missed_report(),
            # Per rank, cumulative: the root charges the job the slowest rank's figure (README: "Planning a
            # cluster"), since ranks that meet in collectives all wait for the one that stalls.
            "stalled_s": {str(rank): round(seconds, 6) for rank, (seconds, _) in sorted(stalls.items())},
            "save_calls": {str(rank): calls for rank, (_, calls) in sorted(stalls.items())},
            **({"store_filesystem": self.store_filesystem} if self.store_filesystem else {}),
            **self.extra_summary(),
        }

    async def heartbeats(self) -> None:
        """Heartbeat forever (raises heartbeat.Replaced when the root gave this rank to another machine),
        and keep the peers' addresses current: a peer registers late, or is replaced."""
        config = self.registered.heartbeat
        peers = asyncio.create_task(self._refresh_peers())
        following: asyncio.Task[None] | None = None
        try:
            if config.mode == "etcd":
                if config.etcd_key is None:
                    raise ValueError("the root's etcd heartbeat configuration names no key")
                await etcd_heartbeats(
                    config.etcd_endpoints,
                    config.etcd_key,
                    config.timeout_s,
                    config.interval_s,
                    self.summary,
                    summary_period_s=config.summary_period_s,
                )
            else:
                wake = asyncio.Event()
                if self.replicator is not None:
                    self.replicator.aligns = aligned_rounds()
                if self.replicator is not None and self.replicator.aligns:
                    following = asyncio.create_task(self._follow_alignment(self.replicator, wake))
                await rest_heartbeats(
                    self.client,
                    self.machine_rank,
                    self.identity.instance_id,
                    config.interval_s,
                    self.summary,
                    self._heartbeat_answered,
                    wake,
                )
        finally:
            peers.cancel()
            if following is not None:
                following.cancel()

    async def _follow_alignment(self, replicator: Replicator, wake: asyncio.Event) -> None:
        """Aligned rounds: heartbeat at once when this machine's part of the alignment changed (a round
        done, a proposal, a pin), and long-poll the job's alignment, so that each step of a round is heard
        the moment a machine makes it rather than a heartbeat period later (services.root.flows.alignment)."""
        loop = asyncio.get_running_loop()

        def setter(event: asyncio.Event) -> Callable[[], None]:
            def set_event() -> None:  # on the replicator's coordinator thread
                with contextlib.suppress(RuntimeError):  # the loop closed: the agent is exiting
                    loop.call_soon_threadsafe(event.set)

            return set_event

        asked_again = asyncio.Event()
        replicator.on_alignment_change = setter(wake)
        replicator.on_rehear = setter(asked_again)
        heard: ReplicationAlignment | None = None
        try:
            while True:
                try:
                    said = await self._poll_alignment(heard, asked_again)
                except RootRejected as exc:  # a root without the route: the heartbeats' answers carry it
                    log.info("replication alignment not polled (%s): heard with each heartbeat", exc)
                    return
                except (RootUnavailable, UnexpectedAnswer) as exc:
                    log.info("replication alignment poll failed: %s", exc)
                    replicator.answers_pushed = False
                    await asyncio.sleep(ALIGNMENT_RETRY_S)
                    continue
                replicator.answers_pushed = True
                follow(replicator, said)
                heard = said
        finally:
            replicator.answers_pushed = False

    async def _poll_alignment(
        self, heard: ReplicationAlignment | None, asked_again: asyncio.Event
    ) -> ReplicationAlignment | None:
        """The alignment once it differs from `heard` (long poll), or as it is now when the replicator asks
        to hear it again first (Replicator.on_rehear): the long poll is cancelled, so no older answer can
        come after the newer one."""
        poll = asyncio.ensure_future(self.client.replication_alignment(heard, wait_s=ALIGNMENT_WAIT_S))
        asked = asyncio.ensure_future(asked_again.wait())
        try:
            done, _ = await asyncio.wait({poll, asked}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            poll.cancel()
            asked.cancel()
            raise
        asked.cancel()
        if poll in done:
            return poll.result()
        asked_again.clear()
        poll.cancel()
        await asyncio.wait({poll})  # its cancellation (or a late answer or error, dropped) lands first
        if not poll.cancelled():
            poll.exception()  # retrieved: a late failure of the dropped poll is no error of this one
        return await self.client.replication_alignment(None, wait_s=0)

    def _heartbeat_answered(self, response: HeartbeatResponse) -> None:
        """The root's alignment of replication rounds across machines (REST heartbeats only)."""
        self.uploads.announce(response.persist)
        alignment = response.replication
        # While the alignment is polled, its answers alone count: a heartbeat's was computed before its
        # commit and may arrive after a newer one the poll brought.
        replicator = self.replicator
        if replicator is not None and replicator.aligns and not replicator.answers_pushed:
            follow(replicator, alignment)

    def directive_answered(self, directive: DirectiveOut, long_poll: bool = True) -> None:
        """Any answer of the root's directive, changed or not: the peers' addresses (a peer may have
        registered anew without a new revision) and the persist schedule."""
        if long_poll:
            self.long_poll_answered_at = asyncio.get_running_loop().time()
        self.update_addresses(directive.machines)
        self.uploads.announce(directive.persist)

    def _address_missing(self) -> bool:
        return any(machine not in self.addresses for machine in self.sends_to())

    def _peers_stale(self, now: float) -> bool:
        if self._address_missing():
            return True
        heard = self.long_poll_answered_at
        return heard is None or now - heard >= self.registered.directive_wait_s + PEERS_REFRESH_S

    async def _refresh_peers(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PEERS_REFRESH_MISSING_S if self._address_missing() else PEERS_REFRESH_S)
            if not self._peers_stale(loop.time()):
                continue  # the long poll's answers keep them current: no request of its own
            try:
                # This machine's share: itself and every peer it sends replicas to.
                directive = await self.client.directive(after=-1, wait_s=0, machine=self.machine_rank)
                self.directive_answered(directive, long_poll=False)
            except (RootUnavailable, RootRejected, UnexpectedAnswer) as exc:
                log.info("could not refresh the peers' addresses: %s", exc)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class Uploads:
    """Each local rank's committed checkpoint of the iteration the root announced goes to the persistent
    tier (an older root announces none: then every persist_every iterations, as each commit lands on one).

    The agent, not the training process, does it: it copies the slot into its own staging buffer (so the
    training process can overwrite the slot at its next-but-one save) and keeps that copy, pinned, until
    the shard is uploaded and reported to the root (a failed upload or report is retried while the
    announcement stands). One upload per rank at a time. A rank past the announced iteration when it hears
    of it uploads it from its slot if the slot still holds it, else the machine reports it missed
    (`persist_missed`) and the root announces another."""

    RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)

    def __init__(self, services: MachineServices):
        self.services = services
        self.uploaded = 0
        self.skipped = 0
        self.failed = 0
        self._running: dict[int, asyncio.Task[None]] = {}
        # rank -> a staging buffer no upload uses now, kept for the next one. Only the event loop touches
        # it: an upload takes its rank's buffer before its thread starts and returns it only once its put
        # ended, since a cancelled upload's thread (or put) may still be using it.
        self._staging: dict[int, bytearray] = {}
        self._store: ObjectStore | None = None
        # The root's schedule: None until one is seen (an older root: every K on each rank's own commits).
        self.scheduled = False
        self.target: tuple[int, int] | None = None  # (iteration, generation) announced
        self._handled: dict[int, tuple[int, int]] = {}  # rank -> the target its upload is for (or done)
        self.missed: tuple[int, int] | None = None
        # rank -> (iteration, generation) of the upload under way: from its start (on the schedule) or its
        # staging until the root acknowledged it. A recovery's plan may wait for it rather than roll back
        # further (the inventory reports these).
        self._in_flight: dict[int, tuple[int, int]] = {}

    def in_flight(self) -> list[dict[str, int]]:
        return [
            {"rank": rank, "iteration": iteration, "generation": generation}
            for rank, (iteration, generation) in sorted(self._in_flight.items())
        ]

    def missed_report(self) -> dict[str, int] | None:
        if self.missed is None or self.missed != self.target:
            return None
        return {"iteration": self.missed[0], "generation": self.missed[1]}

    def announce(self, schedule: Any) -> None:
        """The root's persist schedule (schemas.PersistSchedule, or its JSON); None: the root sends none."""
        if schedule is None:
            return
        iteration, generation = schedule.iteration, schedule.generation
        self.scheduled = True
        target = None
        if iteration is not None and generation is not None:
            target = (int(iteration), int(generation))
        if target == self.target:
            return
        self.target = target
        if target is None or self.services.registration is None:
            return
        log.info("persisting iteration %d (generation %d) when every local rank commits it", *target)
        for rank in self.services.local_ranks():
            newest = self.services.holdings.newest("local", rank)
            # A commit of an older generation is of a history the target is not from: the root announces a
            # recovery's first target with its plan, while the slots still hold the rolled-back history's
            # commits (past the target, maybe). The rank's commit of it is still to come (notice_commit).
            if (
                newest is not None
                and newest.iteration >= target[0]
                and manifest_generation(newest) >= target[1]
            ):
                self._start(rank, target, passed=newest.iteration > target[0])

    def notice_commit(self, rank: int, iteration: int) -> None:
        if self.scheduled:
            if self.target is not None and iteration >= self.target[0]:
                self._start(rank, self.target, passed=iteration > self.target[0])
            return
        registration = self.services.registration
        every = registration.persist_every if registration is not None else 0
        if every <= 0 or iteration % every != 0:
            return
        if rank in self._running and not self._running[rank].done():
            self.skipped += 1
            return
        self._running[rank] = asyncio.get_running_loop().create_task(self._upload(rank, iteration))

    def _start(self, rank: int, target: tuple[int, int], passed: bool) -> None:
        """Upload `rank`'s commit of the announced `target` (`passed`: the rank committed past it already)."""
        if self._handled.get(rank) == target:
            return
        running = self._running.get(rank)
        if running is not None and not running.done():
            running.cancel()  # an upload of a target given up since: the new one is what the root waits for
        self._handled[rank] = target
        self._running[rank] = asyncio.get_running_loop().create_task(
            self._upload(rank, target[0], generation=target[1], passed=passed)
        )

    async def _upload(
        self, rank: int, iteration: int, generation: int | None = None, passed: bool = False
    ) -> None:
        target = None if generation is None else (iteration, generation)
        # Named in flight from the start where the generation is known (scheduled): staging is a copy and a
        # checksum pass, and an inventory sent meanwhile should name it too.
        named = target
        if named is not None:
            self._in_flight[rank] = named
        try:
            staged = await self._staged(rank, iteration, generation, passed)
            if staged is None:
                return
            manifest, data, staging = staged
            named = self._in_flight[rank] = (iteration, manifest_generation(manifest))
            await self._send(rank, iteration, target, manifest, data)
            self._staging.setdefault(rank, staging)  # the put ended: the next upload may reuse it
        finally:
            if named is not None and self._in_flight.get(rank) == named:
                del self._in_flight[rank]

    async def _staged(
        self, rank: int, iteration: int, generation: int | None, passed: bool
    ) -> tuple[Manifest, memoryview, bytearray] | None:
        """The rank's commit of `iteration` copied out of its slot and checked, with the buffer it is in;
        None: nothing to upload."""
        target = None if generation is None else (iteration, generation)
        staging = self._staging.pop(rank, None)  # this upload's alone until it returns it
        try:
            try:
                return await asyncio.to_thread(self._stage, rank, iteration, generation, staging)
            except Exception:
                if staging is not None:  # its thread ended (not so on cancellation): the buffer is free
                    self._staging.setdefault(rank, staging)
                raise
        except CheckpointCorruptError as exc:
            self.failed += 1
            log.error(
                "rank %d iteration %d is not uploaded: its copy here is corrupt (%s)", rank, iteration, exc
            )
            if target is not None and self.target == target:
                self.missed = target  # the root announces another iteration
            return None
        except CheckpointNotFoundError:
            # Overwritten before we got to it (the training is faster than the upload), or a commit of
            # another history: on the schedule, a rank that committed past the target missed it.
            self.skipped += 1
            if target is not None:
                if passed and self.target == target:
                    self.missed = target
                    log.warning("rank %d cannot persist iteration %d: it no longer holds it", rank, iteration)
                else:
                    self._handled.pop(rank, None)  # this history's commit of it is still to come
            return None
        except Exception as exc:
            # Anything else (the staging buffer not allocated, the slot unreadable): this rank's shard of the
            # target will not be uploaded. Left unsaid, the root would wait for it until the next recovery,
            # persisting nothing meanwhile; reported missed, it announces another iteration (a new try).
            self.failed += 1
            log.error("rank %d iteration %d is not uploaded: staging it failed: %r", rank, iteration, exc)
            if target is not None and self.target == target:
                self.missed = target
            return None

    async def _send(
        self, rank: int, iteration: int, target: tuple[int, int] | None, manifest: Manifest, data: memoryview
    ) -> None:
        attempt = 0
        while True:
            try:
                await self._put(rank, iteration, manifest, data)
                self.uploaded += 1
                log.info("persisted rank %d iteration %d (%d bytes)", rank, iteration, manifest.data_bytes)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # best effort: training goes on
                self.failed += 1
                if refused_for_good(exc):
                    # The root refused the report itself (an iteration it no longer announces, a rank this
                    # machine does not run): the same report gets the same answer, and uploading the shard
                    # again on every backoff only costs the NIC. Still the target, it is reported missed, so
                    # the root announces another rather than wait for this rank's shard for good.
                    log.error(
                        "the root refused rank %d iteration %d's persisted shard: %s", rank, iteration, exc
                    )
                    if target is not None and self.target == target:
                        self.missed = target
                    return
                log.warning("uploading rank %d iteration %d failed: %s", rank, iteration, exc)
                if target is None or self.target != target:
                    return  # unscheduled: the next multiple of K retries
            # Scheduled: the staged copy stays pinned and is sent again while the announcement stands.
            await asyncio.sleep(self.RETRY_S[min(attempt, len(self.RETRY_S) - 1)])
            attempt += 1
            if self.target != target:
                return

    async def _put(self, rank: int, iteration: int, manifest: Manifest, data: memoryview) -> None:
        services = self.services
        if self._store is None:
            self._store = object_store(services.registered.persistent.model_dump())
        # The root computes the same key (and refuses a report naming another): the job id as the root
        # wrote it in the registration, not as this agent was given it.
        registration = services.registered
        key = shard_key(
            registration.persistent.prefix,
            str(registration.job_id),
            iteration,
            rank,
            manifest_generation(manifest),
        )
        shard = await self._store.put(key, manifest, data)
        await services.client.report_persisted(
            services.machine_rank,
            {
                "instance_id": services.identity.instance_id,
                "rank": rank,
                "iteration": iteration,
                "generation": manifest_generation(manifest),
                "key": shard.key,
                "digest": shard.digest,
                "nbytes": shard.nbytes,
            },
        )

    def _stage(
        self, rank: int, iteration: int, generation: int | None, staging: bytearray | None
    ) -> tuple[Manifest, memoryview, bytearray]:
        """On a thread: copy the commit into `staging` (or a new buffer where it is missing or too small)."""
        with self.services.holdings.open_read(rank, iteration, tier="local") as (manifest, data):
            if generation is not None and manifest_generation(manifest) != generation:
                raise CheckpointNotFoundError(
                    f"rank {rank} iteration {iteration} is of generation {manifest_generation(manifest)}, "
                    f"not {generation}"
                )
            if staging is None or len(staging) < manifest.data_bytes:
                staging = bytearray(manifest.data_bytes)
            view = memoryview(staging)[: manifest.data_bytes]
            view[:] = data  # one memcpy, then the slot is the training process's again
        # What is uploaded is checked against the manifest's checksums (about 17 ms a GiB from cache): the
        # root counts an uploaded shard toward a complete checkpoint, and retention may then delete older
        # good ones, so a copy corrupt in memory must not get there.
        verify(manifest, view, self.services.holdings.copy_engine())
        return manifest, view, staging

    async def close(self) -> None:
        for task in self._running.values():
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
