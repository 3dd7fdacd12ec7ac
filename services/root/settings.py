"""Root-service settings, read from CASTOR_* environment variables.

The defaults are the embedded one-machine mode: a SQLite file in the state directory, REST heartbeats
instead of etcd, local "machines" instead of an Auto Scaling Group, a local directory as persistent tier.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CASTOR_", extra="ignore")

    state_dir: Path = Field(
        Path(".castor"),
        description="Directory for the embedded defaults: the SQLite database, the admin token, the local "
        "persistent tier.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy async URL. Default: sqlite+aiosqlite:///<state_dir>/castor.db. Production: "
        "postgresql+asyncpg://user:password@host:5432/castor.",
    )
    migrate_on_start: bool = Field(True, description="Apply database migrations when the service starts.")
    admin_token: str | None = Field(
        None,
        description="Bearer token of the public API and the status pages. Default: generated once and kept "
        "in <state_dir>/admin-token.",
    )
    host: str = Field("127.0.0.1", description="Address the API binds to.")
    port: int = Field(8080, description="Port the API binds to.")
    public_url: str | None = Field(
        None, description="URL agents use to reach this service. Default: http://<host>:<port>."
    )
    root_urls: str | None = Field(
        None,
        description="Every root replica's URL, comma-separated, for the agents the local operator starts (so "
        "they fail over between replicas). Default: public_url.",
    )

    etcd_endpoints: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="etcd v3 endpoints as host:port, comma-separated. Empty: agents heartbeat over REST, and "
        "replicas elect a leader through a Postgres advisory lock (SQLite: this replica is the only one).",
    )
    etcd_prefix: str = Field("/castor", description="Key prefix for heartbeats and leader election in etcd.")
    lease_ttl_s: int = Field(1, ge=1, description="TTL of an agent's etcd lease: failure detection latency.")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="How often agents heartbeat.")
    heartbeat_timeout_s: float = Field(
        3.0,
        gt=0,
        description="REST mode: a machine whose last heartbeat is older than this is suspect (in etcd mode, "
        "one whose lease expired).",
    )
    suspect_grace_s: float = Field(
        10.0,
        ge=0,
        description="How long a suspect machine (heartbeats lapsed) may stay silent before it is declared "
        "lost without a second signal (a peer's training process failing, its agent process gone by the "
        "local operator, the cloud's health check). Its heartbeats resuming first reinstates it.",
    )

    mass_silence_fraction: float = Field(
        0.25,
        gt=0,
        le=1,
        description="When at least this share of a job's machines (and at least 3) are silent at once "
        "(suspect, or declared lost and not replaced yet), the grace alone declares none of them lost: so "
        "many silent at once points at the observer (the root's host, etcd, the network to them) rather "
        "than the machines. A second signal still declares a suspect lost.",
    )

    inventory_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A machine that does not report what it holds within this long after a "
        "recovery starts (or after it registered, for a replacement) is treated as failed.",
    )
    upload_wait_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long a recovery's plan waits for uploads to the persistent tier that the machines "
        "still have in flight, where they would let every rank resume from a newer iteration (a lost "
        "placement group's ranks uploaded an iteration the survivors are still uploading), counted from the "
        "first decision that found them (every inventory in). Past it, the plan takes the newest iteration "
        "restorable then. 0: never wait.",
    )
    replacement_timeout_s: float = Field(
        900.0,
        gt=0,
        description="A replacement machine that has not registered this long after it was launched is "
        "itself replaced (EC2 usually takes 4-7 minutes).",
    )
    max_failed_recoveries: int = Field(
        3,
        ge=1,
        description="Recoveries in a row that fail before training resumes (a crash loop, a source that "
        "cannot deliver) after which the job is marked failed instead of trying again.",
    )
    restore_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A machine that does not resume training within this long after a plan "
        "is ready is treated as failed.",
    )
    local_shm_base: Path = Field(
        Path("/dev/shm/castor"),
        description="Local cloud operator: where the machines it starts keep their "
        "shared memory (one directory per machine).",
    )
    use_standby: bool = Field(
        True,
        description="AWS: replace a failed instance with a Standby instance of the group when there is "
        "one (seconds), else terminate it and wait for the group to launch a new one (minutes).",
    )
    cloud: Literal["local", "aws"] = Field(
        "local",
        description="Cloud operator that replaces failed machines: local agent processes on this host, or an "
        "AWS Auto Scaling Group.",
    )
    aws_region: str = Field("us-east-1", description="AWS region of the Auto Scaling Group and S3 bucket.")
    aws_endpoint_url: str | None = Field(
        None, description="AWS endpoint override (a moto server in tests). Default: the real AWS endpoints."
    )
    asg_name: str | None = Field(None, description="Auto Scaling Group whose instances run the job.")
    s3_bucket: str | None = Field(
        None, description="Bucket of the persistent tier. Empty: a local directory (<state_dir>/persistent)."
    )
    s3_prefix: str = Field("castor", description="Key prefix of persisted checkpoints in the bucket.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint override. Default: aws_endpoint_url.")

    max_body_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Largest request body the API reads (bytes); a larger one is answered 413.",
    )
    max_machines_per_job: int = Field(
        4096,
        ge=1,
        le=100_000,
        description="Most machines a job may have; creating a larger one is answered 422. Creation "
        "time, the placement response and the job page grow with it.",
    )
    local_max_machines: int = Field(
        64,
        ge=1,
        description="Local cloud operator: most machines of a job it starts as agent processes on this "
        "host (a job with a launch spec and more machines is answered 422).",
    )

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _split_endpoints(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.state_dir.resolve() / 'castor.db'}"

    @property
    def resolved_public_url(self) -> str:
        return self.public_url or f"http://{self.host}:{self.port}"

    @property
    def persistent_dir(self) -> Path:
        return self.state_dir.resolve() / "persistent"

    def resolved_admin_token(self) -> str:
        """The configured admin token, or the one generated on first use and kept in the state dir."""
        if self.admin_token:
            return self.admin_token
        path = self.state_dir / "admin-token"
        if path.exists():
            return path.read_text().strip()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        token = "castor-admin." + secrets.token_urlsafe(24)
        path.touch(mode=0o600)
        path.write_text(token + "\n")
        return token
