"""The public surface of the root's REST API (/api/v1/jobs...): what operators, the CLI and the pages
send and read, with the admin token."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from worker_lib.api.shared import (
    INT32_MAX,
    INT64_MAX,
    PlanSource,
    Text,
    readable_json,
)

JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"


# Hard ceilings of the schema; the service's own, lower limit on machines is a setting
# (CASTOR_MAX_MACHINES_PER_JOB), checked when a job is created.
MAX_MACHINES = 100_000


MAX_PROCS_PER_MACHINE = 64
MAX_REPLICAS = 16


def _env_name(name: str) -> str:
    # The processes would fail to start with any of these (os.execve refuses them), long after the 201.
    if not name or "=" in name:
        raise ValueError(f"{name!r} is not an environment variable name (empty, or contains '=')")
    return name


EnvName = Annotated[Text, AfterValidator(_env_name)]


class LaunchSpec(BaseModel):
    """How the local cloud operator starts a machine of this job: `castor agent ... -- <command>`."""

    model_config = ConfigDict(extra="forbid")

    command: list[Text] = Field(
        min_length=1, description='The training command, e.g. ["python", "train.py"].'
    )
    cwd: Text | None = Field(
        None, max_length=4096, description="Working directory of the training processes."
    )
    env: dict[EnvName, Text] = Field(default_factory=dict, description="Extra environment variables.")
    warm_start: bool = Field(
        True,
        description="Start (and restart) training processes from warm interpreters with torch already "
        "imported, when the command's interpreter is provably the agent's own (same executable, prefix "
        "and startup environment). False: every start is a cold start of the command as given.",
    )


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=JOB_NAME_PATTERN, description="Unique name: letters, digits, '.', '_', '-'.")
    machines: int = Field(
        strict=True,
        ge=1,
        le=MAX_MACHINES,
        description="Number of machines N; at most the service's CASTOR_MAX_MACHINES_PER_JOB (default "
        "4096), and CASTOR_LOCAL_MAX_MACHINES (default 64) with a launch spec.",
    )
    replicas: int = Field(
        2,
        strict=True,
        ge=1,
        le=MAX_REPLICAS,
        description="Copies of each checkpoint m, the local one included.",
    )
    procs_per_machine: int = Field(
        1, strict=True, ge=1, le=MAX_PROCS_PER_MACHINE, description="Training processes per machine."
    )
    persist_every: int = Field(
        100,
        strict=True,
        ge=0,
        le=INT32_MAX,
        description="Upload to the persistent tier every K iterations; 0 disables it.",
    )
    keep_persisted: int = Field(
        3, strict=True, ge=1, le=1000, description="Persisted checkpoints kept per job."
    )
    checkpoint_bytes_max: int | None = Field(
        None,
        strict=True,
        ge=1,
        le=INT64_MAX,
        description="The most bytes one rank's checkpoint may take (its data region). Each agent checks at "
        "registration that its shared memory holds two slots of it for each of its own ranks and of the "
        "ranks whose replicas the placement puts on it, and refuses larger checkpoints from peers. Default: "
        "each agent allows an equal share of its free shared memory per rank.",
    )
    placement: Literal["auto", "group", "mixed", "ring"] = Field(
        "auto", description="auto: group when m divides N, mixed otherwise (the paper's choice)."
    )
    replication_policy: Literal["interleaved", "eager"] = Field(
        "interleaved",
        description="interleaved: agents send checkpoint chunks to peers only inside the idle spans of "
        "training's own communication, measured in the training processes (GEMINI's Algorithm 2), spreading "
        "a checkpoint over several iterations when it does not fit in one; eager: as fast as the link "
        "allows.",
    )
    replication_bandwidth_gbps: float | None = Field(
        None,
        strict=True,
        gt=0,
        le=10_000,
        description="Optional cap on each agent's replication traffic, in Gbit/s (both policies); null: "
        "none.",
    )
    launch: LaunchSpec | None = Field(
        None,
        description="Local cloud operator only: start the job's machines as agent processes on the root's "
        "host, and start a fresh one to replace a failed machine. Without it, machines are started "
        "outside Castor (an Auto Scaling Group's boot script, or by hand).",
    )

    @model_validator(mode="after")
    def _replicas_fit(self) -> JobCreate:
        if self.replicas > self.machines:
            raise ValueError(f"replicas ({self.replicas}) cannot exceed machines ({self.machines})")
        if self.placement == "group" and self.machines % self.replicas:
            raise ValueError("group placement needs replicas to divide machines; use auto or mixed")
        return self


class EttrOut(BaseModel):
    """The job's measured effective training time ratio since it started (README: "Planning a cluster")."""

    ettr: float | None = Field(description="Productive time / wall time since the job started; null before.")
    wall_s: float = Field(description="Since the job started (to its end, or now).")
    productive_s: float = Field(description="Wall time less the wasted time below.")
    detection_s: float = Field(description="Downtime detecting and classifying failures.")
    replacement_s: float = Field(description="Downtime waiting for replacement machines.")
    restore_s: float = Field(description="Downtime restoring checkpoints (inventories, plan, fetches).")
    warmup_s: float = Field(description="Downtime restarting training, less the first iteration (kept work).")
    lost_iterations_s: float = Field(description="Iterations rolled back, at the measured iteration time.")
    checkpoint_overhead_s: float | None = Field(
        description="Checkpoint stalls: seconds the training threads were blocked in Castor (save() calls, "
        "waits for a copy), the slowest rank's, less those of iterations rolled back (in lost_iterations_s); "
        "null: not measured (no agent reported it)."
    )
    iteration_s: float | None = Field(description="Iteration time used (from the checkpoint frequency).")


class JobOut(BaseModel):
    id: uuid.UUID
    name: str
    state: str
    machines: int
    replicas: int
    procs_per_machine: int
    persist_every: int
    keep_persisted: int
    checkpoint_bytes_max: int | None
    placement_strategy: str
    replication_policy: str = Field("interleaved", description="interleaved or eager (JobCreate).")
    replication_bandwidth_gbps: float | None = Field(
        None, description="Replication cap in Gbit/s; null: none."
    )
    machines_healthy: int
    newest_iteration: int | None
    checkpoints_committed: int
    checkpoints_skipped: int
    checkpoints_per_minute: float | None
    replicated_iteration: int | None = Field(
        None, description="The newest iteration every machine fully replicated to its placement peers."
    )
    replication_interval: int | None = Field(
        None,
        description="Achieved replication interval: iterations between fully replicated checkpoints (the "
        "largest over the machines). Grows when a checkpoint takes longer than an iteration to send.",
    )
    replication_lag: int | None = Field(
        None,
        description="Iterations the newest fully replicated checkpoint lags the newest commit "
        "(worst machine).",
    )
    replication_state: Literal["ok", "stalled"] | None = Field(
        None,
        description="'stalled': replication stopped advancing (the lag is past 4 intervals and 20 "
        "iterations); null: nothing replicates (m = 1) or nothing reported yet.",
    )
    failures: int
    wasted_time_s: float
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    ettr: EttrOut | None = Field(None, description="Measured effective training time ratio and its parts.")


class JobCreated(JobOut):
    worker_token: str = Field(description="Bearer token for this job's agents; shown once, stored hashed.")


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class MachineOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    rank: int
    instance_id: str
    hostname: str
    address: str
    data_port: int
    state: str
    registered_at: datetime
    last_heartbeat_at: datetime | None
    summary: dict[str, Any]

    @field_validator("summary", mode="before")
    @classmethod
    def _readable_summary(cls, value: Any) -> Any:
        return readable_json(value)


class PhaseOut(BaseModel):
    """One phase of a failure's recovery (detect, classify, replace, restore, resume), as the pages show."""

    name: str
    start: datetime
    end: datetime | None = Field(description="When the phase ended; null while it is under way.")
    seconds: float = Field(description="How long it took, or has taken so far while under way.")


class FailureOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    job_id: uuid.UUID
    rank: int | None
    kind: str
    state: str
    cause: str
    detected_at: datetime
    classified_at: datetime | None
    replaced_at: datetime | None
    restored_at: datetime | None
    resumed_at: datetime | None
    plan_id: int | None
    tier: str | None
    iterations_lost: int | None
    details: dict[str, Any]
    recovery_s: float | None = Field(
        None,
        description="Recovery time in seconds: from detection to training resumed (every rank completed its "
        "first iteration after the restore); null until then. The pages, /metrics and the CLI show this.",
    )

    number: int | None = Field(
        None,
        description="The failure's number within its job (1, 2, 3, ... in the order recorded), as the pages "
        "show it (#3); `id` is global and skips numbers within a job.",
    )
    phases: list[PhaseOut] = Field(
        default_factory=list,
        description="The recovery's phases in order, computed by the service as its pages and /metrics do; "
        "the last one is under way (end null) until the failure is over, and a finished failure leaves out "
        "phases that never happened (a software failure has no replace phase).",
    )

    @field_validator("details", mode="before")
    @classmethod
    def _readable_details(cls, value: Any) -> Any:
        return readable_json(value)


class RecoveryPlanOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    job_id: uuid.UUID
    generation: int
    iteration: int | None = Field(description="Iteration every rank resumes from; null: start fresh.")
    reason: str
    created_at: datetime
    sources: list[PlanSource]


class PersistedShardOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    rank: int
    key: str
    digest: str
    nbytes: int
    generation: int = Field(
        1, description="The recovery-plan generation whose training wrote the shard (its history)."
    )
    condemned: str | None = Field(
        None,
        description="Why a restore could not use the shard (it failed its checksums): no "
        "recovery plan names it again and its checkpoint is not complete; null when usable.",
    )


class PersistedCheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    iteration: int
    location: str
    created_at: datetime
    complete: bool
    shards: list[PersistedShardOut]
