"""The public surface (/api/v1/jobs...): what operators, the CLI and the pages send and read. Defined in
worker_lib.api.public, which the CLI's client returns; the service adds what only it computes: a
failure's recovery time, from the phases its pages show."""

from __future__ import annotations

from pydantic import model_validator

from services.root.domain.phases import is_finished, phases, recovery_seconds
from worker_lib.api import public
from worker_lib.api.public import (
    JOB_NAME_PATTERN,
    MAX_MACHINES,
    MAX_PROCS_PER_MACHINE,
    EttrOut,
    JobCreate,
    JobCreated,
    JobOut,
    JobPage,
    LaunchSpec,
    MachineOut,
    PersistedCheckpointOut,
    PersistedShardOut,
    RecoveryPlanOut,
)


class FailureOut(public.FailureOut):
    # The service computes recovery_s and the phases (the client model only reads them), with the one
    # computation the pages and /metrics use (domain.phases). The seconds stay unrounded: rounded here to
    # ms and then again for display, a 0.1052 s phase read 0.10 s here and 0.11 s on the failure page.
    @model_validator(mode="after")
    def _recovery_time(self) -> FailureOut:
        self.recovery_s = recovery_seconds(self)
        self.phases = [
            public.PhaseOut(name=p.name, start=p.start, end=p.end, seconds=p.seconds)
            for p in phases(self, finished=is_finished(self.state))
        ]
        return self


__all__ = [
    "JOB_NAME_PATTERN",
    "MAX_MACHINES",
    "MAX_PROCS_PER_MACHINE",
    "EttrOut",
    "FailureOut",
    "JobCreate",
    "JobCreated",
    "JobOut",
    "JobPage",
    "LaunchSpec",
    "MachineOut",
    "PersistedCheckpointOut",
    "PersistedShardOut",
    "RecoveryPlanOut",
]
