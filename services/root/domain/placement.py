"""Checkpoint placement across machines (GEMINI, Section 4) and its failure-recovery probability.

Every machine keeps its own checkpoint in local CPU memory and sends m-1 replicas to peers, so a rank's
checkpoint lives on m machines (the local copy counts). The paper's placement:

* group strategy (m divides N): machines 0..N-1 form N/m groups of m consecutive machines; every member
  sends to the other m-1 members of its group. Optimal (Theorem 1).
* mixed strategy (otherwise): the first floor(N/m)-1 groups as above; the last m + (N mod m) machines form
  a ring in which each machine sends to the next m-1 machines. Near-optimal, minimal traffic.
* ring strategy: all N machines form one ring; kept only for comparison (the paper's baseline).

A training job can recover from CPU memory after k simultaneous machine failures iff no rank lost every
machine holding its checkpoint. `recovery_probability` counts exactly the failure sets that avoid this, per
disjoint block of machines, with a generating polynomial; it never enumerates subsets, so it is fast for N
in the thousands. (Brute-force enumeration is the test oracle.)
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from math import comb
from typing import Literal

BlockKind = Literal["group", "ring"]
StrategyName = Literal["group", "mixed", "ring"]
StrategyRequest = Literal["auto", "group", "mixed", "ring"]


@dataclass(frozen=True)
class PlacementGroup:
    """A block of consecutive machines that replicate among themselves.

    In a "group" block every member holds every member's checkpoint. In a "ring" block member i (by
    position in `members`) holds its own checkpoint and those of the m-1 members before it.
    """

    index: int
    kind: BlockKind
    members: tuple[int, ...]

    def holders_of(self, rank: int, replicas: int) -> tuple[int, ...]:
        """Machines holding `rank`'s checkpoint, the rank itself first."""
        if self.kind == "group" or len(self.members) <= replicas:
            return (rank, *(m for m in self.members if m != rank))
        pos = self.members.index(rank)
        size = len(self.members)
        return tuple(self.members[(pos + step) % size] for step in range(replicas))


@dataclass(frozen=True)
class Placement:
    """Where each rank's checkpoint is replicated. Machines are numbered 0..N-1 (the machine rank)."""

    strategy: StrategyName
    num_machines: int
    replicas: int
    groups: tuple[PlacementGroup, ...]

    @cached_property
    def _group_of(self) -> dict[int, PlacementGroup]:
        return {member: group for group in self.groups for member in group.members}

    def group_of(self, rank: int) -> PlacementGroup:
        self._check_rank(rank)
        return self._group_of[rank]

    def holders(self, rank: int) -> tuple[int, ...]:
        """Machines that hold `rank`'s checkpoint (its own machine first): m of them."""
        return self.group_of(rank).holders_of(rank, self.replicas)

    def sends_to(self, rank: int) -> tuple[int, ...]:
        """The m-1 peers that receive a replica of `rank`'s checkpoint."""
        return self.holders(rank)[1:]

    def held_by(self, machine: int) -> tuple[int, ...]:
        """Ranks whose checkpoint `machine` holds, its own first (local copy, then replicas)."""
        group = self.group_of(machine)
        peers = tuple(r for r in group.members if r != machine and machine in self.holders(r))
        return (machine, *peers)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_machines:
            raise ValueError(f"machine rank {rank} is outside 0..{self.num_machines - 1}")


def plan_placement(num_machines: int, replicas: int, strategy: StrategyRequest = "auto") -> Placement:
    """Place m replicas of every machine's checkpoint on N machines (paper Algorithm 1).

    "auto" picks the paper's choice: group when m divides N, mixed otherwise.
    """
    _validate(num_machines, replicas)
    n, m = num_machines, replicas
    if strategy == "auto":
        strategy = "group" if n % m == 0 else "mixed"
    if strategy == "group" and n % m:
        raise ValueError(f"group placement needs m to divide N (N={n}, m={m}); use mixed")
    if strategy == "ring":
        return Placement("ring", n, m, (PlacementGroup(0, "ring", tuple(range(n))),))

    full_groups = n // m if strategy == "group" else n // m - 1
    groups = [PlacementGroup(i, "group", tuple(range(i * m, (i + 1) * m))) for i in range(full_groups)]
    if strategy == "mixed":
        groups.append(PlacementGroup(full_groups, "ring", tuple(range(full_groups * m, n))))
    return Placement(strategy, n, m, tuple(groups))


def recovery_probability(placement: Placement, failures: int) -> float:
    """Exact probability that training recovers from CPU memory when `failures` machines, chosen uniformly
    at random, fail at the same time.

    Blocks are disjoint, so the number of survivable failure sets is the coefficient of x^k in the product
    of each block's polynomial sum_j (survivable j-failure subsets of the block) x^j.
    """
    n, k = placement.num_machines, failures
    if not 0 <= k <= n:
        raise ValueError(f"failures must be between 0 and N={n}, got {k}")
    product = [1] + [0] * k
    for group in placement.groups:
        block = _survivable_counts(group, placement.replicas, k)
        product = [
            sum(product[i] * block[j - i] for i in range(j + 1) if j - i < len(block)) for j in range(k + 1)
        ]
    return float(Fraction(product[k], comb(n, k)))


def recovery_probabilities(placement: Placement, max_failures: int = 4) -> dict[int, float]:
    """`recovery_probability` for k = 1..max_failures (capped at N)."""
    return {
        k: recovery_probability(placement, k) for k in range(1, min(max_failures, placement.num_machines) + 1)
    }


def paper_recovery_bound(num_machines: int, replicas: int, failures: int) -> float:
    """Corollary 1 of the paper for the group strategy: exact for k < 2m, a lower bound beyond."""
    n, m, k = num_machines, replicas, failures
    if k < m:
        return 1.0
    return max(0.0, 1 - n * comb(n - m, k - m) / (m * comb(n, k)))


def _survivable_counts(group: PlacementGroup, replicas: int, max_failures: int) -> list[int]:
    """For j = 0..max_failures: how many j-subsets of the block leave every member's checkpoint alive."""
    size = len(group.members)
    top = min(size, max_failures)
    if group.kind == "group" or size <= replicas:
        # A group only loses checkpoints when all of its members fail.
        return [comb(size, j) if j < size else 0 for j in range(top + 1)]
    return [_cyclic_without_run(size, j, replicas) for j in range(top + 1)]


def _cyclic_without_run(length: int, ones: int, run: int) -> int:
    """Binary strings on a cycle of `length` positions with `ones` ones and no `run` cyclically
    consecutive ones (a ring member's checkpoint is lost iff its window of m holders all failed)."""
    if ones == length:
        return 1 if length < run else 0
    total = 0
    # Split at the first and the last zero: `lead` ones before the first zero and `trail` ones after the
    # last one wrap around and form one run, so lead + trail < run.
    for lead in range(min(run - 1, ones) + 1):
        for trail in range(min(run - 1 - lead, ones - lead) + 1):
            middle = length - lead - trail  # from the first zero to the last zero, both included
            rest = ones - lead - trail
            if middle == 1:
                total += 1 if rest == 0 else 0
            else:
                total += _linear_without_run(middle - 2, rest, run)
    return total


def _linear_without_run(length: int, ones: int, run: int) -> int:
    """Binary strings of `length` with `ones` ones and no `run` consecutive ones: distribute the ones into
    the zeros+1 gaps with at most run-1 per gap (inclusion-exclusion over the overfull gaps)."""
    zeros = length - ones
    if ones < 0 or zeros < 0:
        return 0
    gaps = zeros + 1
    total = 0
    for overfull in range(min(gaps, ones // run) + 1):
        remaining = ones - overfull * run
        total += (-1) ** overfull * comb(gaps, overfull) * comb(remaining + gaps - 1, gaps - 1)
    return total


def _validate(num_machines: int, replicas: int) -> None:
    if num_machines < 1:
        raise ValueError(f"a job needs at least one machine, got N={num_machines}")
    if replicas < 1:
        raise ValueError(f"replicas m counts the local copy and must be at least 1, got m={replicas}")
    if replicas > num_machines:
        raise ValueError(f"replicas m={replicas} cannot exceed the number of machines N={num_machines}")
