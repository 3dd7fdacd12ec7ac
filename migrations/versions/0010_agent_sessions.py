"""agent sessions: the registering agent process's random id on its machine

A registration the agent sends again (its answer was lost: a read timeout, a root replica restarting) is
not an agent restart when it carries the same id: before, the retry recorded a software failure ("the
agent of machine N restarted"), and during a recovery that counted as the recovery failing.

Revision ID: 0010_agent_sessions
Revises: 0009_condemned_shards
Create Date: 2026-11-30 22:50:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_agent_sessions"
down_revision: str | None = "0009_condemned_shards"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_session", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("machines", schema=None) as batch_op:
        batch_op.drop_column("agent_session")
