"""The worker surface of the root's REST API (/api/v1/worker/jobs/{job}...): what a job's agents send and
read, with the job's worker token."""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool

from worker_lib.api.public import MAX_PROCS_PER_MACHINE, MAX_REPLICAS
from worker_lib.api.shared import (
    INT32_MAX,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    ByteCount,
    CheckpointRate,
    Count,
    CountKey,
    JsonObject,
    Peer,
    PersistentTier,
    PlacementOut,
    PlanSource,
    Port,
    Rate,
    Text,
    WireModel,
)

# The iteration a training process restored, or FRESH_START: it had nothing to restore (the worker sends
# worker_lib.agent_ipc.FRESH_START, the same number, without importing this module).
FRESH_START = -1
RestoredIteration = Annotated[int, Field(strict=True, ge=FRESH_START, le=INT32_MAX)]

# What an instance id may be (a cloud instance id, a host or pod name, an address): printable ASCII
# without spaces, no path separator and no leading dot, as ids may end up in file names and commands.
_INSTANCE_ID = re.compile(r"[!-~]+")


def _valid_instance_id(value: str) -> str:
    if not _INSTANCE_ID.fullmatch(value) or "/" in value or "\\" in value or value.startswith("."):
        raise ValueError(
            "must be printable ASCII without spaces, '/' or '\\', not starting with '.' (a cloud instance "
            "id, a host name or an address)"
        )
    return value


class RegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Annotated[Text, AfterValidator(_valid_instance_id)] = Field(
        min_length=1, max_length=128, description="Cloud instance id or host identity."
    )
    address: Text = Field(min_length=1, max_length=255, description="Address peers reach the agent at.")
    data_port: Port = Field(description="Port of the agent's checkpoint data plane.")
    rendezvous_port: Port | None = Field(
        None, description="A free port for torch.distributed's store if this is machine 0."
    )
    hostname: Text = Field("", max_length=255)
    rank: Count | None = Field(None, description="Ask for this machine rank (default: the next free one).")
    agent_session: Text | None = Field(
        None,
        max_length=64,
        description="A random id the agent process chose when it started: a registration sent again with "
        "the same one (a retry whose answer was lost) is not recorded as an agent restart.",
    )
    embedded: StrictBool = Field(
        False,
        description="Embedded mode (training launched by torchrun): the root records failures but leaves "
        "restarts to torchrun instead of orchestrating recoveries.",
    )


class HeartbeatConfig(WireModel):
    mode: Literal["rest", "etcd"]
    interval_s: float
    timeout_s: float
    etcd_endpoints: list[str] = []
    etcd_key: str | None = None
    summary_period_s: float = Field(
        2.0,
        gt=0,
        description="etcd mode: the agent rewrites its summary key at most this often (the lease's keepalive "
        "alone carries liveness); longer for larger jobs, so that a job's summaries stay a bounded write "
        "rate for etcd and the root's leader.",
    )


class RegisterResponse(WireModel):
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
    directive_wait_s: float = Field(
        10.0,
        gt=0,
        le=60,
        description="How long the agent's directive long poll waits for a new revision before asking again "
        "(each answer also refreshes its peers' addresses); longer for larger jobs, so that a job's idle "
        "long polls answer at a bounded rate.",
    )
    plan_generation: int | None
    persistent: PersistentTier = Field(description="Where agents upload every persist_every iterations.")


class PersistMissed(BaseModel):
    """An announced persist iteration one of the machine's ranks cannot persist."""

    model_config = ConfigDict(extra="forbid")

    iteration: Count
    generation: int = Field(strict=True, ge=1, le=INT32_MAX)


class PersistSchedule(WireModel):
    """The iteration every rank of the job persists next, chosen by the root (services.root.domain.
    persist_schedule). An agent that sees this object persists only the announced iteration; one that never
    does (an older root) persists its ranks' commits on multiples of persist_every."""

    every: int = Field(description="The job's persist_every.")
    iteration: int | None = Field(
        description="The iteration every rank persists (a multiple of `every`); null: none announced yet."
    )
    generation: int | None = Field(
        description="The plan generation it was announced in: only that history's commits of it count."
    )


# The peer ranks one machine can hold replicas of: procs_per_machine x (replicas - 1) at most.
REPLICA_RANKS_MAX = MAX_PROCS_PER_MACHINE * (MAX_REPLICAS - 1)


class CheckpointSummary(BaseModel):
    """What an agent holds, in brief (the full inventory is asked for only during a recovery)."""

    local: dict[CountKey, Count] = Field(
        default_factory=dict,
        max_length=MAX_PROCS_PER_MACHINE,
        description="rank -> newest committed iteration.",
    )
    replicas: dict[CountKey, Count] = Field(
        default_factory=dict,
        max_length=REPLICA_RANKS_MAX,
        description="peer rank -> newest replicated iteration.",
    )
    committed: Count = Field(0, description="Checkpoints committed since the agent started.")
    restored: dict[CountKey, RestoredIteration] = Field(
        default_factory=dict,
        max_length=MAX_PROCS_PER_MACHINE,
        description="rank -> the iteration its newest training process restored when it started (-1: it "
        "started fresh, with nothing to restore). In embedded (torchrun) mode the root takes the iterations "
        "a relaunch lost from it.",
    )
    newest_at_restore: dict[CountKey, RestoredIteration] = Field(
        default_factory=dict,
        max_length=MAX_PROCS_PER_MACHINE,
        description="rank -> the newest iteration it held when that process restored (-1: none): what the "
        "restore rolled back from.",
    )
    session: Text | None = Field(
        None,
        max_length=64,
        description="The agent_session of the agent that sent it: a summary of an agent since restarted (a "
        "heartbeat delayed past the new agent's registration) is not taken for the new one's.",
    )
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
    per_minute: CheckpointRate | None = Field(None, description="Effective checkpoint frequency.")
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
    replication_stalled: bool = Field(
        False,
        description="No local rank committed for a while (training waits): this machine then proposes the "
        "newest iteration it holds, and when every machine says so the root names the smallest proposal.",
    )
    replication_free: bool = Field(
        False,
        description="This machine replicates its own newest iterations, not the job's agreed ones (its agent "
        "was told CASTOR_REPLICATION_ALIGN=0, or its stores are too small to pin): then no machine of the "
        "job aligns its rounds.",
    )
    uploaded: Count = Field(0, description="Checkpoints uploaded to the persistent tier.")
    persist_missed: PersistMissed | None = Field(
        None,
        description="The announced persist iteration a local rank cannot persist (it had committed past it "
        "when the announcement came, and its copy was gone): the root gives it up and announces another.",
    )
    warm_spares: Count | None = Field(
        None, description="Warm interpreters (torch imported) ready for the next restart."
    )
    stalled_s: dict[CountKey, Rate] = Field(
        default_factory=dict,
        max_length=MAX_PROCS_PER_MACHINE,
        description="rank -> seconds its training thread was blocked in Castor (save() calls and waits for a "
        "copy at the optimizer step, a forward, wait()), summed over its training processes since the agent "
        "started. The job's ETTR charges the slowest rank's as checkpoint stalls.",
    )
    save_calls: dict[CountKey, Count] = Field(
        default_factory=dict,
        max_length=MAX_PROCS_PER_MACHINE,
        description="rank -> save() calls over which stalled_s was counted.",
    )
    store_filesystem: Text | None = Field(
        None,
        max_length=64,
        description="The filesystem of the machine's checkpoint directory when it is backed by storage "
        "(ext4, xfs, nfs4, ...), not memory (tmpfs): every save and replica is then written back to storage "
        "beside training. Null: in memory.",
    )


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    summary: CheckpointSummary = Field(default_factory=CheckpointSummary)


class ReplicationAlignment(WireModel):
    """Replication rounds aligned across machines (see services.root.domain.replication)."""

    aligned_iteration: int | None = Field(
        description="The newest iteration every replicating machine fully replicated and keeps pinned."
    )
    target: int | None = Field(description="The next iteration to replicate everywhere (largest proposal).")
    go: bool = Field(description="Every replicating machine pinned the target: start its round.")


class HeartbeatResponse(WireModel):
    state: str = Field(description="This machine's state as the root sees it.")
    job_state: str
    plan_generation: int | None
    peers: list[Peer]
    replication: ReplicationAlignment | None = Field(
        None,
        description="Alignment of the replication rounds, from every live machine's last summary (null: no "
        "machine replicates, or the job is past the size whose counters a heartbeat refreshes itself).",
    )
    persist: PersistSchedule | None = Field(
        None, description="The iteration every rank persists next (null: the job has no persistent tier)."
    )


# The error type of a process the agent's hang watchdog killed: the agent's words, not the process's.
HANG_ERROR_TYPE = "Hung"


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
    generation: Count | None = Field(
        None,
        description="The plan generation the process was started for. An exit of a generation a recovery "
        "has since replaced is part of that recovery: it joins the recovery's failure, never opens one.",
    )


class ExitAck(WireModel):
    failure_id: int | None = Field(description="The failure event opened for this exit, if it was one.")


class Rendezvous(WireModel):
    master_addr: str
    master_port: int | None


class DirectiveOut(WireModel):
    """What every agent of the job must do now; asked for one machine (`machine=`), only what that machine's
    agent needs of it."""

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
    machine: int | None = Field(
        None, description="The machine this directive was asked for (null: the whole job's directive)."
    )
    sources: list[PlanSource] = Field(
        description="Where each rank restores `iteration` from: the machine's own ranks (the whole job's: "
        "every rank)."
    )
    machines: list[Peer] = Field(
        description="Where the agents' data planes listen: the machine itself and the live peers that hold "
        "its checkpoints' replicas (the whole job's: every live machine)."
    )
    persist: PersistSchedule | None = Field(
        None, description="The iteration every rank persists next (null: the job has no persistent tier)."
    )


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
        description="True: a check on the machine found every stripe's checksum matching; False: found "
        "corrupt (`problem` says how), never planned; None: not checked yet (planned like an intact copy: "
        "its restore verifies every stripe)."
    )
    generation: int = Field(
        1, strict=True, ge=1, le=INT32_MAX, description="The plan generation whose training made it."
    )
    problem: Text | None = Field(None, max_length=2000)


class UploadInFlight(BaseModel):
    """A checkpoint this machine is uploading to the persistent tier: started (on the root's schedule) or
    staged, and not yet acknowledged as persisted."""

    model_config = ConfigDict(extra="forbid")

    rank: Count
    iteration: Count
    generation: int = Field(strict=True, ge=1, le=INT32_MAX)


class InventoryReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instance_id: Text = Field(min_length=1, max_length=128)
    generation: int = Field(
        strict=True, ge=1, le=INT32_MAX, description="The recovery generation being collected."
    )
    holdings: list[Holding]
    uploading: list[UploadInFlight] = Field(
        default_factory=list,
        max_length=MAX_PROCS_PER_MACHINE,
        description="Uploads to the persistent tier this machine has in flight (one per local rank at "
        "most): a plan that would resume from a newer iteration once they arrive waits for them a while.",
    )
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
