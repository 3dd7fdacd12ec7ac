"""persist schedule: the iteration the root announced for every rank to persist

The root chooses which iteration every rank uploads to the persistent tier (a multiple of persist_every),
with the plan generation it was announced in; the next one is announced once it is complete or given up.

Revision ID: 0007_persist_schedule
Revises: 0006_replication_policy
Create Date: 2026-11-23 19:05:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_persist_schedule"
down_revision: str | None = "0006_replication_policy"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("persist_iteration", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("persist_generation", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("persist_generation")
        batch_op.drop_column("persist_iteration")
