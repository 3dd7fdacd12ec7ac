"""Retention of persisted checkpoints (pure): which ones to delete when a job keeps the newest `keep`.

A checkpoint counts as complete only when every rank has a shard on the current timeline (see
`recovery.on_timeline`). After a rollback, shards from the abandoned history keep their iteration numbers
until the new history persists those iterations again; counted as complete, they would take the places
of the checkpoints a recovery can actually use, and the one a recovery just rolled back to could go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.root.domain.recovery import on_timeline


@dataclass(frozen=True)
class StoredCheckpoint:
    iteration: int  # one checkpoint per iteration and job
    shard_generations: Mapping[int, int]  # rank -> generation of the training that wrote its shard


def is_complete(
    checkpoint: StoredCheckpoint, *, world_size: int, resumed_from: Mapping[int, int | None]
) -> bool:
    """Every rank has a shard of it on the current timeline."""
    return all(
        rank in checkpoint.shard_generations
        and on_timeline(checkpoint.iteration, checkpoint.shard_generations[rank], resumed_from)
        for rank in range(world_size)
    )


def is_complete_counted(
    iteration: int,
    *,
    shards: int,
    generations: Iterable[int],
    world_size: int,
    resumed_from: Mapping[int, int | None],
) -> bool:
    """is_complete from a count of the checkpoint's shards and the generations that wrote them: a rank has
    at most one shard of a checkpoint, so every rank has one on the current timeline when there are
    `world_size` and every generation among them is on it."""
    return shards == world_size and all(on_timeline(iteration, g, resumed_from) for g in generations)


def expired(
    checkpoints: Sequence[StoredCheckpoint],
    *,
    world_size: int,
    keep: int,
    resumed_from: Mapping[int, int | None],
) -> list[StoredCheckpoint]:
    """The checkpoints to delete: complete ones beyond the newest `keep`, and every other one (partial, or
    left from an abandoned history) older than the oldest kept. Newer partial ones are uploads in progress."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")

    def complete(checkpoint: StoredCheckpoint) -> bool:
        return is_complete(checkpoint, world_size=world_size, resumed_from=resumed_from)

    newest_first = sorted(checkpoints, key=lambda c: c.iteration, reverse=True)
    kept = [c for c in newest_first if complete(c)][:keep]
    if not kept:
        return []
    oldest_kept = kept[-1].iteration
    return [c for c in newest_first if c not in kept and (complete(c) or c.iteration < oldest_kept)]
