"""web sessions: server-side, revocable sessions of the status pages

Revision ID: 0002_sessions
Revises: 0001
Create Date: 2026-11-23 12:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import services.root.db.models

revision: str = '0002_sessions'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('web_sessions',
    sa.Column('id_hash', sa.String(length=64), nullable=False),
    sa.Column('token_fingerprint', sa.String(length=64), nullable=False),
    sa.Column('created_at', services.root.db.models.UtcDateTime(timezone=True), nullable=False),
    sa.Column('expires_at', services.root.db.models.UtcDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id_hash', name=op.f('pk_web_sessions'))
    )
    with op.batch_alter_table('web_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_web_sessions_expires_at'), ['expires_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('web_sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_web_sessions_expires_at'))

    op.drop_table('web_sessions')
