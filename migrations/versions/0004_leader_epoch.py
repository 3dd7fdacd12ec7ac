"""leader epoch: the orchestrator leadership's fencing token (one row); machines.suspected_at

Revision ID: 0004_leader_epoch
Revises: 0003_replica_capacity
Create Date: 2026-11-23 15:25:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from services.root.db.models import UtcDateTime

revision: str = "0004_leader_epoch"
down_revision: str | None = "0003_replica_capacity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "leader_epoch",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("updated_at", UtcDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leader_epoch")),
    )
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("suspected_at", UtcDateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("suspected_at")
    op.drop_table("leader_epoch")
