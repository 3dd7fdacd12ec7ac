"""Persisted checkpoints as the root sees them: which ranks a machine may report, and where each shard
is. Every key and location is computed here from (prefix, job, iteration, rank, generation), with the
layout the agent uploads to (`worker_lib.persistent_keys`); nothing a worker names is stored."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from worker_lib.persistent_keys import iteration_prefix, rank_prefix, shard_key


@dataclass(frozen=True)
class Tier:
    """The persistent tier the root describes to agents (schemas.PersistentTier)."""

    kind: str  # "s3" or "local"
    prefix: str
    bucket: str | None = None
    path: str | None = None


def hosted_ranks(machine_rank: int, procs_per_machine: int) -> range:
    """The global ranks whose training processes machine `machine_rank` runs (the launcher's mapping:
    rank = machine_rank * procs_per_machine + local_rank)."""
    first = machine_rank * procs_per_machine
    return range(first, first + procs_per_machine)


def shard_of(tier: Tier, job_id: str, iteration: int, rank: int, generation: int) -> str:
    return shard_key(tier.prefix, job_id, iteration, rank, generation)


def checkpoint_location(tier: Tier, job_id: str, iteration: int) -> str:
    """The URI of one persisted checkpoint (every rank's shards), as the stores name it."""
    key = iteration_prefix(tier.prefix, job_id, iteration)
    if tier.kind == "s3":
        return f"s3://{tier.bucket}/{key}"
    return f"file://{(tier.path or '').rstrip('/')}/{key}"


def expired_prefixes(tier: Tier, job_id: str, iteration: int, ranks: Iterable[int]) -> list[str]:
    """What to delete for an expired checkpoint: each recorded rank's shards of the iteration, every
    generation's. Computed, never read back from a stored key: a key recorded before the root computed
    them could name anything."""
    return [rank_prefix(tier.prefix, job_id, iteration, rank) for rank in sorted(set(ranks))]
