"""One machine's share of its job's directive (pure).

A job's directive names every rank's restore source and every live machine's data plane: about a megabyte
at 1,000 machines x 8 processes. One machine's agent needs only its own ranks' sources (the plan's
iteration, restored from where the plan says) and the addresses of the machines that hold its
checkpoints (itself: whether its rank is still bound to it; the peers it replicates to: its placement
group in the group strategy, its m - 1 successors in a ring). `JobDirectiveIndex`
groups a job's sources and machines once per read of the job; `for_machine` is then O(P + group size).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Ranked(Protocol):
    @property
    def rank(self) -> int: ...


S = TypeVar("S", bound=Ranked)  # a rank's restore source (its global rank)
M = TypeVar("M", bound=Ranked)  # a machine (its machine rank)


def machine_of(global_rank: int, procs_per_machine: int) -> int:
    """The machine that runs a global rank (machine m runs ranks m*P .. m*P + P - 1)."""
    return global_rank // procs_per_machine


@dataclass(frozen=True)
class JobDirectiveIndex(Generic[S, M]):
    """A job's sources by the machine that runs their rank, and its machines by machine rank."""

    sources: dict[int, tuple[S, ...]]
    machines: dict[int, M]

    @classmethod
    def of(
        cls, sources: Sequence[S], machines: Sequence[M], procs_per_machine: int
    ) -> JobDirectiveIndex[S, M]:
        by_machine: dict[int, list[S]] = {}
        for source in sources:
            by_machine.setdefault(machine_of(source.rank, procs_per_machine), []).append(source)
        return cls(
            sources={machine: tuple(items) for machine, items in by_machine.items()},
            machines={machine.rank: machine for machine in machines},
        )

    def for_machine(self, machine: int, group: Collection[int]) -> tuple[list[S], list[M]]:
        """What machine `machine` needs: its own ranks' sources (in rank order) and the live machines among
        `group`, the machines it deals with (itself included, in machine order)."""
        sources = sorted(self.sources.get(machine, ()), key=lambda source: source.rank)
        members = sorted({*group, machine})
        return sources, [self.machines[member] for member in members if member in self.machines]
