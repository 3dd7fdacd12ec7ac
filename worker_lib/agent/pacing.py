"""When the replication senders may put checkpoint bytes on the wire: the job's replication policy.

* `eager`: as fast as the link allows (the senders' streams in parallel).
* `interleaved` (the default): one chunk on the wire at a time, sent only inside an idle span of training's
  own communication, sized to drain before the span ends (worker_lib.interleave.next_grant, GEMINI's
  Algorithm 2 applied online). The spans come from the boards the local training processes publish
  (worker_lib.comm_timing: the profile, the latest iteration's start, the collectives in flight now). A
  chunk must fit in what is left of the span after the bytes already queued on the socket drain (TIOCOUTQ:
  the bytes the kernel has not had acknowledged), so the queue stays full between chunks; the link's rate
  is learnt from the bytes acknowledged between two looks. Until a training process published a profile
  (the first iterations, or a model not timed) chunks go out as under `eager`.
* A cap (the job's `replication_bandwidth_gbps`), under either policy: a token bucket over all senders.

Senders call `grant(wanted, unsent)` before each piece of a stripe (the data plane's `pace`), and
`finished()` after their put: under `interleaved` a put holds the wire from its first grant to its end, so
two streams never interleave their chunks on the one NIC. Every granted chunk is logged (`windows`: start,
drain, bytes), which the tests and the benchmark compare with the comm spans training recorded.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from worker_lib.api.worker import RegisterResponse
from worker_lib.comm_timing import BoardState, CommBoard
from worker_lib.interleave import CHUNK_MAX, Grant, next_grant

log = logging.getLogger(__name__)

Policy = Literal["interleaved", "eager"]
POLICIES = ("interleaved", "eager")
DEFAULT_BANDWIDTH = 125e6  # bytes/s (1 Gbit/s) until the first chunk measured the link
DRAINED = 4096  # bytes still unacknowledged that count as drained (the last segment's ACK in flight)
POLL_S = 0.005  # while an early end of training's collectives could open an idle span, look this often
WAIT_MAX_S = 0.1  # a grant waits at most this long before letting the sender check for a given-up round


def unsent_bytes(sock: socket.socket) -> int:
    """Bytes written to `sock` that the peer has not acknowledged yet (Linux TIOCOUTQ); 0 if unknown."""
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        return int(struct.unpack("i", raw)[0])
    except (OSError, ValueError):
        return 0


class Pacer:
    def __init__(
        self,
        policy: str = "interleaved",
        bandwidth_cap: float | None = None,
        boards: Callable[[], list[Path]] = list,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`bandwidth_cap` in bytes/s; `boards`: the local training processes' board files."""
        if policy not in POLICIES:
            raise ValueError(f"unknown replication policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self.cap = bandwidth_cap if bandwidth_cap and bandwidth_cap > 0 else None
        self._board_paths = boards
        self._boards: dict[Path, CommBoard] = {}
        self._clock = clock
        self.bandwidth: float | None = None  # measured, bytes/s
        self.windows: deque[tuple[float, float, int]] = deque(maxlen=100_000)  # (start, drained, bytes)
        self._wire = threading.Lock()  # held by the put on the wire (interleaved)
        self._holder: int | None = None
        self._granted = 0  # bytes granted to the put holding the wire
        self._mark: tuple[float, int] | None = None  # (when, bytes acknowledged) at the last look
        self._boards_at = -1.0
        self._paths: list[Path] = []
        self._bucket_at = 0.0  # the cap's token bucket: the earliest time of the next byte
        self._lock = threading.Lock()

    # -- what the training processes publish ------------------------------------------------------------

    def states(self) -> list[BoardState]:
        now = self._clock()
        if now - self._boards_at > 2.0 or now < self._boards_at:  # the local ranks rarely change
            self._paths, self._boards_at = self._board_paths(), now
        states = []
        for path in self._paths:
            board = self._boards.get(path)
            if board is None:
                board = CommBoard.open(path)
                if board is None:
                    continue
                self._boards[path] = board
            state = board.read()
            if state is not None:
                states.append(state)
        return states

    def close(self) -> None:
        for board in self._boards.values():
            board.close()
        self._boards.clear()

    # -- the senders ---------------------------------------------------------------------------------------

    def grant(self, wanted: int, unsent: Callable[[], int]) -> int:
        """Bytes the calling sender may send now (> 0), after waiting for its chance; 0 after about
        WAIT_MAX_S without one (the sender checks whether its round was given up, and asks again)."""
        if wanted <= 0:
            return 0
        deadline = self._clock() + WAIT_MAX_S
        if self.policy == "eager":
            return self._capped(min(wanted, CHUNK_MAX), deadline)
        me = threading.get_ident()
        if self._holder != me and not any(s.profile is not None for s in self.states()):
            # Nothing published yet (the first iterations, a model not timed): nothing to protect.
            return self._capped(min(wanted, CHUNK_MAX), deadline)
        if self._holder != me:
            if not self._wire.acquire(timeout=WAIT_MAX_S):
                return 0
            self._holder, self._granted, self._mark = me, 0, None
        while True:
            now = self._clock()
            # What this put already queued is on the wire ahead of a new chunk: the chunk must fit in what
            # is left of the idle span after it drains (and the queue stays full between chunks).
            backlog = unsent()
            self._observe(now, backlog)
            rate = self.bandwidth or self.cap or DEFAULT_BANDWIDTH
            ahead = backlog / rate
            states = self.states()
            timed = [s for s in states if s.profile is not None]
            start = max((s.iteration_start for s in states), default=0.0)
            # Every local rank's iteration communicated all it does (the wire quiet since the latest end):
            # the gap after that end is idle, even where the phase says a late collective would still run.
            quiet = [s.quiet_since for s in timed]
            all_quiet = bool(quiet) and min(quiet) > 0
            decided: Grant = next_grant(
                timed[0].profile if timed else None,
                now + ahead - start,
                sum(s.in_flight for s in states),
                wanted,
                rate,
                quiet_for=now + ahead - max(quiet) if all_quiet else None,
            )
            if decided.size > 0:
                size = self._capped(decided.size, deadline)
                if size > 0:
                    self._granted += size
                    self.windows.append((now + ahead, now + ahead + size / rate, size))
                return size
            if now >= deadline:
                return 0
            # Wake when the next span opens, or sooner: while the iteration's collectives are not all done,
            # one that ends early opens the gap after it (quiet_for), so look again every POLL_S (every
            # next_grant's poll_s while one is in flight). And sleep out the patience even when that span
            # opens later: returning 0 at once made the sender ask again at once, a busy loop for the
            # whole wait (a core at replication's priority, and the agent's GIL, while training's
            # collectives ran).
            settled = all_quiet or not any(s.profile.gap > 0 for s in timed if s.profile)
            time.sleep(min(max(decided.wait_s, 0.001), 0.05 if settled else POLL_S, deadline - now))

    def finished(self) -> None:
        """The calling sender's put is over (sent, given up or failed): the wire is free for another."""
        if self._holder == threading.get_ident():
            self._holder = None
            self._wire.release()

    def _observe(self, now: float, backlog: int) -> None:
        """Learn the link's rate from the bytes acknowledged between two looks that both found a queue (it
        never emptied in between: only a grant adds to it, after its look)."""
        acked = self._granted - backlog
        mark = self._mark
        self._mark = (now, acked) if backlog > DRAINED else None
        if mark is None or backlog <= DRAINED:
            return
        seconds, count = now - mark[0], acked - mark[1]
        if seconds >= 0.005 and count >= 256 << 10:
            sample = count / seconds
            self.bandwidth = sample if self.bandwidth is None else 0.8 * self.bandwidth + 0.2 * sample

    def _capped(self, size: int, deadline: float) -> int:
        if self.cap is None:
            if self.policy == "eager":
                self.windows.append((self._clock(), self._clock(), size))
            return size
        size = max(1, min(size, int(self.cap * 0.05)))  # at most 50 ms of the cap at once
        with self._lock:
            now = self._clock()
            at = max(now, self._bucket_at)
            if at > deadline:
                return 0
            self._bucket_at = at + size / self.cap
        if at > now:
            time.sleep(at - now)
        if self.policy == "eager":
            self.windows.append((at, at + size / self.cap, size))
        return size


POLICY_ENV = "CASTOR_REPLICATION_POLICY"


def replication_pacer(registration: RegisterResponse, boards: Callable[[], list[Path]]) -> Pacer:
    """The pacer of the job's policy and cap, as the registration answer carries them;
    $CASTOR_REPLICATION_POLICY overrides the policy on this machine (an
    operator's escape hatch, and the benchmark's switch). An unknown policy falls back to interleaved."""
    policy = os.environ.get(POLICY_ENV) or registration.replication_policy or "interleaved"
    if policy not in POLICIES:
        log.warning("unknown replication policy %r: interleaved", policy)
        policy = "interleaved"
    gbps = registration.replication_bandwidth_gbps
    cap = float(gbps) * 1e9 / 8 if gbps else None
    log.info("replication policy %s%s", policy, f", capped at {gbps} Gbit/s" if cap else "")
    return Pacer(policy, cap, boards)
