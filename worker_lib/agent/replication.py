"""Replication of committed checkpoints to placement-group peers in rounds that always complete, never
blocking training.

A round replicates one iteration, the newest that every local rank has committed (the ranks align, so one
iteration exists for all of them), of every local rank to every peer the placement names. It starts by
pinning that iteration in each rank's store (a shared lock on its slot, so no writer takes it) and ends when
every peer verified and committed every rank's checkpoint. Only then does the round's iteration become the
newest fully replicated one, which stays pinned (locally here; on the holders it is the replica the round's
writes never touch, since a replica store writes into its slot not holding the newest) until the next round
completes; the next round then starts at once with the newest common iteration. When a transfer takes
longer than an iteration, the iterations in between are skipped and the achieved replication interval
(iterations between fully replicated checkpoints) grows, but it never becomes infinite: a newer commit is no
reason to give a transfer up. A round is given up only when the training process needs one of its slots
back (its store's writer found every slot it may take held: SlotStore.writer_waiting), when a peer refuses
the checkpoint itself, or when the pinned checkpoint disappears (a rollback); the next round starts with a
newer iteration.

Each peer gets `streams` sender threads (each its own connection) taking the round's ranks from one queue
whose order rotates every round, so no local rank is always served last. While a recovery collects the
machines' inventories, `pause()` stops new rounds and keeps the pins, so the copies the planner picks from
the inventory are still there when the plan is carried out.

Across machines (`align()`, from the root's answers; CASTOR_REPLICATION_ALIGN=0 turns it off): left alone,
each machine's rounds pick their own iterations, and after a machine loss the survivors may no longer hold
locally the iteration the lost machine's replicas are of. Aligned rounds therefore replicate only iterations
every machine agreed on, in two phases through the root (services/root/domain/replication.py): each machine
proposes a future iteration (its newest commit plus a lead), adopts the largest one proposed, pins it the
moment all its ranks committed it, and starts the round only when the root says every machine is ready on it.
The lead follows what the machine observes: the iterations committed during AGREE_PERIODS of the root's
answers (a proposal reaches the root with this machine's next heartbeat and each other machine with its
next one), doubled after a miss (an agreed iteration overwritten before it could be pinned); so iterations
far shorter than a heartbeat period still get agreed iterations pinned in time. When training stops
committing (every rank waiting: a pause, a stalled collective), a future iteration would never come: each
machine then proposes the newest iteration all its ranks hold, pinned at once, and adopts no target it has
not reached; once every machine says it stopped, the root names the smallest proposal (machines may have
stopped an iteration apart), which each adopts from its slots: the machines agree on an iteration they all
hold.
The job's aligned iteration (the newest one every machine fully replicated and still keeps) stays pinned here
and is the replica slot the holders' writes never take (SlotStore.keep, set from the root's answers): a
machine whose newest fully replicated iteration is newer than it starts no round until the others catch up,
or, when another machine gave that one up and the job follows a later one, gives it up (_give_up_ahead).
Pins at any moment: the aligned iteration and one more (this machine's newest fully replicated, the agreed
one pinned ahead, or the round in flight), as without alignment: the four local slots per rank
(CASTOR_LOCAL_SLOTS) and two replica slots per rank suffice. Without alignment
from the root (etcd heartbeats, jobs past the inline-counter size, a job with one machine that runs free
rounds: told not to align, or with stores too small to pin, it says `replication_free` and the root aligns
none of the job), while flushing at the end of training, and until the job's first aligned iteration (between
agreements; a free round is given up when an agreed iteration is pinned), rounds run free as described above.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from worker_lib.agent.dataplane import DataPlaneError, PeerConnection
from worker_lib.agent.holdings import Holdings, Version, abandoned, manifest_generation, version
from worker_lib.agent.pacing import Pacer, unsent_bytes
from worker_lib.agent.priority import REPLICATION_NICE, lower_thread_priority
from worker_lib.comm_timing import BOARD_FILE
from worker_lib.errors import CheckpointError, CheckpointNotFoundError
from worker_lib.store.manifest import Manifest
from worker_lib.store.slots import SlotPin

log = logging.getLogger(__name__)

PeerAddress = tuple[str, int]
REFUSALS = ("too_large", "manifest_unauthenticated")  # codes of a receiver that will refuse again
STREAMS_ENV = "CASTOR_REPLICATION_STREAMS"
# On unless set to 0 (false, no, off): only aligned rounds guarantee a machine loss an iteration every rank
# holds in memory; free rounds keep a newer replica per machine but may leave none in common (README).
ALIGN_ENV = "CASTOR_REPLICATION_ALIGN"
STREAMS = 2  # per peer: one TCP stream often cannot fill a fast link with a long round trip
# A store of fewer slots cannot keep a pin and still let its training process rotate: nothing is pinned.
PIN_MIN_SLOTS = 3
# Aligned rounds: a proposal leads the newest commit by the iterations committed while it travels to every
# machine and back (AGREE_PERIODS of the root's answers, at the observed commit rate), at least LEAD; the
# lead is doubled each time the agreed iteration was overwritten before every local rank's copy could be
# pinned (the root's answer came too late anyway) and eases off by a quarter with each one pinned in time.
# A lead of 1 is the iteration training is computing now. An agreed iteration that a machine committed
# shortly before the proposal reached it is still pinned from its slot: with four slots and the aligned
# iteration pinned, an iteration stays in its slot until the save three iterations later takes it, about
# two iterations after its commit, more than the one iteration a lead rounded up to the travel time can
# fall short by. When the travel takes at most NOW_TRAVEL of an iteration (the root's answers come many
# times an iteration), the lead is 0: the newest iteration every local rank committed, pinned at once here
# and, within that half iteration, from their slots on the others (with DDP's lockstep at most one
# iteration ahead: a margin of half an iteration or more). Stores of fewer than LEAD_NOW_SLOTS slots keep
# a lead of at least 1.
LEAD = 1  # until the paces are known
NOW_TRAVEL = 0.5
LEAD_NOW_SLOTS = 4
LEAD_MAX = 1 << 12
# A proposal goes up with this machine's next heartbeat and reaches each other machine with its next one: two
# heartbeat periods at worst, and half a period more for jitter.
AGREE_PERIODS = 2.5
# With the alignment pushed (the agent heartbeats when its part changes and long-polls the root's answers), a
# proposal reaches every machine about when it comes back to this one named in an answer (the root answers
# every poll at once): the longest of the last few such trips, PUSHED_TRAVEL_S until one is measured. No
# margin on top: a machine that committed the agreed iteration just before it heard of it still pins it
# from its slot (see LEAD), and a miss doubles the lead. Measured (benchmarks/alignment.py, 4 machines,
# trips of 30-180 ms, 0.13-0.2 s iterations): twice the trip gave intervals of 9.5-10, once 7.5-8, no miss.
PUSHED_TRAVEL_S = 0.1
PACE_WINDOW = 32  # commits (of one local rank) and answers from the root the paces are measured over
# Training has stopped (every rank waits: a pause, a stalled collective, the end) when no local rank committed
# for this long: at least STALL_MIN_S, two heartbeat periods and STALL_ITERATIONS of the observed iterations.
# A proposal in the future would then never be committed: the machines agree on the newest they all hold.
STALL_MIN_S = 1.0
STALL_ITERATIONS = 4


ALIGN_VALUES = {"": True, "1": True, "true": True, "yes": True, "on": True}
ALIGN_VALUES |= {"0": False, "false": False, "no": False, "off": False}


def aligned_rounds() -> bool:
    """Whether the agent follows the root's alignment of rounds across machines: unless
    $CASTOR_REPLICATION_ALIGN turns it off (ValueError naming the variable for any other value)."""
    value = os.environ.get(ALIGN_ENV, "")
    aligned = ALIGN_VALUES.get(value.strip().lower())
    if aligned is None:
        raise ValueError(f"{ALIGN_ENV}={value!r}: give 1 (aligned rounds, the default) or 0 (free rounds)")
    return aligned


def default_streams() -> int:
    value = os.environ.get(STREAMS_ENV, "").strip()
    return max(1, int(value)) if value.isdigit() else STREAMS


@dataclass
class ReplicationStats:
    sent: int = 0  # rank checkpoints a peer verified and committed
    skipped: int = 0  # commits no completed round replicated (the rounds skip the ones in between)
    failed: int = 0
    aborted: int = 0  # rounds given up: the training process needed a slot back, or a peer refused
    missed: int = 0  # agreed iterations overwritten here before every local rank's copy could be pinned
    rounds: int = 0  # rounds completed: an iteration every local rank has on every peer
    bytes_sent: int = 0
    last_lag_s: float | None = None  # from the commit to the last peer's verified replica, last round
    # From the last completed round's start (its pins taken) to the last peer's verified replica: the
    # transfer itself; the rest of an interval is the wait for the next round (alignment, the lead).
    last_round_s: float | None = None
    replicated: dict[int, int] = field(default_factory=dict)  # rank -> newest iteration every peer holds
    replicated_iteration: int | None = None  # the newest fully replicated iteration (pinned)
    interval: int | None = None  # iterations between the last two fully replicated ones (same history)
    replicated_at: float | None = None  # time.time() the last round completed


@dataclass
class _Round:
    number: int
    version: Version
    pins: dict[int, SlotPin]  # rank -> its pinned slot of the round's iteration
    todo: dict[int, deque[int]]  # peer machine -> ranks not yet taken by a sender
    left: set[tuple[int, int]]  # (machine, rank) not yet verified and committed by the peer
    committed_at: float
    aborted: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    restored: bool = False  # the iteration a recovery restored here, replicated first (Replicator._catch_up)

    @property
    def iteration(self) -> int:
        return self.version[1]


class _Sender:
    """One stream to one peer machine: takes the current round's ranks for that peer and sends them."""

    def __init__(self, replicator: Replicator, machine: int, stream: int):
        self.replicator = replicator
        self.machine = machine
        self.connection: PeerConnection | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"castor-replicate-to-{machine}-{stream}", daemon=True
        )

    def _run(self) -> None:
        replicator, backoff = self.replicator, 0.2
        lower_thread_priority(replicator.nice)  # training comes first for the cores (priority.py)
        while (item := replicator._take(self.machine)) is not None:
            current, rank = item
            address = replicator.peer_address(self.machine)
            if address is None:  # the peer has not registered yet
                replicator._give_back(current, self.machine, rank, 0.5)
                continue
            try:
                done = self._send(current, rank, address)
                backoff = 0.2
            except Exception as exc:  # the thread must outlive any one transfer, a bug's too
                replicator.stats.failed += 1
                expected = isinstance(exc, OSError | DataPlaneError | CheckpointError)
                # A peer that refuses the checkpoint itself (larger than it keeps for the rank, or a MAC that
                # fails: another job's key) will refuse it again: an operator has to act, not the network.
                # The round is given up so a newer (maybe smaller) checkpoint gets its chance.
                refused = isinstance(exc, DataPlaneError) and exc.code in REFUSALS
                log.log(
                    logging.ERROR if refused else logging.WARNING,
                    "replicating rank %d iteration %d to machine %d failed: %s",
                    rank,
                    current.iteration,
                    self.machine,
                    exc,
                    exc_info=None if expected else exc,
                )
                self._disconnect()
                if refused or isinstance(exc, CheckpointNotFoundError):
                    replicator._abort(current, f"rank {rank}: {exc}")
                else:
                    replicator._give_back(current, self.machine, rank, backoff)
                    backoff = min(backoff * 2, 5.0)
                continue
            if done:
                replicator._done(current, self.machine, rank)
        self._disconnect()

    def _send(self, current: _Round, rank: int, address: PeerAddress) -> bool:
        """Stream `rank`'s checkpoint of the round to the peer; False when the round was given up."""
        replicator = self.replicator
        store = replicator.holdings.local_store(rank)
        with store.open_read(current.iteration) as (manifest, data):
            if version(manifest) != current.version:
                raise CheckpointNotFoundError(f"iteration {current.iteration} of rank {rank} was replaced")
            if self.connection is None:
                self.connection = PeerConnection(*address, replicator.key, replicator.job_id)
            connection, pacer = self.connection, replicator.pacer
            try:
                # The job's policy decides when each piece goes on the wire (worker_lib/agent/pacing.py).
                outcome = connection.send_put(
                    rank,
                    manifest,
                    data,
                    superseded=lambda: replicator._must_let_go(current, rank),
                    pace=lambda wanted: pacer.grant(wanted, lambda: unsent_bytes(connection.sock)),
                    rolled_back=replicator._rolled_back,
                )
            finally:
                pacer.finished()
        if outcome == "superseded":
            self._disconnect()  # the peer drops the partial replica and keeps its previous one
            return False
        if outcome == "sent":
            self.connection.finish_put()
            replicator.stats.bytes_sent += manifest.data_bytes
        replicator.stats.sent += 1
        return True

    def _disconnect(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


class Replicator:
    """Sends this machine's committed checkpoints to the peer machines the placement names, in rounds."""

    def __init__(
        self,
        holdings: Holdings,
        key: bytes,
        job_id: str,
        targets: list[int],
        peer_address: Callable[[int], PeerAddress | None],
        streams: int | None = None,
        pacer: Pacer | None = None,
        nice: int = REPLICATION_NICE,
    ):
        self.holdings = holdings
        self.nice = nice  # the senders run this many steps below the process (worker_lib.agent.priority)
        # Interleaved by default: training's communication comes first (the boards of the local ranks).
        self.pacer = pacer if pacer is not None else Pacer(boards=self.boards)
        self.key = key
        self.job_id = job_id
        self.peer_address = peer_address
        self.targets = list(targets)
        self.stats = ReplicationStats()
        self.stopping = threading.Event()
        self.condition = threading.Condition()
        self._paused = False
        self._ranks: set[int] = set()  # local ranks seen committing
        self._noticed = 0  # commit notices, for stats.skipped
        self._covered = 0  # of them, the ones completed rounds replicated
        self._round: _Round | None = None
        self._rounds = 0
        self._pinned: dict[int, SlotPin] = {}  # rank -> the newest fully replicated checkpoint
        self._pinned_version: Version | None = None  # its version, None once its pins were let go (_step)
        # The newest fully replicated checkpoint, pinned or not: free rounds take newer ones only, and the
        # achieved interval counts from it.
        self._replicated: Version | None = None
        self._given_up: Version | None = None  # the last round given up
        # (plan generation, iteration) of the last restore: checkpoints of earlier generations past that
        # iteration are of a history the recovery abandoned, left in the slots until overwritten.
        self._rolled_back: Version | None = None
        self._held: dict[tuple[int, int], Version] = {}  # (machine, rank) -> what the peer holds
        # Alignment across machines (see the module's docstring); None/empty until the root first says.
        # `aligns`: whether this machine takes part (the agent's setting, REST heartbeats); one that does not,
        # or whose stores are too small to pin, says so in its summary and the root aligns none of the job.
        self.aligns = True
        self._aligning = False
        self._flushing = 0
        self._job_aligned: int | None = None  # the job's aligned iteration, as the root last said
        self._floor: dict[int, SlotPin] = {}  # its pins while this machine's newest fully replicated is newer
        self._next: int | None = None  # the iteration this machine proposed or adopted for the next round
        self._next_pins: dict[int, SlotPin] = {}
        # "" adopted, "pinned" (every rank), "running", "done" (this machine replicated it)
        self._next_state = ""
        self._go = False
        self._lead = 0  # the backoff after misses; a proposal leads by at least the observed need
        # The paces a proposal's lead follows: (time.monotonic(), iteration) of one local rank's commits, the
        # time of the root's answers (heartbeat responses), and of this machine's last commit.
        self._commit_times: deque[tuple[float, int]] = deque(maxlen=PACE_WINDOW)
        self._answer_times: deque[float] = deque(maxlen=PACE_WINDOW // 4)
        self._last_commit_at: float | None = None
        self._newest_common: int | None = None  # the newest iteration every local rank committed, last step
        self._generation = 1  # of the newest local commits: proposals are of this history
        # Called (from the coordinator's thread) when this machine's part of the alignment changed: the
        # agent then heartbeats at once rather than a heartbeat period later.
        self.on_alignment_change: Callable[[], None] | None = None
        self.answers_pushed = False  # the agent long-polls the alignment (see _travel_s)
        self._proposed: tuple[int, float] | None = None  # (iteration, time.monotonic()) of the last proposal
        self._travels: deque[float] = deque(maxlen=PACE_WINDOW // 4)  # its trips to an answer naming it
        self._alignment_told: dict[str, Any] | None = None
        # A target the root named while training here looked stopped and had not reached it (see align()),
        # and how to hear the root's alignment again at once when training goes on: its poll answers only a
        # change, and none comes while the other machines wait for this one.
        self._declined: int | None = None
        self.on_rehear: Callable[[], None] | None = None
        self._coordinator = threading.Thread(target=self._coordinate, name="castor-replication", daemon=True)
        count = default_streams() if streams is None else max(1, streams)
        self._senders = [_Sender(self, machine, s) for machine in self.targets for s in range(count)]

    def boards(self) -> list[Path]:
        """The communication boards the local training processes publish (worker_lib.comm_timing)."""
        ranks = self._ranks | set(self.holdings.ranks("local"))
        return [self.holdings.directory("local", rank) / BOARD_FILE for rank in sorted(ranks)]

    def start(self) -> Replicator:
        self._coordinator.start()
        for sender in self._senders:
            sender.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        with self.condition:
            self.condition.notify_all()
        for thread in [self._coordinator, *(sender.thread for sender in self._senders)]:
            if thread.is_alive():
                thread.join(timeout=5)
        with self.condition:
            if self._round is not None:
                self._release(self._round.pins)
            self._release(self._pinned)
            self._release(self._floor)
            self._release(self._next_pins)
        self.pacer.close()

    # -- what the agent tells it -------------------------------------------------------------------------

    def notice_commit(self, rank: int, iteration: int) -> None:
        with self.condition:
            self._ranks.add(rank)
            self._noticed += 1
            now = time.monotonic()
            self._last_commit_at = now
            if rank == min(self._ranks):  # one rank's commits give the commit rate
                if self._commit_times and iteration <= self._commit_times[-1][1]:
                    self._commit_times.clear()  # a rollback: the pace starts again
                self._commit_times.append((now, iteration))
            if iteration == self._next and self._next_state == "" and rank not in self._next_pins:
                # The agreed iteration: pinned at once, before the training process rotates past it.
                self._pin_next(rank)
            self.condition.notify_all()

    def align(self, aligned: int | None, target: int | None, go: bool) -> None:
        """The root's view of the job (services.root.domain.replication.replication_alignment): the aligned
        iteration every machine fully replicated and keeps, the next iteration to replicate everywhere, and
        whether every machine has pinned it."""
        with self.condition:
            self._aligning = True
            self._job_aligned = aligned
            self._keep_replicas(aligned)
            now = time.monotonic()
            self._answer_times.append(now)
            if self._proposed is not None and target is not None and target >= self._proposed[0]:
                self._travels.append(now - self._proposed[1])  # this machine's proposal reached the root
                self._proposed = None
            self._floor_at(aligned)
            if self._next is not None and aligned is not None and aligned >= self._next:
                self._drop_next()  # every machine replicated it
            stalled = self._stalled()
            self._declined = None
            if target is not None and self._restored_round() is None and self._adoptable(target, stalled):
                if stalled and (self._newest_common is None or target > self._newest_common):
                    # Training stopped: an iteration it has not reached would never be committed here. This
                    # machine keeps proposing the newest it holds until the others propose the same. If
                    # training goes on instead (a restarted process's first commits: the last one before
                    # the restart made the machine look stopped), it asks the root again then (_align_step).
                    self._declined = target
                else:
                    if self._next_state == "done":
                        self._give_up_ahead()
                    self._drop_next()
                    self._next = target  # the root's choice of the proposals: adopted, pinned when committed
                    log.debug("adopted iteration %d (aligned %s)", target, aligned)
            if go and target is not None and target == self._next:
                if not self._go:
                    log.debug("go for iteration %d", target)
                self._go = True
            self.condition.notify_all()

    def _adoptable(self, target: int, stalled: bool) -> bool:
        """Whether the root's `target` replaces this machine's agreed iteration (whether training reached it
        is checked apart)."""
        if target == self._next:
            return False
        if self._next_state in ("", "pinned"):
            # Every machine stopped, some an iteration further than others (a rank hung while its peers had
            # committed one more): the root names the smallest proposal, held here too.
            aligned = self._job_aligned
            return (
                self._next is None
                or target > self._next
                or (stalled and (aligned is None or target > aligned))
            )
        # This machine replicated the agreed iteration, but another gave it up (its training process needed
        # the slot back first, as after a rollback, or rotated past it) and proposed a later one: the job will
        # never align on the old one, so follow, or every machine would wait for the other forever.
        return self._next_state == "done" and self._next is not None and target > self._next

    def _give_up_ahead(self) -> None:
        """Following a later target after replicating one the job will never align on (_adoptable): that
        one goes, and the job's aligned iteration is this machine's newest fully replicated again. Pins stay
        at two (the aligned iteration and the round's), and on the holders, whose two replica slots hold the
        aligned iteration and the one given up, the round's writes take the latter's slot: a holder keeps
        the job's aligned iteration, not its newest replica, when a newer one arrives (_keep_replicas)."""
        if not self._floor:
            return  # nothing aligned older than it is kept here: it stays, as the older replica slot
        self._release(self._pinned)
        self._pinned, self._floor = self._floor, {}
        self._pinned_version = version(next(iter(self._pinned.values())).manifest)

    def _keep_replicas(self, aligned: int | None) -> None:
        """As a holder: the job's aligned iteration is the replica this machine's replica stores keep when a
        newer one is written (SlotStore.keep). Their own rule (never overwrite the newest) is not enough: a
        sender that replicated an iteration the job then never aligned on (another machine gave it up) and
        follows a later one leaves its holders the aligned iteration and that one in their two slots, and
        the newest would be kept; a transfer dropped after the aligned one's slot was taken would leave the
        job no iteration in memory common to every rank."""
        for rank in self.holdings.ranks("replica"):
            self.holdings.replica_store(rank).keep = aligned

    def unalign(self) -> None:
        """The root says the job does not align (a machine runs free rounds, or none reports its part yet):
        rounds run free from now on, as before the job's first aligned iteration."""
        with self.condition:
            if not self._aligning:
                return
            self._aligning = False
            self._job_aligned = None
            self._keep_replicas(None)
            self._drop_next()  # a round already running completes as a free one
            self._floor_at(None)
            self.condition.notify_all()

    def _floor_at(self, aligned: int | None) -> None:
        """The job caught up (a newer aligned iteration), or no longer has one (a machine joined with nothing
        replicated, or the job stopped aligning): the older aligned iteration can go, except while a
        recovery collects."""
        floor = self._floor_iteration()
        if floor is not None and floor != aligned and not self._paused:
            self._release(self._floor)
            self._floor = {}

    def pause(self) -> None:
        """A recovery is collecting inventories: start no round and keep every pin until resume()."""
        with self.condition:
            self._paused = True

    def resume(
        self,
        restored: int | None = None,
        digests: Mapping[int, str | None] | None = None,
        generation: int | None = None,
    ) -> None:
        """Rounds go on after a recovery. `restored`: the iteration every local rank just restored as plan
        `generation` (`digests`: the plan's, by rank), replicated before anything else (_catch_up); the
        checkpoints of earlier generations past it are never replicated again."""
        with self.condition:
            self._paused = False
            if restored is not None:
                # Training restarts: the pace starts again. Kept, the time from the last commit before the
                # failure to the first after the restore counted as an iteration: with few commits before
                # it (a fault soon after a start or a restart), the median pace was the recovery's length,
                # and training that then stopped was seen as stopped (its newest commit replicated) only
                # STALL_ITERATIONS times that later: 85 s in the e2e FSDP2 test on a loaded host.
                self._commit_times.clear()
                if generation is not None:
                    self._rolled_back = (generation, restored)
                self._catch_up(restored, digests or {})
            self.condition.notify_all()

    def _catch_up(self, iteration: int, digests: Mapping[int, str | None]) -> None:
        """With the condition held: after a recovery every machine holds the restored iteration locally, but
        the job's aligned iteration is the newest one every machine keeps, and a replacement keeps nothing:
        the job had no aligned iteration until its first aligned round completed, the other machines' rounds
        moved on meanwhile (their aligned iteration released), and a second failure in that window found no
        iteration in common (once in the e2e partition test: the job restarted from scratch). And a machine
        whose holder was replaced has its copies on that holder no more. So every machine pins the restored
        iteration now, counts it as kept (_alignment_summary) and replicates it before anything else, asking
        every holder whatever it was told before: one that holds it (the peer a replacement fetched it from,
        a holder that survived) says so at once, a replacement receives it. The job's aligned iteration is
        then the restored one, on every machine and every holder."""
        if not self.targets or not self._can_align():
            return
        self._drop_next()  # an agreed iteration of the old history: see below
        ranks = self._local_ranks()
        pins: dict[int, SlotPin] = {}
        for rank in ranks:
            try:
                pin = self.holdings.local_store(rank).pin(iteration, digests.get(rank))
            except (CheckpointError, OSError) as exc:
                log.warning("rank %d: cannot pin the restored iteration %d: %s", rank, iteration, exc)
                pin = None
            if pin is None:  # not restored here (a rank without a source): nothing to claim
                self._release(pins)
                return
            pins[rank] = pin
        restored = {version(p.manifest) for p in pins.values()}
        if not ranks or len(restored) != 1:  # ranks of different histories: no iteration to claim
            self._release(pins)
            return
        # Pins past the restored iteration hold a history the recovery abandoned; a newest fully replicated
        # one that is not the job's aligned iteration goes too: besides this round's, one pin at most (the
        # aligned iteration), for the training process needs two slots free (open_write never takes the one
        # of its newest checkpoint). No agreed iteration is pinned ahead until this round is done (_pin_next),
        # and the one agreed before belongs to the old history (dropped above).
        floor = self._floor_iteration()
        if floor is not None and floor > iteration:
            self._release(self._floor)
            self._floor = {}
        pinned = self._pinned_version
        if self._floor or (pinned is not None and (pinned[1] > iteration or pinned[1] != self._job_aligned)):
            self._release(self._pinned)
            self._pinned, self._pinned_version = {}, None  # nor reported kept (_alignment_summary)
        current = self._round
        if current is not None:
            current.aborted = current.aborted or "a recovery restored an older iteration"
            self._release(current.pins)
            self.stats.aborted += 1
        self._rounds += 1
        committed_at = min(p.manifest.committed_at for p in pins.values())
        self._held.clear()  # a holder may have been replaced, with what it held
        self._round = self._new_round(restored.pop(), pins, ranks, committed_at)
        self._round.restored = True
        log.info("replicating the restored iteration %d before any other", iteration)

    def _restored_round(self) -> _Round | None:
        """The round of the iteration a recovery restored here (_catch_up), while it is under way."""
        current = self._round
        return current if current is not None and current.restored and current.aborted is None else None

    def _floor_iteration(self) -> int | None:
        return next(iter(self._floor.values())).manifest.iteration if self._floor else None

    def flush(self, ranks: list[int], timeout_s: float = 60.0) -> bool:
        """Block until every peer holds the newest committed checkpoint of each of `ranks` (False on
        timeout): a machine whose training finished replicates its last checkpoint before it says so
        (rounds run free meanwhile: the last checkpoint is no agreed iteration)."""
        with self.condition:
            self._ranks.update(ranks)
            self._flushing += 1
        try:
            return self._flush(ranks, timeout_s)
        finally:
            with self.condition:
                self._flushing -= 1

    def _flush(self, ranks: list[int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            newest = {rank: m for rank in ranks if (m := self.holdings.newest("local", rank)) is not None}
            with self.condition:
                if all(
                    self._held.get((machine, rank)) == version(manifest)
                    for machine in self.targets
                    for rank, manifest in newest.items()
                ):
                    return True
                self.condition.notify_all()
            time.sleep(0.05)
        return False

    def summary(self) -> dict[str, int | float | None]:
        """The heartbeat's replication figures: the newest fully replicated iteration, the interval between
        the last two, and the lag (newest committed iteration every local rank has, minus it)."""
        stats = self.stats
        with self.condition:
            ranks = sorted(self._ranks)
        newest = [m.iteration for rank in ranks if (m := self.holdings.newest("local", rank)) is not None]
        lag = None
        if newest and len(newest) == len(ranks) and stats.replicated_iteration is not None and self.targets:
            lag = max(0, min(newest) - stats.replicated_iteration)
        elif newest and len(newest) == len(ranks) and self.targets:
            lag = min(newest) + 1  # nothing fully replicated yet: every committed iteration is behind
        return {
            "replicated_iteration": stats.replicated_iteration if self.targets else None,
            "replication_interval": stats.interval,
            "replication_lag_iterations": lag,
            # Never negative: a wall clock stepped back (NTP, a resumed VM) would make the whole heartbeat
            # invalid (a 422, and the machine suspect) until the clock passed the last round again.
            "replication_age_s": (
                max(0.0, round(time.time() - stats.replicated_at, 3))
                if stats.replicated_at is not None
                else None
            ),
            "replication_rounds": stats.rounds,
            "replication_aborted": stats.aborted,
            # For the root's alignment (see align()): what this machine fully replicated and keeps pinned,
            # the iteration it proposes or adopted for the next round, and whether it holds that pinned.
            **(self._alignment_summary() if self.targets else {}),
        }

    def _alignment_summary(self) -> dict[str, Any]:
        if not self._can_align():
            return {"replication_free": True}
        with self.condition:
            # Only an iteration every local rank holds pinned and intact: the root aligns the job on it, and
            # each machine then lets older ones go. (A store too small to pin is no case here: _can_align()
            # is false with one, and the summary says replication_free.)
            ranks = set(self._local_ranks())
            kept = {
                pins[next(iter(pins))].manifest.iteration
                for pins in (self._floor, self._pinned)
                if pins
                and ranks <= pins.keys()
                and all(p.intact() for p in pins.values())
                and len({version(p.manifest) for p in pins.values()}) == 1
            }
            if (restoring := self._restored_round()) is not None:
                kept.add(restoring.iteration)  # on its way to the holders that lack it
            if not kept and self._paused:
                # A machine that joined a recovery (a replacement) keeps nothing until it restored: not
                # counted yet, or the job would have no aligned iteration and the others let theirs go.
                return {}
            return {
                "replication_kept": sorted(kept),
                "replication_generation": self._generation,
                "replication_next": self._next,
                "replication_ready": self._next is not None
                and self._next_state in ("pinned", "running", "done"),
                "replication_stalled": self._stalled(),
            }

    # -- rounds ------------------------------------------------------------------------------------------

    def _coordinate(self) -> None:
        while not self.stopping.is_set():
            with self.condition:
                try:
                    self._step()
                except Exception:  # the coordinator must outlive a bug in one step
                    log.exception("replication round bookkeeping failed")
                self.condition.wait(0.2)

    def _step(self) -> None:
        """With the condition held: finish, give up or start a round, and drop pins that a rollback broke."""
        current = self._round
        # A kept iteration is one every local rank holds (_alignment_summary): a pin one rank lets go
        # releases its whole set, and the newest fully replicated iteration is then pinned no more.
        if self._pins_let_go(self._pinned, current):
            self._pinned, self._pinned_version = {}, None
        if self._pins_let_go(self._floor, current):
            self._floor = {}
        if (
            current is not None
            and current.aborted is None
            and not all(p.intact() for p in current.pins.values())
        ):
            current.aborted = "a pinned checkpoint was replaced"
        if current is not None and current.aborted is None:
            # A sender waiting for a peer's verdict no longer reads the slot but the round still pins it.
            waiting = next((r for r, p in current.pins.items() if p.store.writer_waiting()), None)
            if waiting is not None:
                current.aborted = f"the training process of rank {waiting} needs its slot back"
        if current is not None and current.aborted is not None:
            log.info("replication round of iteration %d given up: %s", current.iteration, current.aborted)
            self.stats.aborted += 1
            self._release(current.pins)
            self._round = None
            self._given_up = current.version  # the next round takes a newer one
            if current.iteration == self._next and self._next_state == "running":
                # The agreed iteration: every machine must replicate it, so pinned again and retried while
                # it is still here (if it is gone, aligned rounds stall, the aligned iteration kept).
                self._next_state = ""
        elif current is not None and not current.left:
            self._complete(current)
        aligned = self._aligning and not self._flushing and self._can_align()
        if aligned and self.targets and self._restored_round() is None:
            # Not while the restored iteration's round runs: nothing is pinned ahead meanwhile (_pin_next),
            # so every agreed iteration would count as missed and double the lead.
            self._align_step()
        if self._round is None and not self._paused and self.targets:
            # Until the job has an aligned iteration (at its start, after a rollback) rounds also run free
            # while no agreed iteration is pinned: a machine lost early still finds this machine's replicas.
            free = not aligned or (self._job_aligned is None and self._next_state == "")
            self._round = self._start() if free else self._start_aligned()
            if self._round is not None:
                self.condition.notify_all()
        if self.on_alignment_change is not None and self.targets:
            told = self._alignment_summary()
            if told != self._alignment_told:
                self._alignment_told = told
                self.on_alignment_change()

    def _pins_let_go(self, pins: dict[int, SlotPin], current: _Round | None) -> bool:
        """Release every pin of the set `pins` (the iteration kept for every local rank) when one of them is
        broken (a rollback replaced its checkpoint) or its training process needs the slot; whether it did."""
        for rank, pin in pins.items():
            if not pin.intact():
                reason = f"rank {rank}'s pinned checkpoint was replaced"
            elif pin.store.writer_waiting() and (
                current is None or not (held := current.pins.get(rank)) or not held.held
            ):
                # The training process still finds no slot with the round's pin gone: its store has fewer
                # slots than the agent made (a Checkpointer opened before they existed). Training first.
                reason = f"rank {rank}'s training process needs the pinned slot"
            else:
                continue
            log.warning("%s: iteration %d unpinned for every rank", reason, pin.manifest.iteration)
            self._release(pins)
            return True
        return False

    # -- alignment across machines -----------------------------------------------------------------------

    def _local_ranks(self) -> list[int]:
        return sorted(self._ranks | set(self.holdings.ranks("local")))

    def _can_align(self) -> bool:
        """Asked to align, and every local store can keep a pin while its training process rotates (the
        embedded mode's two slots cannot: the agreed iteration pinned ahead would hold up the writer)."""
        return self.aligns and all(
            self.holdings.local_store(rank).slots >= PIN_MIN_SLOTS for rank in self._local_ranks()
        )

    def _iteration_s(self) -> float | None:
        """Seconds per iteration: the median over the last PACE_WINDOW commits of one local rank (a pause
        in between, training waiting, does not make iterations look longer)."""
        paces = sorted(
            (t1 - t0) / (i1 - i0) for (t0, i0), (t1, i1) in pairwise(self._commit_times) if i1 > i0
        )
        return paces[len(paces) // 2] if paces else None

    def _answer_period_s(self) -> float | None:
        """Seconds between the root's answers (the heartbeat period and its round trip), lately."""
        if len(self._answer_times) < 2:
            return None
        return (self._answer_times[-1] - self._answer_times[0]) / (len(self._answer_times) - 1)

    def _travel_s(self) -> float | None:
        """How long a proposal takes to reach every machine: AGREE_PERIODS heartbeat periods; with the
        alignment pushed (answers_pushed: the agent heartbeats at once and long-polls the root's answer),
        the longest of the last proposals' trips to an answer naming them (PUSHED_TRAVEL_S
        until one is measured)."""
        if self.answers_pushed:
            return max(self._travels) if self._travels else PUSHED_TRAVEL_S
        period_s = self._answer_period_s()
        return None if period_s is None else AGREE_PERIODS * period_s

    def _needed_lead(self) -> int:
        """The iterations committed while a proposal reaches every machine (_travel_s) at the observed commit
        rate, rounded up; 0 when that is at most NOW_TRAVEL of an iteration (and every local store has
        LEAD_NOW_SLOTS slots); LEAD until both paces are known."""
        iteration_s, travel_s = self._iteration_s(), self._travel_s()
        if iteration_s is None or travel_s is None:
            return LEAD
        travel = travel_s / iteration_s
        if travel <= NOW_TRAVEL and all(
            self.holdings.local_store(rank).slots >= LEAD_NOW_SLOTS for rank in self._local_ranks()
        ):
            return 0
        return min(LEAD_MAX, max(1, math.ceil(travel)))

    def _stalled(self) -> bool:
        """Whether training stopped committing here (see STALL_MIN_S)."""
        if self._last_commit_at is None:
            return False
        quiet_s = max(
            STALL_MIN_S, 2 * (self._answer_period_s() or 0.0), STALL_ITERATIONS * (self._iteration_s() or 0.0)
        )
        return time.monotonic() - self._last_commit_at > quiet_s

    def _pin_next(self, rank: int) -> None:
        assert self._next is not None
        if self._restored_round() is not None:
            return  # the restored iteration comes first, and a third pin would starve training (_catch_up)
        try:
            pin = self.holdings.local_store(rank).pin(self._next)
        except CheckpointError:
            pin = None
        if pin is not None and self._abandoned(version(pin.manifest)):
            pin.release()  # the number agreed on, of the old history: pinned once the new one commits it
            pin = None
        if pin is None:
            return
        current = self._round
        if current is not None and current.iteration != self._next and current.aborted is None:
            # A free round (before the job's first aligned iteration) would leave the training process one
            # slot with this pin too: the agreed iteration comes first.
            current.aborted = "an agreed iteration is pinned"
            self._release(current.pins)  # the senders' own read locks go as their transfers unwind
        self._next_pins[rank] = pin
        ranks = self._local_ranks()
        if ranks and all(r in self._next_pins for r in ranks):
            if len({version(p.manifest) for p in self._next_pins.values()}) == 1:
                self._next_state = "pinned"
                log.debug("iteration %d pinned for every local rank", self._next)
                self._lead = self._lead * 3 // 4
            else:  # ranks of different histories (a rollback under way): propose anew
                self._drop_next()

    def _drop_next(self) -> None:
        self._release(self._next_pins)
        self._next_pins, self._next, self._next_state, self._go = {}, None, "", False

    def _align_step(self) -> None:
        """Keep the agreed iteration pinned, notice one overwritten before it could be, and propose one."""
        ranks = self._local_ranks()
        newest = {r: m for r in ranks if (m := self._newest_current(r)) is not None}
        generation = max((manifest_generation(m) for m in newest.values()), default=self._generation)
        if generation != self._generation:
            # A recovery rolled the job back: what was proposed belongs to the old history (the root only
            # counts proposals of the newest generation).
            self._generation = generation
            if self._next_state in ("", "pinned"):
                self._drop_next()
        if self._next_pins and not all(p.intact() for p in self._next_pins.values()):
            self._drop_next()  # a rollback replaced it
        if self._next_state in ("", "pinned") and any(
            p.store.writer_waiting() for p in self._next_pins.values()
        ):
            log.warning(
                "a training process needs the slot pinned ahead for iteration %s: unpinned", self._next
            )
            self._drop_next()  # training first; the next proposal leads by more
            self._lead = min(LEAD_MAX, max(1, self._lead, self._needed_lead()) * 2)
        held = min(m.iteration for m in newest.values()) if newest and len(newest) == len(ranks) else None
        self._newest_common = held
        stalled = self._stalled()
        if self._declined is not None and not stalled:
            # Training went on after declining a target: hear the root's alignment again now rather than
            # when it changes. The other machines wait for this one, so it would not change until the poll
            # timed out (5 s), by when the target was overwritten here and the next proposal led by the
            # whole wait (52 iterations in the e2e fault matrix). Asked of the root, like every adoption.
            log.debug("training went on after declining iteration %d: asking the root again", self._declined)
            self._declined = None
            if self.on_rehear is not None:
                self.on_rehear()
        if (
            stalled
            and self._next is not None
            and self._next_state == ""
            and held is not None
            and self._next > held
        ):
            # Training stopped short of the agreed iteration: it would never come. Agree on one every machine
            # holds instead (each proposes its newest; the others' future proposals are not adopted).
            log.info(
                "training stopped at iteration %d short of iteration %d: proposing %d", held, self._next, held
            )
            self._drop_next()
        if self._next is not None and self._next_state == "":
            for rank in ranks:
                if self._next is not None and rank not in self._next_pins and rank in newest:
                    self._pin_next(rank)
            if self._next is not None and any(
                r not in self._next_pins and r in newest and newest[r].iteration > self._next for r in ranks
            ):
                # The training process rotated past the agreed iteration before this machine could pin it:
                # propose a later one (the others adopt the largest proposal), further ahead this time.
                log.info(
                    "iteration %d was overwritten before it could be pinned: proposing a later one",
                    self._next,
                )
                self._drop_next()
                self.stats.missed += 1
                self._lead = min(LEAD_MAX, max(1, self._lead, self._needed_lead()) * 2)
        ahead = (
            self._pinned_version is not None
            and self._job_aligned is not None
            and self._pinned_version[1] > self._job_aligned
        )
        if self._next is None and not ahead and held is not None:
            lead = max(self._lead, self._needed_lead())
            # Not an iteration the job has aligned already (lead 0, iterations slower than an aligned
            # cycle): the root counts no such proposal, so its answer would not change, and a machine whose
            # poll waits for a change would wait out the poll (5 s) before proposing again. The next commit
            # brings a newer one.
            fresh = self._job_aligned is None or held + lead > self._job_aligned
            if not stalled and fresh:
                self._next = held + lead
                self._proposed = (self._next, time.monotonic())
                log.debug("proposing iteration %d (newest common %d, lead %d)", self._next, held, lead)
                for rank in ranks if lead == 0 else ():  # committed already: pinned at once
                    if self._next is not None and self._next_state == "" and rank not in self._next_pins:
                        self._pin_next(rank)
            elif stalled and (self._job_aligned is None or held > self._job_aligned):
                # Training stopped: the newest iteration every local rank holds, pinned at once.
                self._next = held
                for rank in ranks:
                    if self._next is not None and self._next_state == "" and rank not in self._next_pins:
                        self._pin_next(rank)

    def _start_aligned(self) -> _Round | None:
        """The agreed iteration's round, once the root said every machine pinned it."""
        if not self._go or self._next_state != "pinned":
            return None
        ranks = self._local_ranks()
        if not ranks or any(r not in self._next_pins for r in ranks):
            return None
        if any(self.holdings.local_store(rank).writer_waiting() for rank in ranks):
            return None
        pins, self._next_pins, self._next_state = dict(self._next_pins), {}, "running"
        log.debug("aligned round of iteration %d started", self._next)
        chosen = version(next(iter(pins.values())).manifest)
        self._rounds += 1
        return self._new_round(chosen, pins, ranks, min(p.manifest.committed_at for p in pins.values()))

    def _start(self) -> _Round | None:
        ranks = sorted(self._ranks | set(self.holdings.ranks("local")))
        if not ranks:
            return None
        common: set[Version] | None = None
        for rank in ranks:
            try:
                held = {version(m) for m in self.holdings.local_store(rank).committed()}
            except CheckpointError:
                return None
            common = held if common is None else common & held
        floor = max((v for v in (self._replicated, self._given_up) if v is not None), default=None)
        candidates = sorted(
            v for v in common or () if (floor is None or v > floor) and not self._abandoned(v)
        )
        if not candidates:
            return None
        chosen = candidates[-1]
        if any(self.holdings.local_store(rank).writer_waiting() for rank in ranks):
            return None  # a training process is still getting its slot back from the last round
        pins: dict[int, SlotPin] = {}
        committed_at = time.time()
        for rank in ranks:
            store = self.holdings.local_store(rank)
            manifest = next((m for m in store.committed() if version(m) == chosen), None)
            pin = store.pin(chosen[1], manifest.digest) if manifest is not None else None
            if pin is None:  # overwritten meanwhile: try again with what is there now
                self._release(pins)
                return None
            pins[rank] = pin
            committed_at = min(committed_at, pin.manifest.committed_at)
        self._rounds += 1
        return self._new_round(chosen, pins, ranks, committed_at)

    def _newest_current(self, rank: int) -> Manifest | None:
        """`rank`'s newest committed checkpoint here, of the current history (not one the last recovery
        abandoned: those stay in the slots until the new history overwrites them)."""
        try:
            committed = self.holdings.local_store(rank).committed()
        except CheckpointError:
            return None
        return next((m for m in committed if not self._abandoned(version(m))), None)

    def _abandoned(self, checkpoint: Version) -> bool:
        """Whether `checkpoint` belongs to a history the last recovery rolled back from."""
        return abandoned(checkpoint, self._rolled_back)

    def _new_round(
        self, chosen: Version, pins: dict[int, SlotPin], ranks: list[int], committed_at: float
    ) -> _Round:
        # Round-robin over the local ranks: each round starts one rank further, so under load no rank is
        # always the last to be sent.
        shift = self._rounds % len(ranks)
        order = ranks[shift:] + ranks[:shift]
        todo = {
            machine: deque(r for r in order if self._held.get((machine, r)) != chosen)
            for machine in self.targets
        }
        left = {(machine, rank) for machine, queue in todo.items() for rank in queue}
        return _Round(self._rounds, chosen, pins, todo, left, committed_at)

    def _complete(self, current: _Round) -> None:
        previous, pinned = self._replicated, self._pinned_version
        if (
            self._aligning
            and pinned is not None
            and pinned[1] == self._job_aligned
            and self._pinned
            and current.iteration != self._job_aligned
        ):
            # The job's aligned iteration: kept (here, and as the holders' older replica slot) until every
            # machine replicated a newer one.
            self._release(self._floor)
            self._floor, self._pinned = self._pinned, {}
        self._release(self._pinned)
        if self._aligning and current.iteration == self._next and self._next_state == "running":
            self._next_state = "done"
        self._pinned = {rank: pin for rank, pin in current.pins.items() if pin.store.slots >= PIN_MIN_SLOTS}
        self._release({r: p for r, p in current.pins.items() if r not in self._pinned})
        self._pinned_version = self._replicated = current.version
        self._round = None
        stats = self.stats
        if previous is not None and previous[0] == current.version[0] and current.iteration > previous[1]:
            stats.interval = current.iteration - previous[1]  # (not the restored iteration's round, older)
        stats.replicated_iteration = current.iteration
        log.debug("round of iteration %d complete (interval %s)", current.iteration, stats.interval)
        stats.replicated_at = time.time()
        stats.last_lag_s = max(0.0, stats.replicated_at - current.committed_at)
        stats.last_round_s = time.monotonic() - current.started_at
        stats.rounds += 1
        for rank in current.pins:
            stats.replicated[rank] = current.iteration
        self._covered += len(current.pins)
        stats.skipped = max(0, self._noticed - self._covered)

    def _release(self, pins: dict[int, SlotPin]) -> None:
        for pin in pins.values():
            pin.release()

    # -- called by the senders ---------------------------------------------------------------------------

    def _take(self, machine: int) -> tuple[_Round, int] | None:
        with self.condition:
            while not self.stopping.is_set():
                current = self._round
                if current is not None and current.aborted is None and current.todo.get(machine):
                    return current, current.todo[machine].popleft()
                self.condition.wait(0.5)
            return None

    def _give_back(self, current: _Round, machine: int, rank: int, delay: float) -> None:
        if self.stopping.wait(delay):
            return
        with self.condition:
            if self._round is current and current.aborted is None:
                current.todo[machine].append(rank)
                self.condition.notify_all()

    def _done(self, current: _Round, machine: int, rank: int) -> None:
        with self.condition:
            self._held[(machine, rank)] = current.version
            current.left.discard((machine, rank))
            if not current.left:
                self.condition.notify_all()

    def _abort(self, current: _Round, reason: str) -> None:
        with self.condition:
            if current.aborted is None:
                current.aborted = reason
            self.condition.notify_all()

    def _must_let_go(self, current: _Round, rank: int) -> bool:
        """Asked between stripes (and while a peer stalls): give the transfer up only when its round was
        given up, or the training process needs this rank's slot back, never for a newer commit."""
        if current.aborted is not None or self.stopping.is_set():
            return True
        pin = current.pins.get(rank)
        if pin is not None and pin.store.writer_waiting():
            with self.condition:
                if current.aborted is None:
                    current.aborted = f"the training process of rank {rank} needs its slot back"
                # Release the round's pin at once: the reader's own lock goes when the transfer unwinds.
                pin.release()
                self.condition.notify_all()
            return True
        return False
