"""Embedded (torchrun) mode: torchrun, not the root, restarts the training, and the root records each failure
and closes it once the rank's machine trains again.

A relaunched machine registers again with a new session (`relaunched_at` on its open failures, or a failure
of its own when none was open: a relaunch faster than the heartbeat timeout, or a one-machine job, which is
never declared lost on its silence alone). The failure is recovered at the first heartbeat after the relaunch
that shows a commit: the relaunched training restored its checkpoint and completed an iteration.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from services.root.domain.phases import parse_timestamp

RELAUNCHED_AT = "relaunched_at"  # the failure event's detail: when the rank's machine registered again


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
class Resumed:
    event_id: int
    at: datetime  # the heartbeat that first showed a commit after the relaunch


def resumed_after_relaunch(
    events: Iterable[OpenFailure], holders: Mapping[int, RankHolder], committed: Mapping[int, int]
) -> list[Resumed]:
    """The open failures whose rank's machine (`holders`: the live machine of each rank) has committed a
    checkpoint since it was relaunched. A heartbeat after the relaunch carries the new session's summary,
    whose commit count (`committed`, per rank) counts that session's commits only (the registration itself
    does not count as one)."""
    resumed = []
    for event in events:
        since = parse_timestamp(event.details.get(RELAUNCHED_AT))
        rank = event.rank
        holder = holders.get(rank) if rank is not None else None
        if since is None or rank is None or holder is None or holder.state != "healthy":
            continue
        seen = holder.last_heartbeat_at
        if seen is not None and seen > since and committed.get(rank, 0) > 0:
            resumed.append(Resumed(event.id, seen))
    return resumed
