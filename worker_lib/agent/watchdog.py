"""The hang watchdog: a training process that stopped committing checkpoints is stopped, so the job recovers.

A process stuck in a collective (a peer that hangs or is cut off), a deadlocked data loader or an endless
loop stays alive: no exit, heartbeats fine, nothing recorded until torch's collective timeout (30 minutes
for gloo by default), and forever outside a collective. Castor sees every commit of every local rank, so a
rank whose commits stop for much longer than its iterations ever took is hung. The agent then asks the
process for its Python stacks (faulthandler, SIGUSR1), kills it, and reports the exit with a `Hung` error
that carries the stacks: the root records a failure and recovers from memory as for any crash.

Pure bookkeeping; the agent (agent.py) feeds it commits and the clock, and acts on what it reports.
A rank is watched from its first commit of a generation on: the restore, the first iteration and its
compilation may take much longer than later ones, and a rank that never commits is not told apart here from
one that is still starting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

AUTO = "auto"
# "auto": the limit is FACTOR x the longest gap between two of the rank's commits this generation, and at
# least FLOOR_S: an evaluation pass or a slow persist between two saves must not pass for a hang.
AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 300.0


@dataclass(frozen=True)
class HangPolicy:
    """`timeout_s`: a fixed limit in seconds; None: auto (see above); 0: no watchdog."""

    timeout_s: float | None = None
    factor: float = AUTO_FACTOR
    floor_s: float = AUTO_FLOOR_S

    @property
    def enabled(self) -> bool:
        return self.timeout_s is None or self.timeout_s > 0

    def limit_s(self, longest_gap_s: float) -> float:
        if self.timeout_s is not None:
            return self.timeout_s if self.timeout_s > 0 else math.inf
        return max(self.floor_s, self.factor * longest_gap_s)

    @classmethod
    def parse(cls, text: str) -> HangPolicy:
        """`auto`, `0` (off) or a number of seconds, as the agent's --hang-timeout takes it."""
        text = text.strip().lower()
        if text == AUTO:
            return cls()
        try:
            seconds = float(text)
        except ValueError:
            raise ValueError(f"hang timeout {text!r}: give 'auto', 0 (off) or a number of seconds") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"hang timeout {text!r}: give 'auto', 0 (off) or a number of seconds >= 0")
        return cls(timeout_s=seconds)


@dataclass(frozen=True)
class Overdue:
    rank: int
    silent_s: float  # since the rank's last commit
    limit_s: float
    iteration: int  # the last iteration it committed

    def describe(self) -> str:
        return (
            f"rank {self.rank} committed no checkpoint for {self.silent_s:.0f} s after iteration "
            f"{self.iteration} (hang limit {self.limit_s:.0f} s): the hang watchdog stopped it"
        )


@dataclass
class _Rank:
    last_commit: float
    iteration: int
    longest_gap_s: float = 0.0


@dataclass
class HangWatch:
    """One generation's local ranks: when each last committed, and the longest gap between its commits."""

    policy: HangPolicy
    generation: int
    _ranks: dict[int, _Rank] = field(default_factory=dict)
    _reported: set[int] = field(default_factory=set)

    def committed(self, rank: int, iteration: int, now: float) -> None:
        seen = self._ranks.get(rank)
        if seen is None:
            self._ranks[rank] = _Rank(now, iteration)
            return
        seen.longest_gap_s = max(seen.longest_gap_s, now - seen.last_commit)
        seen.last_commit, seen.iteration = now, iteration
        self._reported.discard(rank)  # it moved again: a later stall is a new one

    def overdue(self, now: float) -> list[Overdue]:
        """Ranks silent past their limit, each reported once per stall."""
        if not self.policy.enabled:
            return []
        found = []
        for rank, seen in sorted(self._ranks.items()):
            limit = self.policy.limit_s(seen.longest_gap_s)
            silent = now - seen.last_commit
            if silent > limit and rank not in self._reported:
                self._reported.add(rank)
                found.append(Overdue(rank, silent, limit, seen.iteration))
        return found

    def next_check_in(self, now: float) -> float:
        """Seconds until the earliest rank could become overdue (at most 1 s, so new commits count)."""
        if not self.policy.enabled or not self._ranks:
            return 1.0
        due = min(
            seen.last_commit + self.policy.limit_s(seen.longest_gap_s) - now for seen in self._ranks.values()
        )
        return min(1.0, max(0.05, due))
