"""Recovery planning (pure): from what the machines hold and what was persisted, decide the iteration every
rank resumes from and where each rank gets it.

Rules (GEMINI, Section 6, made exact):
* One iteration for all ranks: the newest iteration for which every rank has an intact copy somewhere.
* Per rank, the fastest tier that has it: its own machine's memory (local), another live machine's
  memory (peer), the persistent tier. A whole lost placement group therefore sends every rank to the
  newest persisted checkpoint (ranks that still hold that iteration in memory read it from there).
* Copies found corrupt never count; copies not checked yet do (the restore verifies every stripe it reads
  and condemns a corrupt copy, so the next plan passes it over), a checked one preferred among peers. A
  persisted shard a restore found corrupt is condemned the same way (the next plan rolls back
  to an older persisted checkpoint rather than fail on the same object again). Only
  copies on the current timeline count: a checkpoint made before a rollback to an older iteration is a
  different history, even with the same iteration number.
* Nothing restorable: start from scratch, and say so.
* Uploads a live machine has in flight to the persistent tier are not copies yet; where they would make a
  newer iteration restorable, the decision names them (`waits_for`): the caller may wait a bounded time
  for them rather than roll every rank further back (a whole lost group's ranks uploaded an iteration
  that the survivors, who hold it only in their upload buffers, are still uploading).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

TierName = Literal["local", "peer", "persistent"]
TIER_ORDER: dict[TierName, int] = {"local": 0, "peer": 1, "persistent": 2}


@dataclass(frozen=True)
class MemoryCopy:
    """A committed checkpoint of `rank` held in CPU memory by `machine` (its own or a replica)."""

    rank: int
    iteration: int
    machine: int
    digest: str
    verified: bool | None  # None: not checked yet; False: found corrupt
    generation: int  # the plan generation whose training produced it


@dataclass(frozen=True)
class PersistedShard:
    rank: int
    iteration: int
    location: str
    digest: str
    generation: int
    condemned: bool = False  # a restore found it failing its checksums


@dataclass(frozen=True)
class UploadInFlight:
    """`machine` is uploading `rank`'s checkpoint of `iteration` (made in `generation`) to the persistent
    tier: not restorable until the root hears it arrived."""

    rank: int
    iteration: int
    generation: int
    machine: int


@dataclass(frozen=True)
class Source:
    rank: int
    tier: TierName
    machine: int | None = None  # where to read it from (local and peer tiers)
    location: str | None = None  # persistent tier
    digest: str | None = None


@dataclass(frozen=True)
class RecoveryDecision:
    iteration: int | None  # None: start from scratch
    sources: tuple[Source, ...]
    reason: str
    iterations_lost: int | None
    # Uploads in flight that would make a newer iteration restorable once they arrive: that iteration's.
    waits_for: tuple[UploadInFlight, ...] = ()

    @property
    def slowest_tier(self) -> TierName | None:
        if not self.sources:
            return None
        return max((s.tier for s in self.sources), key=TIER_ORDER.__getitem__)


def on_timeline(iteration: int, generation: int, resumed_from: Mapping[int, int | None]) -> bool:
    """Whether a checkpoint of `iteration` made in `generation` belongs to the current history: no later
    generation rolled back to before it. `resumed_from` maps each generation to the iteration it resumed
    from (None: from scratch)."""
    for later, start in resumed_from.items():
        if later > generation and (start is None or start < iteration):
            return False
    return True


def plan_recovery(
    *,
    world_size: int,
    procs_per_machine: int,
    live_machines: Iterable[int],
    copies: Iterable[MemoryCopy],
    persisted: Iterable[PersistedShard],
    resumed_from: Mapping[int, int | None],
    reached: int | None,
    uploading: Iterable[UploadInFlight] = (),
) -> RecoveryDecision:
    """Decide the iteration and the per-rank sources of a recovery.

    `live_machines` are the machines that will take part (survivors and replacements); `reached` is the
    newest iteration any rank committed before the failure (for the iterations-lost count); `uploading`:
    the uploads those machines have in flight (see `RecoveryDecision.waits_for`).
    """
    live = set(live_machines)
    usable = [
        c
        for c in copies
        if c.verified is not False
        and c.machine in live
        and 0 <= c.rank < world_size
        and on_timeline(c.iteration, c.generation, resumed_from)
    ]
    shards = [
        s
        for s in persisted
        if not s.condemned
        and 0 <= s.rank < world_size
        and on_timeline(s.iteration, s.generation, resumed_from)
    ]
    in_memory: dict[tuple[int, int], list[MemoryCopy]] = {}
    for copy in usable:
        in_memory.setdefault((copy.rank, copy.iteration), []).append(copy)
    on_disk = {(s.rank, s.iteration): s for s in shards}
    decision = _newest_restorable(world_size, procs_per_machine, in_memory, on_disk, reached)
    arriving = {
        (u.rank, u.iteration): u
        for u in uploading
        if u.machine in live
        and 0 <= u.rank < world_size
        and u.rank // procs_per_machine == u.machine  # an agent uploads only its own ranks
        and (u.rank, u.iteration) not in on_disk
        and on_timeline(u.iteration, u.generation, resumed_from)
    }
    if not arriving:
        return decision
    hoped_for = {
        **{key: PersistedShard(u.rank, u.iteration, "", "", u.generation) for key, u in arriving.items()},
        **on_disk,
    }
    newer = _newest_restorable(world_size, procs_per_machine, in_memory, hoped_for, reached)
    if newer.iteration is None or (decision.iteration is not None and newer.iteration <= decision.iteration):
        return decision
    waits_for = tuple(
        arriving[(s.rank, newer.iteration)]
        for s in newer.sources
        if s.tier == "persistent" and (s.rank, newer.iteration) in arriving
    )
    return dataclasses.replace(decision, waits_for=waits_for)


def _newest_restorable(
    world_size: int,
    procs_per_machine: int,
    in_memory: Mapping[tuple[int, int], list[MemoryCopy]],
    on_disk: Mapping[tuple[int, int], PersistedShard],
    reached: int | None,
) -> RecoveryDecision:
    candidates = sorted({i for _, i in in_memory} | {i for _, i in on_disk}, reverse=True)
    for iteration in candidates:
        sources = _sources_for(iteration, world_size, procs_per_machine, in_memory, on_disk)
        if sources is not None:
            lost = None if reached is None else max(0, reached - iteration)
            tiers = Counter(s.tier for s in sources)
            summary = ", ".join(f"{count} {tier}" for tier, count in sorted(tiers.items(), key=_tier_key))
            return RecoveryDecision(
                iteration, sources, f"iteration {iteration}: every rank has an intact copy ({summary})", lost
            )
    newest = candidates[0] if candidates else None
    reason = (
        "no checkpoint of any iteration is complete for every rank"
        + (f" (newest partial: {newest})" if newest is not None else "")
        + ": restarting from scratch"
    )
    return RecoveryDecision(None, (), reason, reached + 1 if reached is not None else None)


def _sources_for(
    iteration: int,
    world_size: int,
    procs_per_machine: int,
    in_memory: Mapping[tuple[int, int], list[MemoryCopy]],
    on_disk: Mapping[tuple[int, int], PersistedShard],
) -> tuple[Source, ...] | None:
    fetches_from: Counter[int] = Counter()  # spread peer fetches over the holders
    sources = []
    for rank in range(world_size):
        home = rank // procs_per_machine
        copies = in_memory.get((rank, iteration), [])
        own = next((c for c in copies if c.machine == home), None)
        if own is not None:
            sources.append(Source(rank, "local", machine=home, digest=own.digest))
            continue
        if copies:
            peer = min(copies, key=lambda c: (c.verified is not True, fetches_from[c.machine], c.machine))
            fetches_from[peer.machine] += 1
            sources.append(Source(rank, "peer", machine=peer.machine, digest=peer.digest))
            continue
        shard = on_disk.get((rank, iteration))
        if shard is None:
            return None
        sources.append(Source(rank, "persistent", location=shard.location, digest=shard.digest))
    return tuple(sources)


def _tier_key(item: tuple[TierName, int]) -> int:
    return TIER_ORDER[item[0]]
