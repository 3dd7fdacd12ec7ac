"""replica capacity: the most bytes of one rank's checkpoint, per job

Agents check their shared memory against it at registration and refuse larger checkpoints from peers.

Revision ID: 0003_replica_capacity
Revises: 0002_sessions
Create Date: 2026-11-23 12:45:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_replica_capacity"
down_revision: str | None = "0002_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("checkpoint_bytes_max", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("checkpoint_bytes_max")
