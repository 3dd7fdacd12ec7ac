"""A job's in-memory replication progress from its machines' heartbeat summaries (pure).

Each replicating agent reports the newest iteration it fully replicated (every local rank on every peer
the placement names), the achieved interval between its last two fully replicated iterations, and its lag:
the newest iteration all its ranks committed minus the fully replicated one. When a checkpoint takes longer
than an iteration to cross the network the interval grows; the lag then stays within about two intervals.
When replication stops advancing (a peer unreachable, every round given up), the interval stays at its
last value while the lag keeps growing: that is the "stalled" state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Stalled: the lag exceeds this many intervals (steady state: one to two), and at least STALLED_LAG_MIN
# iterations (a first round of a large checkpoint on a slow link is not yet a stall).
STALLED_INTERVALS = 4
STALLED_LAG_MIN = 20


@dataclass(frozen=True)
class ReplicationProgress:
    replicated_iteration: int | None  # the newest iteration every replicating machine fully replicated
    interval: int | None  # the largest achieved interval, iterations
    lag: int | None  # the largest lag, iterations
    state: str | None  # "ok", "stalled"; None: no machine replicates (or none reported yet)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def stalled(interval: int | None, lag: int) -> bool:
    return lag > max(STALLED_INTERVALS * (interval or 1), STALLED_LAG_MIN)


def job_replication(summaries: Iterable[Mapping[str, Any]]) -> ReplicationProgress:
    """Figures over the machines that report a replication lag (a machine with no peers to send to, m = 1,
    reports none)."""
    replicating = [s for s in summaries if _count(s.get("replication_lag_iterations")) is not None]
    if not replicating:
        return ReplicationProgress(None, None, None, None)
    lags = [int(s["replication_lag_iterations"]) for s in replicating]
    intervals = [i for s in replicating if (i := _count(s.get("replication_interval"))) is not None]
    replicated = [_count(s.get("replicated_iteration")) for s in replicating]
    interval = max(intervals) if intervals else None
    state = (
        "stalled"
        if any(
            stalled(_count(s.get("replication_interval")), lag)
            for s, lag in zip(replicating, lags, strict=True)
        )
        else "ok"
    )
    return ReplicationProgress(
        replicated_iteration=None if None in replicated else min(r for r in replicated if r is not None),
        interval=interval,
        lag=max(lags),
        state=state,
    )


# -- cross-machine alignment -----------------------------------------------------------------------------
# Each machine's rounds complete at their own pace, so left alone two machines keep different iterations
# pinned: after a machine loss the survivors would not hold locally the iteration the lost machine's
# replicas are of. Aligned rounds go through the root in two phases, over heartbeats: every agent proposes a
# future iteration (`replication_next`), adopts the largest one proposed, pins it as soon as all its ranks
# committed it (`replication_ready`); once every machine is ready on the same iteration the root says go, and
# the iteration every machine fully replicated and still keeps (`replication_kept`) becomes the job's aligned
# one. A machine keeps the aligned iteration pinned (locally and, as its older replica slot, on its holders)
# and starts no round past its own newest until the aligned one catches up with it.


@dataclass(frozen=True)
class ReplicationAlignment:
    aligned_iteration: int | None  # the newest iteration every replicating machine fully replicated and keeps
    target: int | None  # the next iteration to replicate everywhere (the largest proposed past the aligned)
    go: bool  # every replicating machine has pinned `target` for all its ranks: start the round


def _iterations(value: Any) -> set[int] | None:
    if not isinstance(value, list):
        return None
    return {i for v in value if (i := _count(v)) is not None}


def replication_alignment(summaries: Iterable[Mapping[str, Any]]) -> ReplicationAlignment | None:
    """From the machines' summaries (those that replicate report `replication_kept`); None when no machine
    does (an older agent, m = 1)."""
    summaries = list(summaries)
    if any(s.get("replication_free") is True for s in summaries):
        return None  # a machine replicates its own iterations (told not to align, or cannot pin): none align
    replicating = [s for s in summaries if _iterations(s.get("replication_kept")) is not None]
    if not replicating:
        return None
    common: set[int] | None = None
    for summary in replicating:
        kept = _iterations(summary.get("replication_kept")) or set()
        common = kept if common is None else common & kept
    aligned = max(common) if common else None
    # After a rollback a machine that has not yet seen the new history still proposes an iteration of the
    # old one: only the newest generation's proposals count.
    generations = [_count(s.get("replication_generation")) or 1 for s in replicating]
    newest = max(generations)
    proposed = [
        n
        for s, generation in zip(replicating, generations, strict=True)
        if generation == newest
        and (n := _count(s.get("replication_next"))) is not None
        and (aligned is None or n > aligned)
    ]
    # Each machine proposes an iteration ahead of its newest commit and adopts the largest proposal. Once
    # every machine has stopped committing (training waits: a pause, a hung rank), each proposes the newest
    # iteration it holds, and those can differ by one (a rank hung while its peers had committed one more):
    # the smallest is the one every machine holds.
    everyone_stalled = all(s.get("replication_stalled") is True for s in replicating)
    target = (min if everyone_stalled else max)(proposed) if proposed else None
    go = target is not None and all(
        _count(s.get("replication_next")) == target and s.get("replication_ready") is True
        for s in replicating
    )
    return ReplicationAlignment(aligned, target, go)
