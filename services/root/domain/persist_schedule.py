"""Which iteration every rank persists (pure): the root's persist schedule.

Left to themselves, ranks persist when their own commit lands on a multiple of K (persist_every). At scale
that gives no complete persisted checkpoint: an upload slower than K iterations makes a rank skip the next
multiple, a skipped save leaves a hole, and ranks end up with shards of different iterations. So the root
chooses one iteration for the whole job and announces it to every machine (the directive, and REST
heartbeat answers); every agent persists exactly that iteration for all its ranks. The next one is announced
only when the current one is complete (every rank's shard on the current timeline) or given up: a machine
reports that a rank of it cannot persist it any more (it was past it when it heard, and the copy is gone),
or a recovery (a newer plan generation) left it nothing to finish with.

A recovery does not give a target up by itself: a checkpoint of an iteration is the same bytes whatever
generation trains on from it, so shards of the target already uploaded stay valid as long as no generation
since the announcement resumed from before it (`recovery.on_timeline`). The target (with the generation it
was announced in: the copies the ranks hold and upload are that generation's commits) is kept when it is
still on the timeline and the ranks can still finish it: some already uploaded it, or the recovery restored
exactly that iteration (every rank holds it then). Otherwise (a rollback before it, or restored past it with
nothing uploaded: most ranks no longer hold it) a new one is chosen in the new generation. A job recovering
more often than a persist round takes would otherwise never complete a persisted checkpoint. The root
decides this when it releases the recovery's plan (no machine of the new generation reported anything
yet), so the target reaches the agents with the plan, before any rank restarts.

A new target is the first multiple of K past the newest iteration any machine reported, plus a lead that
covers how stale those reports are: the fastest rank's rate times the announcement's latency, so the
fastest rank has not yet committed the target when it hears of it. It is also strictly past the iteration
the current generation resumed from: that iteration's copies are an older generation's commits, which a
target of this generation would never find.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.root.domain.recovery import on_timeline
from worker_lib.api.shared import INT32_MAX, MAX_CHECKPOINTS_PER_MINUTE


@dataclass(frozen=True)
class PersistTarget:
    iteration: int  # the iteration every rank persists, a multiple of persist_every
    generation: int  # the plan generation it was announced in (its commits are the ones persisted)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def newest_reported(summaries: Iterable[Mapping[str, Any]]) -> int | None:
    """The newest iteration any rank of any machine reported committing (None: none reported yet)."""
    newest = None
    for summary in summaries:
        local = summary.get("local")
        for value in local.values() if isinstance(local, Mapping) else ():
            if (iteration := _count(value)) is not None and (newest is None or iteration > newest):
                newest = iteration
    return newest


def fastest_rate(summaries: Iterable[Mapping[str, Any]]) -> float | None:
    """The largest commits-per-minute any machine reported (at most what the API accepts: a summary stored
    before it was bounded must not announce an iteration beyond the database's columns)."""
    rates = [
        min(float(rate), MAX_CHECKPOINTS_PER_MINUTE)
        for s in summaries
        if isinstance(rate := s.get("per_minute"), int | float) and not isinstance(rate, bool) and rate > 0
    ]
    return max(rates) if rates and all(math.isfinite(r) for r in rates) else None


def lead_iterations(per_minute: float | None, latency_s: float) -> int:
    """Iterations the fastest rank may commit before an announcement reaches it."""
    if per_minute is None or latency_s <= 0:
        return 0
    return math.ceil(per_minute / 60.0 * latency_s)


def first_multiple_after(iteration: int | None, every: int) -> int:
    """The first positive multiple of `every` strictly above `iteration` (None: nothing committed yet)."""
    if every <= 0:
        raise ValueError(f"every must be positive, not {every}")
    return (max(iteration if iteration is not None else 0, 0) // every + 1) * every


def missed(summaries: Iterable[Mapping[str, Any]], target: PersistTarget) -> bool:
    """Whether a machine reports that one of its ranks cannot persist `target` (`persist_missed`)."""
    for summary in summaries:
        report = summary.get("persist_missed")
        if (
            isinstance(report, Mapping)
            and _count(report.get("iteration")) == target.iteration
            and _count(report.get("generation")) == target.generation
        ):
            return True
    return False


def on_timeline_of(
    current: PersistTarget, generation: int, resumed_from: Mapping[int, int | None] | None
) -> bool:
    """Whether `current`'s shards belong to the history of `generation`: no generation after the
    announcement's, up to `generation`, resumed from before it (unknown resume points: they did not)."""
    if current.generation == generation:
        return True
    if resumed_from is None or current.generation > generation:
        return False
    since = {g: start for g, start in resumed_from.items() if current.generation < g <= generation}
    return on_timeline(current.iteration, current.generation, since)


def carried_over(
    current: PersistTarget, generation: int, resumed_from: Mapping[int, int | None] | None, uploaded: int
) -> bool:
    """A target announced before a recovery that the ranks can still finish after it: on the timeline, and
    either some ranks uploaded it already or the recovery restored exactly it (every rank holds it)."""
    if current.generation == generation:
        return True
    if resumed_from is None or not on_timeline_of(current, generation, resumed_from):
        return False
    return uploaded > 0 or resumed_from.get(generation) == current.iteration


def given_up(
    current: PersistTarget,
    generation: int,
    summaries: Iterable[Mapping[str, Any]],
    resumed_from: Mapping[int, int | None] | None = None,
    uploaded: int = 0,
) -> bool:
    """A rank that cannot persist it, or a recovery since the announcement that left it nothing to finish
    with (`resumed_from`: each released generation's restored iteration, None: from scratch; `uploaded`:
    the ranks whose shard of it, of its generation, the root recorded)."""
    return not carried_over(current, generation, resumed_from, uploaded) or missed(summaries, current)


def next_target(
    current: PersistTarget | None,
    *,
    every: int,
    generation: int,
    summaries: Iterable[Mapping[str, Any]],
    latency_s: float,
    complete: bool = False,
    resumed_from: Mapping[int, int | None] | None = None,
    uploaded: int = 0,
    world_size: int | None = None,
    uploading: int = 0,
    kept: bool = False,
) -> PersistTarget | None:
    """The target to announce now: `current` while it is in progress, else a new one (None: the job has no
    persistent tier, or the next would be past what a report can name). `complete`: every rank persisted
    `current`. `resumed_from` and `uploaded`: see given_up (needed only once a recovery opened a generation
    newer than `current`'s); `uploaded` of `world_size` ranks is complete too: its last shard may have
    arrived while the recovery collected inventories, when its completion announced nothing. `uploading`:
    ranks whose upload of it is still in flight (a plan's inventories): they keep it like uploaded ones (the
    plan is released before slow uploads land), but complete nothing. `kept`: the release of
    `generation`'s plan kept `current` (those uploads counted then); from then on only its completion or a
    miss moves it on, not the same rule without them."""
    if every <= 0:
        return None
    if world_size is not None and uploaded >= world_size > 0:
        complete = True
    summaries = list(summaries)
    if current is not None and not complete:
        if kept:
            still = not missed(summaries, current)
        else:
            still = not given_up(current, generation, summaries, resumed_from, uploaded + uploading)
        if still:
            return current
    floors = [newest_reported(summaries)]
    if current is not None and on_timeline_of(current, generation, resumed_from):
        # Completed (or missed) in this history: its iteration was committed, whatever stale reports say.
        floors.append(current.iteration)
    if resumed_from is not None:
        # Never at or before the restore point: those copies are an older generation's commits.
        floors.append(resumed_from.get(generation))
    newest = max((f for f in floors if f is not None), default=None)
    lead = lead_iterations(fastest_rate(summaries), latency_s)
    iteration = first_multiple_after((newest or 0) + lead, every)
    if iteration > INT32_MAX:
        # No shard of it could be reported (iterations are 32-bit on the wire): a summary claiming an
        # absurd iteration would hold the schedule there for good. Announce nothing until it is sane.
        return None
    return PersistTarget(iteration, generation)
