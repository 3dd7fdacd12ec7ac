"""The worker surface (/api/v1/worker/jobs/{job}...): what a job's agents send and read. Defined in
worker_lib.api.worker, which the agent's client returns; the service reads them from here."""

from __future__ import annotations

from worker_lib.api.worker import (
    HANG_ERROR_TYPE,
    CheckpointSummary,
    DirectiveOut,
    ExitAck,
    ExitReport,
    HeartbeatConfig,
    HeartbeatRequest,
    HeartbeatResponse,
    Holding,
    InventoryReport,
    PersistedReport,
    PersistMissed,
    PersistSchedule,
    ProcessError,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
    Rendezvous,
    ReplicationAlignment,
)

__all__ = [
    "HANG_ERROR_TYPE",
    "CheckpointSummary",
    "DirectiveOut",
    "ExitAck",
    "ExitReport",
    "HeartbeatConfig",
    "HeartbeatRequest",
    "HeartbeatResponse",
    "Holding",
    "InventoryReport",
    "PersistMissed",
    "PersistSchedule",
    "PersistedReport",
    "ProcessError",
    "ProgressReport",
    "RegisterRequest",
    "RegisterResponse",
    "Rendezvous",
    "ReplicationAlignment",
]
