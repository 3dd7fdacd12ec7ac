"""The root service's view of the outside world, each behind a Protocol: the cloud operator that replaces
machines (AWS Auto Scaling Group, or local agent processes) and the coordinator (etcd)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class JobInfo:
    id: uuid.UUID
    name: str
    num_machines: int
    launch: dict[str, Any] | None = None


@dataclass(frozen=True)
class MachineInfo:
    rank: int
    instance_id: str
    address: str


@dataclass(frozen=True)
class Replacement:
    """What the operator did. The new machine takes the rank when its agent registers."""

    instance_id: str | None  # the new machine's identity, when the operator knows it
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)


class CloudOperatorError(Exception):
    """The cloud refused or failed after retries; the recovery waits and tries again later."""


class ReplacementCancelled(Exception):
    """The replacement is no longer wanted (its machine was reinstated, or its rank already has a new
    holder): raised by `ReplacementJournal.record`, so the operator stops before its next cloud call."""


class ReplacementJournal:
    """Where a replacement records what it is about to do before doing it: the failure event's details
    (`replacement.intent`), so that a retry, or a new leader, reconciles from the record and the cloud's
    actual state instead of acting twice. `intent`: what earlier tries recorded ({} at first). `key`: the
    replacement's identity (its failure event), under which the operator claims the instances it hands out.
    This base keeps the record in memory (a replacement nobody resumes)."""

    def __init__(self, key: str | None = None, intent: dict[str, Any] | None = None):
        self.key = key if key is not None else uuid.uuid4().hex
        self.intent: dict[str, Any] = dict(intent or {})

    async def record(self, intent: dict[str, Any]) -> None:
        """Record `intent` before the cloud call it announces; raises ReplacementCancelled if the
        replacement is no longer wanted."""
        self.intent = dict(intent)


class CloudOperator(Protocol):
    name: str

    async def provision(self, job: JobInfo, worker_token: str) -> None:
        """Start the job's machines, when this operator starts them itself."""

    async def replace(
        self,
        job: JobInfo,
        failed: MachineInfo,
        bound_instances: set[str],
        journal: ReplacementJournal | None = None,
    ) -> Replacement:
        """Replace a failed machine; returns once the replacement exists (it registers on its own).
        `bound_instances`: instances not to hand out. Each cloud call is recorded in `journal` first, and a
        try with an intent recorded continues it from the cloud's actual state."""

    async def release(self, job: JobInfo) -> None:
        """The job ended: stop what this operator started for it."""
