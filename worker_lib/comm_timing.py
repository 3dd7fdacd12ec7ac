"""When training's own communication is on the wire, told to the agent (GEMINI's online profiling).

    from worker_lib import time_communication
    model = DistributedDataParallel(model)
    time_communication(model)            # once, before training

`time_communication` registers a DDP communication hook that wraps the default all-reduce and timestamps
each bucket's all-reduce from the moment DDP hands it over to the moment its future completes, and a forward
pre-hook that marks each iteration's start. Every iteration's busy spans (relative to its start) go into a
sliding window; after the first `warmup + window` iterations, and again every `every` iterations, the
window's profile (worker_lib.interleave.profile: median iteration length, busy spans from the earliest
start to the end that 3/4 of the window's iterations stopped by: a quantile, not the union) is published.

Publishing is a small file in the rank's shared-memory directory ($CASTOR_SHM_DIR, next to its checkpoint
slots), mapped by both sides: the agent that already reads this rank's checkpoints from that directory reads
the board too (worker_lib/agent/replication.py). Besides the profile, the board carries the latest
iteration's start (CLOCK_MONOTONIC, the same clock in every process of the machine), how many of
training's collectives are in flight right now, so the sender also holds back a chunk while training is
actually communicating, and since when the wire has been quiet after an iteration's last collective (its
count reached the profile's), the anchor of the profile's `gap`. Writes take microseconds (a seqlock over
a few stores into the mapping), no system call, so the hooks cost training nothing measurable.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_lib.interleave import CommProfile, IterationComm, profile

BOARD_FILE = "comm-timing"
MAGIC = b"CCT2"
MAX_SPANS = 64
# magic, seq, iteration start, in flight, iterations seen, period, profiled at, span count, quiet since,
# the profile's collectives and gap; then the spans
_HEAD = struct.Struct("<4sQdqqddqdqd")
_SPAN = struct.Struct("<dd")
SIZE = _HEAD.size + MAX_SPANS * _SPAN.size


@dataclass(frozen=True)
class BoardState:
    iteration_start: float  # time.monotonic() of the latest iteration's start (0: none yet)
    in_flight: int  # training's collectives on the wire now
    iterations: int  # iterations seen
    profile: CommProfile | None
    profiled_at: float  # time.monotonic() of the profile's publication
    # time.monotonic() the latest iteration's collectives all ended (as many as the profile's); 0 while
    # some are still to come or on the wire
    quiet_since: float = 0.0


class CommBoard:
    """The mapped file. The training process writes (one writer per rank), the agent reads; a reader that
    sees an odd or changed sequence number reads again."""

    def __init__(self, path: Path, *, create: bool = False) -> None:
        self.path = Path(path)
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
            with open(temporary, "wb") as f:
                f.write(_HEAD.pack(MAGIC, 0, 0.0, 0, 0, 0.0, 0.0, 0, 0.0, 0, 0.0).ljust(SIZE, b"\0"))
            os.replace(temporary, self.path)  # a reader never maps a half-written file
        with open(self.path, "r+b" if create else "rb") as f:
            self._map = mmap.mmap(f.fileno(), SIZE, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
        self._values: list[Any] = list(_HEAD.unpack_from(self._map, 0))
        if self._values[0] != MAGIC:
            self._map.close()
            raise ValueError(f"{self.path} is not a communication board")
        self._spans: tuple[tuple[float, float], ...] = ()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path) -> CommBoard | None:
        """The board, if the training process made one; None otherwise (not timed, or not started yet)."""
        try:
            return cls(path)
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        self._map.close()

    # -- writer ------------------------------------------------------------------------------------------

    def _write(self, **changes: Any) -> None:
        with self._lock:  # the gloo thread (completions) and the training thread (starts) both write
            fields = (
                "magic", "seq", "start", "in_flight", "iterations", "period", "profiled_at", "spans",
                "quiet_since", "collectives", "gap",
            )  # fmt: skip
            values = self._values
            for name, value in changes.items():
                values[fields.index(name)] = value
            values[1] += 1  # odd: a write is under way
            struct.pack_into("<Q", self._map, 4, values[1])
            if "spans" in changes:
                for i, (s, e) in enumerate(self._spans[:MAX_SPANS]):
                    _SPAN.pack_into(self._map, _HEAD.size + i * _SPAN.size, s, e)
            _HEAD.pack_into(self._map, 0, *values)  # still odd
            values[1] += 1
            struct.pack_into("<Q", self._map, 4, values[1])  # even: done

    def iteration_started(self, at: float, iterations: int) -> None:
        self._write(start=at, iterations=iterations)

    def set_in_flight(self, count: int, quiet_since: float = 0.0) -> None:
        self._write(in_flight=count, quiet_since=quiet_since)

    def publish(self, found: CommProfile, at: float) -> None:
        self._spans = tuple(found.busy[:MAX_SPANS])
        self._write(
            period=found.period,
            profiled_at=at,
            spans=len(self._spans),
            collectives=found.collectives,
            gap=found.gap,
        )

    # -- reader ------------------------------------------------------------------------------------------

    def read(self) -> BoardState | None:
        for _ in range(100):
            head = _HEAD.unpack_from(self._map, 0)
            if head[1] % 2:
                continue
            count = min(int(head[7]), MAX_SPANS)
            spans = tuple(_SPAN.unpack_from(self._map, _HEAD.size + i * _SPAN.size) for i in range(count))
            if struct.unpack_from("<Q", self._map, 4)[0] != head[1]:
                continue
            found = CommProfile(head[5], spans, int(head[9]), head[10]) if head[5] > 0 else None
            return BoardState(head[2], int(head[3]), int(head[4]), found, head[6], head[8])
        return None


class CommTimer:
    """Records one DDP model's communication; see the module's docstring."""

    def __init__(
        self,
        board: CommBoard | None,
        *,
        warmup: int = 3,
        window: int = 10,
        every: int = 50,
    ) -> None:
        self.board = board
        self.warmup, self.window, self.every = warmup, window, every
        self.iterations = 0
        self.history: deque[IterationComm] = deque(maxlen=window)
        self.profile: CommProfile | None = None
        self._lock = threading.Lock()
        self._start: float | None = None
        self._busy: list[tuple[float, float]] = []
        self._in_flight = 0
        self._since_publish = 0
        # Absolute (time.monotonic()) busy spans and iteration starts, the newest kept: what a benchmark or
        # a test compares with the agent's send windows.
        self.spans: deque[tuple[float, float]] = deque(maxlen=100_000)
        self.starts: deque[float] = deque(maxlen=100_000)

    # Called by the hooks ------------------------------------------------------------------------------

    def iteration_start(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._start is not None:
                spans = tuple((s - self._start, e - self._start) for s, e in self._busy)
                if self.iterations > self.warmup:
                    self.history.append(IterationComm(now - self._start, spans))
                    self._since_publish += 1
            self._busy = []
            self._start = now
            self.starts.append(now)
            self.iterations += 1
            due = len(self.history) >= self.window and (
                self.profile is None or self._since_publish >= self.every
            )
            found = profile(list(self.history)) if due else None
            if found is not None:
                self.profile, self._since_publish = found, 0
        if self.board is not None:
            self.board.iteration_started(now, self.iterations)
            if found is not None:
                self.board.publish(found, now)

    def comm_started(self) -> float:
        with self._lock:  # the board written under it too: a start and a finish never land out of order
            self._in_flight += 1
            if self.board is not None:
                self.board.set_in_flight(self._in_flight)
        return time.monotonic()

    def comm_finished(self, started: float) -> None:
        now = time.monotonic()
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            count = self._in_flight
            self._busy.append((started, now))
            self.spans.append((started, now))
            # The iteration's communication is over: quiet until the next one's first collective (the
            # profile's gap), however long this iteration's took.
            over = count == 0 and self.profile is not None and 0 < self.profile.collectives <= len(self._busy)
            if self.board is not None:
                self.board.set_in_flight(count, now if over else 0.0)


def board_path(directory: Path | str | None = None) -> Path | None:
    """Where a rank's board lives: in its shared-memory directory ($CASTOR_SHM_DIR); None without one."""
    chosen = directory if directory is not None else os.environ.get("CASTOR_SHM_DIR")
    return Path(chosen) / BOARD_FILE if chosen else None


def time_communication(
    model: Any,
    directory: Path | str | None = None,
    *,
    process_group: Any = None,
    warmup: int = 3,
    window: int = 10,
    every: int = 50,
) -> CommTimer:
    """Time a DistributedDataParallel model's gradient all-reduce and publish the idle spans of its
    iterations to the agent (the board in `directory`, default $CASTOR_SHM_DIR; without either, timing only).

    It registers a communication hook (the default all-reduce, timed) and a forward pre-hook: call it once,
    before training, on a model that has no communication hook of its own (DDP allows one)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    path = board_path(directory)
    board = CommBoard(path, create=True) if path is not None else None
    timer = CommTimer(board, warmup=warmup, window=window, every=every)

    # No annotations: DDP checks them against its own types, and this module's are strings.
    def timed_allreduce(group, bucket):  # type: ignore[no-untyped-def]
        started = timer.comm_started()
        future = allreduce_hook(group, bucket)

        def finished(done: Any) -> Any:
            timer.comm_finished(started)
            return done.value()

        return future.then(finished)

    model.register_comm_hook(process_group, timed_allreduce)
    model.register_forward_pre_hook(lambda module, args: timer.iteration_start())
    return timer
