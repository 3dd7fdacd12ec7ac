"""metric totals: what deleted or folded failure events had added to the /metrics counters

/metrics counted failures, recoveries, iterations lost and the recovery histograms over the failure events
in the database: deleting a job (its events go with it) or folding a process exit into a machine's loss
made those counters go down, which Prometheus reads as a reset (a spike in rate() and increase()). The
rows' contributions are added to this table as they go, and the scrape adds them back. Existing databases
start it empty: what was deleted before is gone.

Revision ID: 0011_metric_totals
Revises: 0010_agent_sessions
Create Date: 2026-12-01 02:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_metric_totals"
down_revision: str | None = "0010_agent_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "metric_totals",
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("label", sa.String(length=64), nullable=False),
        sa.Column("le", sa.String(length=16), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("metric", "label", "le", name=op.f("pk_metric_totals")),
    )


def downgrade() -> None:
    op.drop_table("metric_totals")
