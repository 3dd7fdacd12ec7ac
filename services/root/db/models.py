"""SQLAlchemy models: the root service's system of record.

In-memory checkpoints are deliberately absent: a row per rank per iteration would be thousands of writes a
second. Agents keep that inventory and report a summary in their heartbeats; the database keeps jobs,
machines, placement, failures, recovery plans and persisted (durable) checkpoints.
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite drops the zone on the way back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class JobState(enum.StrEnum):
    PENDING = "pending"  # created, waiting for its machines to register
    RUNNING = "running"
    RECOVERING = "recovering"
    FAILED = "failed"  # unrecoverable
    COMPLETED = "completed"
    STOPPED = "stopped"


class MachineState(enum.StrEnum):
    PENDING = "pending"  # registered, no heartbeat yet
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # missed heartbeats, not yet declared failed
    FAILED = "failed"
    REPLACED = "replaced"  # a new machine took its rank


class FailureKind(enum.StrEnum):
    SOFTWARE = "software"  # a training process died, its machine (agent) is alive
    HARDWARE = "hardware"  # the machine (agent, memory) is gone
    UNKNOWN = "unknown"


class FailureState(enum.StrEnum):
    DETECTED = "detected"
    RECOVERING = "recovering"
    RECOVERED = "recovered"
    UNRECOVERABLE = "unrecoverable"


class PlanStatus(enum.StrEnum):
    PENDING = "pending"  # waiting for every machine to register
    COLLECTING = "collecting"  # training stopped; waiting for the machines' inventories
    READY = "ready"  # every rank resumes from `iteration` (None: from scratch) per `sources`


class Tier(enum.StrEnum):
    LOCAL = "local"
    PEER = "peer"
    PERSISTENT = "persistent"


class Base(DeclarativeBase):
    # Deterministic constraint names, the same on Postgres and SQLite, so migrations can refer to them.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map = {datetime: UtcDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    state: Mapped[str] = mapped_column(String(16), index=True, default=JobState.PENDING)
    num_machines: Mapped[int]
    replicas: Mapped[int]
    procs_per_machine: Mapped[int]
    persist_every: Mapped[int]  # iterations between persistent checkpoints; 0 disables the tier
    keep_persisted: Mapped[int]  # newest P persisted checkpoints kept
    # The most bytes of one rank's checkpoint; agents size their replica slots and /dev/shm check by it.
    # None: each agent allows an equal share of its free shared memory.
    checkpoint_bytes_max: Mapped[int | None] = mapped_column(BigInteger, default=None)
    placement_strategy: Mapped[str] = mapped_column(String(8))
    # How agents schedule replica traffic: "interleaved" (inside the idle spans of training's own
    # communication) or "eager"; and an optional cap in Gbit/s on it (None: none).
    replication_policy: Mapped[str] = mapped_column(String(16), default="interleaved")
    replication_bandwidth_gbps: Mapped[float | None] = mapped_column(default=None)
    # How the local cloud operator starts this job's machines: {"command": [...], "cwd": ..., "env": {...}}.
    # None: machines are started outside Castor (an Auto Scaling Group's boot script, or by hand).
    launch: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # k (as a string key) -> probability of recovering from CPU memory when k machines fail at once
    recovery_probabilities: Mapped[dict[str, Any]]
    worker_token_hash: Mapped[str] = mapped_column(String(64))
    # Counters refreshed from heartbeats: iteration every rank has committed, saves taken and skipped.
    newest_iteration: Mapped[int | None] = mapped_column(default=None)
    # Sums over every machine of a long job: past 2**31 on a large fleet, hence 64 bits.
    checkpoints_committed: Mapped[int] = mapped_column(BigInteger, default=0)
    checkpoints_skipped: Mapped[int] = mapped_column(BigInteger, default=0)
    checkpoints_per_minute: Mapped[float | None] = mapped_column(default=None)
    # In-memory replication, from the heartbeats (None: no machine replicates, or none reported yet): the
    # newest iteration every machine fully replicated, the largest achieved interval between fully
    # replicated iterations, the largest lag behind the newest commit, and "ok" or "stalled".
    replicated_iteration: Mapped[int | None] = mapped_column(BigInteger, default=None)
    replication_interval: Mapped[int | None] = mapped_column(BigInteger, default=None)
    replication_lag: Mapped[int | None] = mapped_column(BigInteger, default=None)
    replication_state: Mapped[str | None] = mapped_column(String(16), default=None)
    # The iteration every rank persists next, chosen by the root (a multiple of persist_every), and the
    # plan generation it was announced in (a recovery since gives it up); None: none announced
    # (domain.persist_schedule).
    persist_iteration: Mapped[int | None] = mapped_column(BigInteger, default=None)
    persist_generation: Mapped[int | None] = mapped_column(default=None)
    wasted_time_s: Mapped[float] = mapped_column(default=0.0)
    # Recoveries in a row that a new failure cut short before training resumed; reset by a recovery that
    # finishes. Past Settings.max_failed_recoveries the job has failed (a crash loop).
    failed_recoveries: Mapped[int] = mapped_column(default=0)
    # Bumped whenever what agents must do changes (a plan becomes ready, a recovery starts, the job ends);
    # agents long-poll for a revision newer than the one they acted on.
    directive_revision: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    machines: Mapped[list[Machine]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True, order_by="Machine.rank"
    )
    groups: Mapped[list[PlacementGroupRow]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by="PlacementGroupRow.index"
    )


class Machine(Base):
    __tablename__ = "machines"
    __table_args__ = (
        UniqueConstraint("job_id", "instance_id"),
        # One live machine per rank; replaced machines stay as history.
        Index(
            "uq_machines_live_rank",
            "job_id",
            "rank",
            unique=True,
            postgresql_where=text("state <> 'replaced'"),
            sqlite_where=text("state <> 'replaced'"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int]
    instance_id: Mapped[str] = mapped_column(String(128))
    hostname: Mapped[str] = mapped_column(String(255), default="")
    address: Mapped[str] = mapped_column(String(255))
    data_port: Mapped[int]
    embedded: Mapped[bool] = mapped_column(default=False)  # torchrun drives its processes, not the root
    # A free port on this machine for torch.distributed's store when it hosts global rank 0.
    rendezvous_port: Mapped[int | None] = mapped_column(default=None)
    # The registering agent process's random id: a registration sent again with it (a retry whose answer
    # was lost) is not an agent restart.
    agent_session: Mapped[str | None] = mapped_column(String(64), default=None)
    state: Mapped[str] = mapped_column(String(16), default=MachineState.PENDING)
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    # When its heartbeats lapsed (state suspect): the grace before it is declared lost counts from here.
    suspected_at: Mapped[datetime | None] = mapped_column(default=None)
    # The newest heartbeat's checkpoint summary: {"local": {rank: iteration}, "replicas": {rank: iteration},
    # "saves": n, "skipped": n}
    summary: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Progress through recovery plans, by plan generation: the inventory reported while collecting, the
    # generation whose iteration this machine's ranks restored and resumed from, the one that finished.
    inventory: Mapped[dict[str, Any]] = mapped_column(default=dict)
    inventory_generation: Mapped[int | None] = mapped_column(default=None)
    restored_generation: Mapped[int | None] = mapped_column(default=None)
    resumed_generation: Mapped[int | None] = mapped_column(default=None)
    finished_generation: Mapped[int | None] = mapped_column(default=None)

    job: Mapped[Job] = relationship(back_populates="machines")


class RankProgress(Base):
    """One machine rank's progress through one plan generation: when its "restored" and "resumed" reports
    arrived and what its restore reported (tier, seconds, bytes per rank). Written only by that machine's
    own reports (an upsert on the unique key), so a thousand reports after a recovery lock nothing shared;
    the recovery's failure events show them (flows.recovery.progress_notes), and the leader's step reads
    the last report's time from them to end the restore and resume phases.

    No foreign key to the job: on Postgres, inserting a row that references the job takes a KEY SHARE lock
    on the job's row, which waits behind the leader's SELECT ... FOR UPDATE of it. A deleted job's rows are
    deleted with it (repository.delete_job)."""

    __tablename__ = "rank_progress"
    __table_args__ = (UniqueConstraint("job_id", "generation", "rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID]
    generation: Mapped[int]
    rank: Mapped[int]  # the machine's rank
    restored_at: Mapped[datetime | None] = mapped_column(default=None)  # its first "restored" report
    resumed_at: Mapped[datetime | None] = mapped_column(default=None)  # its first "resumed" report
    # The details of its newest "restored" report (per training rank: tier, seconds, bytes, ...).
    restore: Mapped[dict[str, Any]] = mapped_column(default=dict)


class PlacementGroupRow(Base):
    __tablename__ = "placement_groups"
    __table_args__ = (UniqueConstraint("job_id", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    index: Mapped[int]
    kind: Mapped[str] = mapped_column(String(8))  # "group" or "ring"
    members: Mapped[list[Any]]


class FailureEvent(Base):
    __tablename__ = "failure_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    machine_id: Mapped[int | None] = mapped_column(ForeignKey("machines.id", ondelete="SET NULL"))
    rank: Mapped[int | None]
    kind: Mapped[str] = mapped_column(String(16), default=FailureKind.UNKNOWN)
    state: Mapped[str] = mapped_column(String(16), default=FailureState.DETECTED)
    cause: Mapped[str] = mapped_column(String(500))
    detected_at: Mapped[datetime] = mapped_column(default=utcnow)
    classified_at: Mapped[datetime | None] = mapped_column(default=None)
    replaced_at: Mapped[datetime | None] = mapped_column(default=None)
    restored_at: Mapped[datetime | None] = mapped_column(default=None)
    resumed_at: Mapped[datetime | None] = mapped_column(default=None)
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("recovery_plans.id", ondelete="SET NULL"))
    tier: Mapped[str | None] = mapped_column(String(16), default=None)  # slowest tier any rank used
    iterations_lost: Mapped[int | None] = mapped_column(default=None)
    # Exit codes, instance ids, per-rank tiers and restore times: what a user reads on the failure page.
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)


class RecoveryPlan(Base):
    __tablename__ = "recovery_plans"
    __table_args__ = (UniqueConstraint("job_id", "generation"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    generation: Mapped[int]
    iteration: Mapped[int | None]  # None: start from scratch (nothing restorable)
    status: Mapped[str] = mapped_column(String(16), default=PlanStatus.PENDING)
    reason: Mapped[str] = mapped_column(String(500), default="")
    ready_at: Mapped[datetime | None] = mapped_column(default=None)
    # Where the training processes meet: {"master_addr", "master_port"} (torch.distributed's store).
    rendezvous: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Per rank: {"rank", "tier", "source_rank", "address", "data_port", "location", "digest"}
    sources: Mapped[list[Any]] = mapped_column(default=list)


class PersistedCheckpoint(Base):
    __tablename__ = "persisted_checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "iteration"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    iteration: Mapped[int]
    location: Mapped[str] = mapped_column(String(1000))  # URI prefix: s3://bucket/prefix/... or file:///...
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    shards: Mapped[list[PersistedShard]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by="PersistedShard.rank"
    )


class PersistedShard(Base):
    """One rank's part of a persisted checkpoint, with the checksum of its content."""

    __tablename__ = "persisted_shards"
    __table_args__ = (UniqueConstraint("checkpoint_id", "rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("persisted_checkpoints.id", ondelete="CASCADE"))
    rank: Mapped[int]
    key: Mapped[str] = mapped_column(String(1000))
    digest: Mapped[str] = mapped_column(String(64))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    generation: Mapped[int] = mapped_column(default=1)  # the plan generation whose training made it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Why a restore could not use it (it failed its checksums): no plan names it again, and its
    # checkpoint no longer counts as complete. A new upload of the shard clears it.
    condemned: Mapped[str | None] = mapped_column(String(500), default=None)


class WebSession(Base):
    """A browser signed in to the status pages. The cookie carries a random session id; only its SHA-256 is
    kept, so a database dump opens no page. `token_fingerprint` names the admin token the session was opened
    with: a rotated token no longer matches, which signs every browser out."""

    __tablename__ = "web_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_fingerprint: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(index=True)


class LeaderEpoch(Base):
    """The fencing token of the orchestrator's leadership: one row (id 1). A replica that becomes leader
    raises `epoch` (to the etcd revision that elected it, or one past the last, when Postgres' advisory lock
    elects it); every orchestrator transaction reads it (FOR SHARE) and gives up when it is no longer its
    own, so a deposed leader's writes are refused."""

    __tablename__ = "leader_epoch"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    holder: Mapped[str] = mapped_column(String(255), default="")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class MetricTotal(Base):
    """What rows no longer in the database had added to a /metrics counter (services/root/metrics.py), which
    the scrape adds to what the current rows count: a deleted job's failure events, a process exit folded
    into a machine's loss (flows.failures.machine_lost). A counter that went down as its rows went would
    read to Prometheus as a reset (a spike in rate() and increase()). One row per sample: the sample's name,
    the value of its one label ("" when it has none) and, for a histogram's bucket, its bound."""

    __tablename__ = "metric_totals"

    metric: Mapped[str] = mapped_column(String(64), primary_key=True)  # castor_failures_total, ..._bucket
    label: Mapped[str] = mapped_column(String(64), primary_key=True)
    le: Mapped[str] = mapped_column(String(16), primary_key=True)
    # A count; a histogram's _sum in microseconds (integers add up exactly: a float sum added in another
    # order could come out an ulp lower, and even that reads as a reset).
    value: Mapped[int] = mapped_column(BigInteger)
