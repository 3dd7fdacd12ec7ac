"""condemned shards: a persisted shard a restore found corrupt

A restore from the persistent tier that finds a rank's object failing its checksums reports it;
the root records why on the shard, and no later plan names it (the recovery rolls back to an older
persisted checkpoint instead of failing on the same object until the job is marked failed).

Revision ID: 0009_condemned_shards
Revises: 0008_progress_rows
Create Date: 2026-11-30 22:40:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_condemned_shards"
down_revision: str | None = "0008_progress_rows"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("persisted_shards", schema=None) as batch_op:
        batch_op.add_column(sa.Column("condemned", sa.String(length=500), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("persisted_shards", schema=None) as batch_op:
        batch_op.drop_column("condemned")
