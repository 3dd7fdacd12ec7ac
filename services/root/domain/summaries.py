"""A heartbeat's checkpoint summary, confined to what its machine can know.

A machine commits checkpoints only of the ranks it runs (`persisted.hosted_ranks`: the launcher's mapping,
and torchrun's for the same number of processes per machine) and holds replicas only of other machines'
ranks. A summary that claims more (a confused agent, one configured for another job's shape) would move
the job's newest iteration and the iteration every rank persists next, or hide it: the counters take the
newest iteration of every rank from whichever machine claims the highest. Those entries are dropped, and
the rest of the summary stands."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.root.domain.persisted import hosted_ranks

# rank -> value maps of the machine's own training processes.
OWN_RANK_MAPS = ("local", "restored", "newest_at_restore", "stalled_s", "save_calls")
# rank -> value maps of other machines' ranks.
PEER_RANK_MAPS = ("replicas",)


def confined_to_machine(
    summary: Mapping[str, Any], machine_rank: int, procs_per_machine: int, world_size: int
) -> tuple[dict[str, Any], list[int]]:
    """`summary` (a validated CheckpointSummary as JSON: rank keys are strings of digits) without the entries
    its machine cannot hold, and the ranks it named that way (sorted, each once)."""
    hosted = hosted_ranks(machine_rank, procs_per_machine)
    confined = dict(summary)
    dropped: set[int] = set()
    for key in OWN_RANK_MAPS + PEER_RANK_MAPS:
        values = summary.get(key)
        if not isinstance(values, Mapping):
            continue
        own = key in OWN_RANK_MAPS
        kept = {}
        for rank, value in values.items():
            if (int(rank) in hosted) == own and 0 <= int(rank) < world_size:
                kept[rank] = value
            else:
                dropped.add(int(rank))
        if len(kept) < len(values):
            confined[key] = kept
    return confined, sorted(dropped)
