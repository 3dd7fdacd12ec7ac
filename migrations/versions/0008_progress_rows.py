"""progress rows: each machine's recovery progress reports in rows of their own

A machine's "restored" and "resumed" reports (when they arrived, and its restore's details) were merged
into the JSON details of every failure event of the plan, a read-modify-write under the job row's lock
that serialized a thousand reports after a recovery. They get a row per (job, plan generation, machine
rank) that only that machine's reports write, with no foreign key to the job (inserting one would take
a KEY SHARE lock on the job's row, which waits behind the leader's FOR UPDATE). The notes already on failure events move into the rows
(upgrade) and back (downgrade).

Revision ID: 0008_progress_rows
Revises: 0007_persist_schedule
Create Date: 2026-11-27 03:30:00.000000
"""

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

import services.root.db.models

revision: str = "0008_progress_rows"
down_revision: str | None = "0007_persist_schedule"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The failure events' details keys the notes lived under: machine rank (a string) -> value.
RESTORED_AT, RESUMED_AT, RESTORE = "restored_reported_at", "resumed_reported_at", "restore"
KEYS = (RESTORED_AT, RESUMED_AT, RESTORE)

_events = sa.table(
    "failure_events",
    sa.column("id", sa.Integer()),
    sa.column("job_id", sa.Uuid()),
    sa.column("plan_id", sa.Integer()),
    sa.column("details", sa.JSON()),
)
_plans = sa.table(
    "recovery_plans",
    sa.column("id", sa.Integer()),
    sa.column("generation", sa.Integer()),
)
_progress = sa.table(
    "rank_progress",
    sa.column("job_id", sa.Uuid()),
    sa.column("generation", sa.Integer()),
    sa.column("rank", sa.Integer()),
    sa.column("restored_at", services.root.db.models.UtcDateTime(timezone=True)),
    sa.column("resumed_at", services.root.db.models.UtcDateTime(timezone=True)),
    sa.column("restore", sa.JSON()),
)


def _timestamp(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.astimezone(UTC) if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _rank(key: Any) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def upgrade() -> None:
    op.create_table(
        "rank_progress",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("restored_at", services.root.db.models.UtcDateTime(timezone=True), nullable=True),
        sa.Column("resumed_at", services.root.db.models.UtcDateTime(timezone=True), nullable=True),
        sa.Column("restore", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rank_progress")),
        sa.UniqueConstraint(
            "job_id", "generation", "rank", name=op.f("uq_rank_progress_job_id_generation_rank")
        ),
    )
    _move_notes_to_rows()


def _move_notes_to_rows() -> None:
    """Every event of a plan carried the same notes, except one that moved along from a superseded plan
    (it kept that plan's too): the newest event's note wins, each key and rank on its own."""
    connection = op.get_bind()
    query = (
        sa.select(_events.c.id, _events.c.job_id, _events.c.details, _plans.c.generation)
        .join(_plans, _plans.c.id == _events.c.plan_id)
        .order_by(_events.c.id.desc())
    )
    rows: dict[tuple[Any, int, int], dict[str, Any]] = {}
    cleaned: list[dict[str, Any]] = []
    for event_id, job_id, details, generation in connection.execute(query).all():
        if not isinstance(details, dict) or not any(key in details for key in KEYS):
            continue
        for key, column in ((RESTORED_AT, "restored_at"), (RESUMED_AT, "resumed_at"), (RESTORE, "restore")):
            notes = details.get(key)
            for rank_key, value in notes.items() if isinstance(notes, dict) else []:
                rank = _rank(rank_key)
                if rank is None:
                    continue
                row = rows.setdefault(
                    (job_id, generation, rank),
                    {"job_id": job_id, "generation": generation, "rank": rank, "restore": {}},
                )
                if column == "restore":
                    if not row["restore"] and isinstance(value, dict):  # else a newer event's note
                        row["restore"] = value
                elif row.get(column) is None:
                    row[column] = _timestamp(value)
        cleaned.append({"event_id": event_id, "details": {k: v for k, v in details.items() if k not in KEYS}})
    if rows:
        op.bulk_insert(
            _progress,
            [{"restored_at": None, "resumed_at": None, **row} for row in rows.values()],
        )
    for change in cleaned:
        connection.execute(
            sa.update(_events).where(_events.c.id == change["event_id"]).values(details=change["details"])
        )


def downgrade() -> None:
    connection = op.get_bind()
    query = (
        sa.select(_events.c.id, _events.c.details, _progress)
        .join(_plans, _plans.c.id == _events.c.plan_id)
        .join(
            _progress,
            (_progress.c.job_id == _events.c.job_id) & (_progress.c.generation == _plans.c.generation),
        )
        .order_by(_events.c.id, _progress.c.rank)
    )
    merged: dict[int, dict[str, Any]] = {}
    for row in connection.execute(query).mappings():
        details = merged.setdefault(row["id"], dict(row["details"] or {}))
        rank = str(row["rank"])
        if row["restored_at"] is not None:
            details.setdefault(RESTORED_AT, {})[rank] = row["restored_at"].isoformat()
            details.setdefault(RESTORE, {})[rank] = row["restore"] or {}
        if row["resumed_at"] is not None:
            details.setdefault(RESUMED_AT, {})[rank] = row["resumed_at"].isoformat()
    for event_id, details in merged.items():
        connection.execute(sa.update(_events).where(_events.c.id == event_id).values(details=details))
    op.drop_table("rank_progress")
