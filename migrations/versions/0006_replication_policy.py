"""replication policy: per job, how agents schedule replica traffic, and an optional cap

"interleaved" (the default) sends checkpoint chunks only inside the idle spans of training's own
communication (GEMINI's Algorithm 2); "eager" sends as fast as the link allows. The optional cap bounds an
agent's replication traffic in Gbit/s under either policy. Existing jobs become "interleaved" without a cap.

Revision ID: 0006_replication_policy
Revises: 0005_replication_interval
Create Date: 2026-11-23 18:35:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_replication_policy"
down_revision: str | None = "0005_replication_interval"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "replication_policy", sa.String(length=16), nullable=False, server_default="interleaved"
            )
        )
        batch_op.add_column(sa.Column("replication_bandwidth_gbps", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("replication_bandwidth_gbps")
        batch_op.drop_column("replication_policy")
