"""Wire models of the REST API (requests and responses). ORM rows never leave the service directly."""

from __future__ import annotations

import json
import math
import re
import uuid
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from services.root.web.phases import recovery_seconds

JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
# Hard ceilings of the schema; the service's own, lower limit on machines is a setting
# (CASTOR_MAX_MACHINES_PER_JOB), checked when a job is created.
MAX_MACHINES = 100_000
MAX_PROCS_PER_MACHINE = 64

# Numbers that end up in INTEGER / BIGINT columns: larger ones would be refused by the database with a
# server error, so they are refused here, as bad input, with a 422 naming the field.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
# Numbers in request bodies are strict: `true` or "1" is not a count (pydantic's lax mode would take them
# as 1). Only JSON object keys (always strings on the wire) are parsed into integers: CountKey.
Count = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # ranks, iterations, generations, counters
CountKey = Annotated[int, Field(ge=0, le=INT32_MAX)]
ByteCount = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
Rate = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]

# What a free-form JSON field of a request (a progress report's details) may hold: it is stored as is and
# shown by every read of it, so it must stay small, shallow and valid JSON for every database.
MAX_JSON_DEPTH = 8
MAX_JSON_BYTES = 16 * 1024
# Stored JSON is cut at this depth when read (wrappers the root adds around a report's details included),
# so rows written before these limits existed can still be shown.
MAX_READ_DEPTH = 32

# Python strings can hold UTF-16 surrogates that pair with nothing (JSON's "\ud800"); they have no UTF-8
# encoding, so Postgres (and SQLite's driver) cannot store them.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if _SURROGATE.search(value):
        raise ValueError("must not contain lone UTF-16 surrogates (text must be valid UTF-8)")
    return value


# Text stored in the database: Postgres refuses NUL characters in text columns, and every database
# refuses text that has no UTF-8 encoding.
Text = Annotated[str, AfterValidator(_valid_text)]


def _check_json(value: Any, depth: int) -> None:
    if isinstance(value, dict | list):
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"must not nest objects and arrays more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                _valid_text(key)
                _check_json(item, depth + 1)
        else:
            for item in value:
                _check_json(item, depth + 1)
    elif isinstance(value, str):
        _valid_text(value)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError("must not hold integers beyond 64 bits")
    elif isinstance(value, float):
        # json.loads reads NaN and Infinity, and 1e400 as infinity; no database stores them as JSON.
        if not math.isfinite(value):
            raise ValueError("must hold finite numbers only (no NaN, Infinity or numbers beyond a double)")
    else:
        raise ValueError(f"must hold JSON values only, not {type(value).__name__}")


def _bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    _check_json(value, 0)
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_JSON_BYTES:
        raise ValueError(f"must not exceed {MAX_JSON_BYTES} bytes as JSON (it has {size})")
    return value


# A free-form JSON object from a client (at most MAX_JSON_DEPTH deep and MAX_JSON_BYTES long).
JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]


def readable_json(value: Any, depth: int = 0) -> Any:
    """Stored JSON as it can always be serialized: cut below MAX_READ_DEPTH, non-finite numbers as null,
    lone surrogates replaced. Reads of rows stored before the request limits existed never fail."""
    if isinstance(value, dict | list):
        if depth >= MAX_READ_DEPTH:
            return "..."
        if isinstance(value, dict):
            return {readable_json(str(k), depth): readable_json(v, depth + 1) for k, v in value.items()}
        return [readable_json(item, depth + 1) for item in value]
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float):
        return value
    return readable_json(str(value), depth)


class LaunchSpec(BaseModel):
    """How the local cloud operator starts a machine of this job: `castor agent ... -- <command>`."""

    model_config = ConfigDict(extra="forbid")

    command: list[Text] = Field(
        min_length=1, description='The training command, e.g. ["python", "train.py"].'
    )
    cwd: Text | None = Field(None, description="Working directory of the training processes.")
    env: dict[Text, Text] = Field(default_factory=dict, description="Extra environment variables.")
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
        2, strict=True, ge=1, le=16, description="Copies of each checkpoint m, the local one included."
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


class PlacementGroupOut(BaseModel):
    index: int
    kind: Literal["group", "ring"]
    members: list[int]


class RankPlacement(BaseModel):
    rank: int
    holders: list[int] = Field(description="Machines holding this rank's checkpoint, its own first.")
    sends_to: list[int] = Field(description="Peers receiving a replica of this rank's checkpoint.")


class PlacementOut(BaseModel):
    strategy: Literal["group", "mixed", "ring"]
    machines: int
    replicas: int
    groups: list[PlacementGroupOut]
    ranks: list[RankPlacement]
    recovery_probability: dict[str, float] = Field(
        description="k -> probability of recovering from CPU memory when k machines fail at once (exact)."
    )


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

    @model_validator(mode="after")
    def _recovery_time(self) -> FailureOut:
        self.recovery_s = recovery_seconds(self)
        return self

    @field_validator("details", mode="before")
    @classmethod
    def _readable_details(cls, value: Any) -> Any:
        return readable_json(value)


class PlanSource(BaseModel):
    rank: int
    tier: Literal["local", "peer", "persistent"]
    source_rank: int | None = Field(None, description="Machine to fetch from (peer tier).")
    address: str | None = None
    data_port: int | None = None
    location: str | None = Field(None, description="Object location (persistent tier).")
    digest: str | None = Field(None, description="Expected content digest of the checkpoint.")


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


class PersistedCheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    iteration: int
    location: str
    created_at: datetime
    complete: bool
    shards: list[PersistedShardOut]


# ---- worker surface -------------------------------------------------------------------------------------


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128, description="Cloud instance id or host identity.")
    address: Text = Field(min_length=1, max_length=255, description="Address peers reach the agent at.")
    data_port: Port = Field(description="Port of the agent's checkpoint data plane.")
    rendezvous_port: Port | None = Field(
        None, description="A free port for torch.distributed's store if this is machine 0."
    )
    hostname: Text = Field("", max_length=255)
    rank: Count | None = Field(None, description="Ask for this machine rank (default: the next free one).")
    embedded: StrictBool = Field(
        False,
        description="Embedded mode (training launched by torchrun): the root records failures but leaves "
        "restarts to torchrun instead of orchestrating recoveries.",
    )


class Peer(BaseModel):
    rank: int
    address: str | None
    data_port: int | None
    state: str | None
    instance_id: str | None = Field(
        None, description="The instance bound to this rank (an agent that finds another here was replaced)."
    )


class HeartbeatConfig(BaseModel):
    mode: Literal["rest", "etcd"]
    interval_s: float
    timeout_s: float
    etcd_endpoints: list[str] = []
    etcd_key: str | None = None


class RegisterResponse(BaseModel):
    machine_id: int
    rank: int
    job_id: uuid.UUID
    machines: int
    replicas: int
    procs_per_machine: int
    persist_every: int
    checkpoint_bytes_max: int | None = Field(
        description="The most bytes of one rank's checkpoint (null: the agent's equal share of its shared "
        "memory); a peer's larger checkpoint is refused."
    )
    replication_policy: str = Field(
        "interleaved", description="How the agent schedules replica traffic (the job's replication_policy)."
    )
    replication_bandwidth_gbps: float | None = Field(
        None, description="Cap on the agent's replication traffic in Gbit/s; null: none."
    )
    placement: PlacementOut
    peers: list[Peer] = Field(description="Members of this machine's placement group.")
    heartbeat: HeartbeatConfig
    plan_generation: int | None
    persistent: PersistentTier = Field(description="Where agents upload every persist_every iterations.")


class CheckpointSummary(BaseModel):
    """What an agent holds, in brief (the full inventory is asked for only during a recovery)."""

    local: dict[CountKey, Count] = Field(
        default_factory=dict, description="rank -> newest committed iteration."
    )
    replicas: dict[CountKey, Count] = Field(
        default_factory=dict, description="peer rank -> newest replicated iteration."
    )
    committed: Count = Field(0, description="Checkpoints committed since the agent started.")
    skipped: Count = Field(
        0,
        description="Saves the training processes skipped: the slot to write was still being read (by "
        "replication or an upload) when training needed the state back.",
    )
    replicas_skipped: Count = Field(
        0,
        description="Commits no replication round sent: a round replicates one iteration and skips those "
        "committed while it was under way.",
    )
    per_minute: Rate | None = Field(None, description="Effective checkpoint frequency.")
    replicated: Count = Field(0, description="Checkpoints peers verified and committed.")
    replication_lag_s: Rate | None = Field(
        None, description="From the newest replicated commit to the peer's verified replica."
    )
    replicated_iteration: Count | None = Field(
        None,
        description="The newest iteration fully replicated: every local rank's checkpoint of it verified and "
        "committed by every peer the placement names (kept, locally and on the peers, until a newer one is).",
    )
    replication_interval: Count | None = Field(
        None,
        description="Iterations between the last two fully replicated iterations (the achieved interval).",
    )
    replication_lag_iterations: Count | None = Field(
        None,
        description="The newest iteration every local rank committed minus replicated_iteration (null: the "
        "machine replicates to no peer).",
    )
    replication_age_s: Rate | None = Field(None, description="Seconds since the last full replication.")
    replication_rounds: Count = Field(0, description="Iterations fully replicated since the agent started.")
    replication_aborted: Count = Field(
        0,
        description="Replication rounds given up: a training process needed a slot back, a peer refused the "
        "checkpoint, or a rollback replaced it.",
    )
    replication_kept: list[Count] | None = Field(
        None,
        max_length=16,
        description="Iterations this machine fully replicated and keeps pinned, locally and on its peers "
        "(null: it replicates to no peer). The job's aligned iteration is the newest every machine keeps.",
    )
    replication_next: Count | None = Field(
        None, description="The iteration this machine proposed or adopted for the next aligned round."
    )
    replication_ready: bool = Field(
        False, description="Whether every local rank's checkpoint of replication_next is pinned here."
    )
    replication_generation: Count | None = Field(
        None, description="Plan generation of the newest local commits (proposals of an older one are stale)."
    )
    uploaded: Count = Field(0, description="Checkpoints uploaded to the persistent tier.")
    warm_spares: Count | None = Field(
        None, description="Warm interpreters (torch imported) ready for the next restart."
    )
    stalled_s: dict[CountKey, Rate] = Field(
        default_factory=dict,
        description="rank -> seconds its training thread was blocked in Castor (save() calls and waits for a "
        "copy at the optimizer step, a forward, wait()), summed over its training processes since the agent "
        "started. The job's ETTR charges the slowest rank's as checkpoint stalls.",
    )
    save_calls: dict[CountKey, Count] = Field(
        default_factory=dict, description="rank -> save() calls over which stalled_s was counted."
    )


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    summary: CheckpointSummary = Field(default_factory=CheckpointSummary)


class ReplicationAlignment(BaseModel):
    """Replication rounds aligned across machines (see services.root.domain.replication)."""

    aligned_iteration: int | None = Field(
        description="The newest iteration every replicating machine fully replicated and keeps pinned."
    )
    target: int | None = Field(description="The next iteration to replicate everywhere (largest proposal).")
    go: bool = Field(description="Every replicating machine pinned the target: start its round.")


class HeartbeatResponse(BaseModel):
    state: str = Field(description="This machine's state as the root sees it.")
    job_state: str
    plan_generation: int | None
    peers: list[Peer]
    replication: ReplicationAlignment | None = Field(
        None,
        description="Alignment of the replication rounds, from every live machine's last summary (null: no "
        "machine replicates, or the job is past the size whose counters a heartbeat refreshes itself).",
    )


class ProcessError(BaseModel):
    """A training process's uncaught exception, from its torchelastic error file (TORCHELASTIC_ERROR_FILE)."""

    model_config = ConfigDict(extra="forbid")

    type: Text = Field("", max_length=200, description="The exception's type, e.g. ValueError.")
    message: Text = Field(
        min_length=1, max_length=2000, description="`Type: message`, as torchelastic writes it."
    )
    traceback: Text = Field("", max_length=10000, description="The traceback's last frames.")


class ExitReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    local_rank: Count
    global_rank: Count
    exit_code: int = Field(
        strict=True, ge=-128, le=255, description="Process exit code; negative: killed by that signal."
    )
    error: ProcessError | None = Field(
        None, description="The uncaught exception the process recorded before it exited, if it did."
    )


class ExitAck(BaseModel):
    failure_id: int | None = Field(description="The failure event opened for this exit, if it was one.")


class Rendezvous(BaseModel):
    master_addr: str
    master_port: int | None


class DirectiveOut(BaseModel):
    """What every agent of the job must do now."""

    revision: int = Field(description="Increases whenever the directive changes; long-poll with after=.")
    job_state: str
    status: Literal["pending", "collecting", "ready", "finished"] = Field(
        description="pending: wait for all machines; collecting: stop training and report inventory; "
        "ready: train from `iteration`; finished: the job ended, stop and exit."
    )
    generation: int
    iteration: int | None = Field(description="Iteration every rank resumes from; null: from scratch.")
    world_size: int
    procs_per_machine: int
    rendezvous: Rendezvous | None
    sources: list[PlanSource]
    machines: list[Peer] = Field(description="Every live machine: where its agent's data plane listens.")


class ProgressReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    generation: int = Field(strict=True, ge=1, le=INT32_MAX)
    event: Literal["restored", "resumed", "finished", "restore_failed"] = Field(
        description="restored: this machine's ranks hold the plan's iteration locally and training "
        "restarted; resumed: its first iteration after the restore completed; finished: every process "
        "exited cleanly; restore_failed: a source could not deliver (details say why)."
    )
    iteration: Count | None = None
    details: JsonObject = Field(
        default_factory=dict,
        description=f"Free-form JSON object: at most {MAX_JSON_DEPTH} levels deep and {MAX_JSON_BYTES} "
        "bytes, finite numbers within 64 bits, no NUL characters or lone surrogates.",
    )


class Holding(BaseModel):
    """A committed checkpoint this machine holds in shared memory."""

    rank: Count
    iteration: Count
    tier: Literal["local", "replica"]
    digest: Text = Field(max_length=64)
    data_bytes: ByteCount
    verified: StrictBool | None = Field(
        description="The checksums of every stripe matched (None: not checked)."
    )
    generation: int = Field(
        1, strict=True, ge=1, le=INT32_MAX, description="The plan generation whose training made it."
    )
    problem: Text | None = Field(None, max_length=2000)


class InventoryReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    generation: int = Field(
        strict=True, ge=1, le=INT32_MAX, description="The recovery generation being collected."
    )
    holdings: list[Holding]
    rendezvous_port: Port | None = None


class PersistedReport(BaseModel):
    """One rank's shard reached the persistent tier. It lies at the key the root computes from (prefix,
    job, iteration, rank, generation): `<prefix>/<job>/iteration-<I>/rank-<r>/gen-<g>`."""

    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    rank: Count = Field(description="Global rank whose checkpoint was uploaded; one this machine runs.")
    iteration: Count
    generation: int = Field(1, ge=1, le=INT32_MAX)
    key: Text | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="Optional: where the shard was uploaded. Must be the key the root computes (422 if not).",
    )
    location: Text | None = Field(
        None,
        min_length=1,
        max_length=1000,
        description="Deprecated and optional: the checkpoint's URI. Must be the one the root computes.",
    )
    digest: Text = Field(max_length=64)
    nbytes: ByteCount


class PersistentTier(BaseModel):
    kind: Literal["s3", "local"]
    prefix: str
    bucket: str | None = None
    region: str | None = None
    endpoint_url: str | None = None
    path: str | None = None
