"""Embedded (torchrun) mode: torchrun, not the root, restarts the training, and the root records each failure
and closes it once the rank's machine trains again.

A relaunched machine registers again with a new session (`relaunched_at` on its open failures, or a failure
of its own when none was open: a relaunch faster than the heartbeat timeout, or a one-machine job, which is
never declared lost on its silence alone). The failure is recovered at the first heartbeat after the relaunch
that shows a commit: the relaunched training restored its checkpoint and completed an iteration.

What the relaunch rolled back: the newest iteration the machine had committed before it against the
iteration its relaunched training restored. The relaunched ranks say both (the new session's summary: what
each restored, and the newest iteration its shared memory held then); a machine whose library does not say
the newest is taken at its last summary before the new session registered (`reached_iteration` on the
failure, up to a heartbeat behind). Torchrun's ranks restore from their machine's shared memory (the local
tier), or start fresh when the ranks hold no iteration in common.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from services.root.domain.phases import parse_timestamp
from worker_lib.api.shared import INT32_MAX
from worker_lib.api.worker import FRESH_START

RELAUNCHED_AT = "relaunched_at"  # the failure event's detail: when the rank's machine registered again
REACHED = "reached_iteration"  # the failure event's detail: the newest iteration committed before it
# The failure event's details once closed: the crash it was part of (the id of the crash's failure closed
# first: failures that overlap are one crash, one rollback) and the most iterations that crash lost so far.
CRASH = "crash"
CRASH_LOST = "crash_iterations_lost"
CRASH_SINCE = "crash_detected_at"  # and the earliest detection among its failures so far
# A machine loss's detail: the commits its agent session's last heartbeat counted then (came_back).
COMMITTED_AT_LOSS = "committed_at_loss"


class OpenFailure(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def details(self) -> Mapping[str, Any]: ...


class RankHolder(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def last_heartbeat_at(self) -> datetime | None: ...


@dataclass(frozen=True)
class Progress:
    """A live machine's heartbeat summary, as far as its registered agent session sent it."""

    committed: int  # checkpoints committed in the session (the registration itself is none)
    restored: int | None = None  # the iteration its ranks restored (the oldest), FRESH_START, None: not said
    reached: int | None = None  # the newest iteration its ranks held when they restored (None: not said)


@dataclass(frozen=True)
class Resumed:
    event_id: int
    at: datetime  # the heartbeat that first showed a commit after the relaunch
    restored: int | None = None  # what the relaunched training restored (Progress.restored)
    reached: int | None = None  # the newest iteration it held then (Progress.reached)


def resumed_after_relaunch(
    events: Iterable[OpenFailure], holders: Mapping[int, RankHolder], progress: Mapping[int, Progress]
) -> list[Resumed]:
    """The open failures whose rank's machine (`holders`: the live machine of each rank) has committed a
    checkpoint since it was relaunched. A heartbeat after the relaunch carries the new session's summary,
    whose commit count (`progress`, per rank) counts that session's commits only."""
    resumed = []
    for event in events:
        since = parse_timestamp(event.details.get(RELAUNCHED_AT))
        rank = event.rank
        holder = holders.get(rank) if rank is not None else None
        if since is None or rank is None or holder is None or holder.state != "healthy":
            continue
        seen, now = holder.last_heartbeat_at, progress.get(rank, Progress(0))
        if seen is not None and seen > since and now.committed > 0:
            resumed.append(Resumed(event.id, seen, now.restored, now.reached))
    return resumed


def iterations(summary: Mapping[str, Any] | None, key: str, *, lowest: int = 0) -> list[int]:
    """The iterations of a heartbeat summary's rank -> iteration map `key`, those in lowest..INT32_MAX only
    (a summary sent through etcd reaches the root unvalidated)."""
    values = (summary or {}).get(key)
    if not isinstance(values, dict):
        return []
    return [v for v in values.values() if type(v) is int and lowest <= v <= INT32_MAX]


def came_back(
    events: Iterable[OpenFailure], holders: Mapping[int, RankHolder], progress: Mapping[int, Progress]
) -> list[Resumed]:
    """The open failures of machines declared lost while silent that were reinstated when their heartbeats
    resumed, with no relaunch, and whose training has committed since it was declared lost (the session's
    commits above COMMITTED_AT_LOSS): it went on, so nothing was restored and nothing rolled back. Each
    ends at the heartbeat that showed it. Heartbeats alone do not say it: they come from a thread of local
    rank 0's process, which may still be stuck in a collective that torchrun will restart. (The root's own
    recovery would have restarted the training; torchrun did not.)"""
    back = []
    for event in events:
        reinstated = event.details.get("reinstated")
        at = parse_timestamp(reinstated.get("at")) if isinstance(reinstated, dict) else None
        then = event.details.get(COMMITTED_AT_LOSS)
        holder = holders.get(event.rank) if event.rank is not None else None
        if at is None or type(then) is not int or RELAUNCHED_AT in event.details:
            continue
        if holder is None or holder.state != "healthy" or holder.last_heartbeat_at is None:
            continue
        now = progress.get(event.rank, Progress(0)) if event.rank is not None else Progress(0)
        if holder.last_heartbeat_at > at and now.committed > then:
            back.append(Resumed(event.id, holder.last_heartbeat_at))
    return back


def progress_of(summary: Mapping[str, Any] | None, session: str | None) -> Progress | None:
    """A machine's heartbeat summary as Progress; None where it is another agent session's than the one
    registered (an agent's last heartbeat that arrived after its successor registered). An agent too old to
    name its session in the summary is taken at its word."""
    summary = summary or {}
    sent_by = summary.get("session")
    if sent_by is not None and sent_by != session:
        return None
    committed = summary.get("committed")
    return Progress(
        committed if type(committed) is int and 0 <= committed <= INT32_MAX else 0,
        restored=min(iterations(summary, "restored", lowest=FRESH_START), default=None),
        reached=max(iterations(summary, "newest_at_restore", lowest=FRESH_START), default=None),
    )


def reached_iteration(summary: Mapping[str, Any] | None) -> int | None:
    """The newest iteration a machine's heartbeat summary says any of its ranks committed (None: none)."""
    return max(iterations(summary, "local"), default=None)


def newer(first: int | None, second: int | None) -> int | None:
    return second if first is None else first if second is None else max(first, second)


def rollback(reached: int | None, restored: int | None) -> tuple[str | None, int | None]:
    """The tier a relaunch restored from and the iterations it lost: `reached` was the newest iteration
    committed before it (None: unknown), `restored` what its training restored (FRESH_START: nothing, None:
    not said, as by a worker library from before the figure). A fresh start loses every iteration, the
    first included, as the root's planned restarts count it."""
    if restored is None:
        return None, None
    if restored == FRESH_START:
        return "none", None if reached is None else reached + 1
    return "local", None if reached is None else max(0, reached - restored)


@dataclass(frozen=True)
class Charged:
    """What the job's closed failures charged it: downtime from `since` (embedded mode: the crash's
    earliest detection; None: not known) until `until` (the last resume), and the rollback of the
    embedded-mode crash closed last (`crash`, see CRASH; None: the last recovery was orchestrated) up to
    `lost` iterations."""

    until: datetime | None = None
    crash: int | None = None
    lost: int = 0
    since: datetime | None = None


class ClosedFailure(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def detected_at(self) -> datetime: ...
    @property
    def iterations_lost(self) -> int | None: ...
    @property
    def details(self) -> Mapping[str, Any]: ...


def charged_by(last: Iterable[ClosedFailure], resumed_at: datetime | None) -> Charged:
    """What the failures that resumed training last (`last`, all closed at `resumed_at`) charged: their
    crash's largest rollback and earliest detection, whatever order they were closed in."""
    closed = list(last)
    if resumed_at is None or not closed:
        return Charged()
    crashes = [e for e in closed if CRASH in e.details]
    if not crashes:  # a recovery the root orchestrated: its time only
        return Charged(resumed_at)

    def lost(event: ClosedFailure) -> int:
        noted = event.details.get(CRASH_LOST)
        return noted if type(noted) is int else event.iterations_lost or 0

    newest = max(crashes, key=lambda e: (lost(e), e.id))
    crash = crash_of(newest.id, newest.details)
    members = [e for e in crashes if crash_of(e.id, e.details) == crash]
    noted = [parse_timestamp(e.details.get(CRASH_SINCE)) or e.detected_at for e in members]
    return Charged(resumed_at, crash, max(lost(e) for e in members), min(noted))


def crash_of(event_id: int, details: Mapping[str, Any]) -> int:
    """The crash a closed failure was part of (CRASH), the failure itself where none was recorded."""
    crash = details.get(CRASH)
    return crash if type(crash) is int else event_id
