"""replication interval: how far in-memory replication keeps up, per job

The achieved replication interval (iterations between fully replicated checkpoints), the newest iteration
every machine has fully replicated, the worst lag behind the newest commit, and a state that turns to
"stalled" when replication stops advancing; refreshed from the machines' heartbeats.

Revision ID: 0005_replication_interval
Revises: 0004_leader_epoch
Create Date: 2026-11-23 15:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_replication_interval"
down_revision: str | None = "0004_leader_epoch"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replicated_iteration", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("replication_interval", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("replication_lag", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("replication_state", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("replication_state")
        batch_op.drop_column("replication_lag")
        batch_op.drop_column("replication_interval")
        batch_op.drop_column("replicated_iteration")
