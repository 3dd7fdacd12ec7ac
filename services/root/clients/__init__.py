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


class CloudOperator(Protocol):
    name: str

    async def provision(self, job: JobInfo, worker_token: str) -> None:
        """Start the job's machines, when this operator starts them itself."""

    async def replace(self, job: JobInfo, failed: MachineInfo, bound_instances: set[str]) -> Replacement:
        """Replace a failed machine; returns once the replacement exists (it registers on its own)."""

    async def release(self, job: JobInfo) -> None:
        """The job ended: stop what this operator started for it."""
