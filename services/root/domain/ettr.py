"""A job's measured effective training time ratio (ETTR): productive time over wall time since it started.

    wall        started_at -> finished_at (or now)
    wasted      downtime (the union of every failure's recovery, by phase) + iterations lost x iteration time
                + checkpoint stalls (what checkpointing cost training, when the agents report it)
    productive  wall - wasted
    ETTR        productive / wall

Downtime by cause (the phases of `domain/phases.py`): detection (detect + classify), replacement, restore,
restart warm-up (the resume phase less its first iteration, which is kept work), and lost iterations. Failures
whose recoveries overlap (one failure during another's recovery) are counted once: each second of downtime
goes to the phase of the earliest failure under way at that second.

Checkpoint stalls: every training process counts the seconds its training thread was blocked inside Castor
(save() calls, and waits for a copy at the optimizer step, a saved module's forward, wait()) and the save()
calls; agents report them per rank in their heartbeat summaries (cumulative). Ranks meet in collectives, so
a stall on one holds up all: the job's cost of an iteration is the slowest rank's stall. Only cumulative
figures reach the root, so it charges the largest rank total (a rank's figures summed over the machines that
ran it, replaced ones included): a lower bound of the sum over iterations of the slowest rank, exact when
the same rank is the slowest every time (equal shards). The stalls of iterations later rolled back are
already in the lost iterations (their iteration time includes them), so they are taken out, at the rank's
mean stall per save (one save per iteration, as the iteration time assumes). Not in it: the cores a
background copy takes from compute (training slowed, not blocked); and, while nothing reports them, it is
None, not 0. Not measured either: the part of the iteration in progress when the failure hit, which no
counter records (the iterations lost are the committed iterations rolled back).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

CAUSES = ("detection", "replacement", "restore", "warmup", "lost_iterations")
PHASE_CAUSE = {
    "detect": "detection",
    "classify": "detection",
    "replace": "replacement",
    "restore": "restore",
    "resume": "warmup",
}


@dataclass(frozen=True)
class PhaseSpan:
    name: str  # detect | classify | replace | restore | resume
    start: datetime
    end: datetime  # now, for a phase under way


@dataclass(frozen=True)
class FailureRecord:
    failed_at: datetime
    phases: tuple[PhaseSpan, ...]
    iterations_lost: int | None


@dataclass(frozen=True)
class MeasuredEttr:
    ettr: float | None  # None before the job started
    wall_s: float
    productive_s: float
    wasted_s: dict[str, float]  # by cause (CAUSES)
    checkpoint_overhead_s: float | None  # checkpoint stalls charged; None: not measured
    iteration_s: float | None  # the iteration time used for lost iterations and the warm-up


@dataclass(frozen=True)
class CheckpointStall:
    """The slowest rank's cumulative stall: seconds its training thread was blocked in Castor, over saves."""

    rank: int
    seconds: float
    saves: int


def iteration_seconds(checkpoints_per_minute: float | None) -> float | None:
    """The iteration time the effective checkpoint frequency means (a checkpoint every iteration, as the
    recovery accounting takes it); None when unknown, or when it gives no finite time (a frequency stored
    before the API bounded it)."""
    if checkpoints_per_minute is None or not 0 < checkpoints_per_minute < math.inf:
        return None
    seconds = 60.0 / checkpoints_per_minute
    return seconds if math.isfinite(seconds) else None


def checkpoint_stall(summaries: Iterable[Mapping[str, object]]) -> CheckpointStall | None:
    """The job's checkpoint stall from the newest heartbeat summary of each of its machines (every machine
    that ran it, replaced ones too: a rank's figures are summed over them): the rank with the most seconds.
    None when no summary carries the figure (agents from before it). Summaries from etcd are not validated
    by a schema: anything that is not a rank -> non-negative number is skipped."""
    seconds: dict[int, float] = {}
    saves: dict[int, int] = {}
    for summary in summaries:
        stalled, calls = summary.get("stalled_s"), summary.get("save_calls")
        if not isinstance(stalled, Mapping):
            continue
        calls = calls if isinstance(calls, Mapping) else {}
        for key, value in stalled.items():
            rank = _rank(key)
            if rank is None or not _non_negative(value):
                continue
            seconds[rank] = seconds.get(rank, 0.0) + float(value)
            count = calls.get(key)
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                saves[rank] = saves.get(rank, 0) + count
            else:
                saves.setdefault(rank, 0)
    if not seconds:
        return None
    slowest = max(seconds, key=lambda rank: (seconds[rank], -rank))
    return CheckpointStall(slowest, seconds[slowest], saves[slowest])


def _rank(key: object) -> int | None:
    try:
        rank = int(str(key))
    except ValueError:
        return None
    return rank if rank >= 0 else None


def _non_negative(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    )


def measure_ettr(
    *,
    started_at: datetime | None,
    ended_at: datetime,
    failures: Sequence[FailureRecord],
    iteration_s: float | None,
    stall: CheckpointStall | None = None,
) -> MeasuredEttr:
    wasted = dict.fromkeys(CAUSES, 0.0)
    if started_at is None or ended_at <= started_at:
        return MeasuredEttr(None, 0.0, 0.0, wasted, None if stall is None else 0.0, iteration_s)
    wall = (ended_at - started_at).total_seconds()
    it = iteration_s or 0.0

    # Phase intervals clipped to the job's wall time; the resume phase's last iteration is productive.
    spans: list[tuple[float, float, int, str]] = []  # start, end, failure order, cause
    ordered = sorted(failures, key=lambda f: f.failed_at)
    for order, failure in enumerate(ordered):
        for phase in failure.phases:
            start = max(0.0, (phase.start - started_at).total_seconds())
            end = min(wall, (phase.end - started_at).total_seconds())
            if phase.name == "resume":
                end = min(end, max(start, (phase.end - started_at).total_seconds() - it))
            if end > start:
                spans.append((start, end, order, PHASE_CAUSE.get(phase.name, "restore")))

    # Sweep the breakpoints: each elementary segment goes to the earliest failure covering it (a heap of
    # the spans under way, keyed by failure order; spans that ended are dropped lazily). O(n log n).
    points = sorted({p for s in spans for p in (s[0], s[1])})
    spans.sort()
    active: list[tuple[int, float, str]] = []  # (failure order, end, cause)
    next_span = 0
    for a, b in itertools.pairwise(points):
        while next_span < len(spans) and spans[next_span][0] <= a:
            start, end, order, cause = spans[next_span]
            heapq.heappush(active, (order, end, cause))
            next_span += 1
        while active and active[0][1] < b:
            heapq.heappop(active)
        if active:
            wasted[active[0][2]] += b - a

    # Iterations lost: once per recovery (failures joined in one recovery report the same rollback).
    lost_iterations = 0
    recovery_end: datetime | None = None
    group_max = 0
    for failure in ordered:
        finished = max((p.end for p in failure.phases), default=failure.failed_at)
        if recovery_end is not None and failure.failed_at <= recovery_end:
            group_max = max(group_max, failure.iterations_lost or 0)
            recovery_end = max(recovery_end, finished)
        else:
            lost_iterations += group_max
            group_max, recovery_end = failure.iterations_lost or 0, finished
    lost_iterations += group_max
    # At most the wall time: the rolled-back iterations ran inside the job's time (a rate near the API's
    # lower bound once made one iteration last longer than the job).
    wasted["lost_iterations"] = min(lost_iterations * it, wall)

    # Checkpoint stalls, less those of the iterations rolled back (already charged, stalls included, above).
    checkpoint_overhead_s: float | None = None
    if stall is not None:
        charged = stall.seconds
        if it > 0 and stall.saves > 0:
            charged *= 1.0 - min(1.0, lost_iterations / stall.saves)
        checkpoint_overhead_s = min(charged, wall)

    total = sum(wasted.values()) + (checkpoint_overhead_s or 0.0)
    productive = max(0.0, wall - total)
    return MeasuredEttr(productive / wall, wall, productive, wasted, checkpoint_overhead_s, iteration_s)
