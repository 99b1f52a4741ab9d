"""The first index schema: packages, their blobs, publications (names, pins) and tags.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

DIGEST = sa.String(71)


def upgrade() -> None:
    op.create_table(
        "packages",
        sa.Column("digest", DIGEST, primary_key=True),
        sa.Column("model_id", sa.String(256), nullable=False),
        sa.Column("revision", sa.String(128)),
        sa.Column("recipe", sa.String(64), nullable=False),
        sa.Column("ranks", sa.Integer, nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "package_blobs",
        sa.Column(
            "package",
            DIGEST,
            sa.ForeignKey("packages.digest", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("blob", DIGEST, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_package_blobs_blob", "package_blobs", ["blob"])
    op.create_table(
        "publications",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column(
            "digest", DIGEST, sa.ForeignKey("packages.digest", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("created", sa.String(32), nullable=False),
        sa.Column("publisher", sa.String(256)),
        sa.Column("pinned", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.create_index("ix_publications_digest", "publications", ["digest"])
    op.create_table(
        "tags",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("tag", sa.String(128), primary_key=True),
        sa.Column("digest", DIGEST, nullable=False),
    )
    op.create_index("ix_tags_digest", "tags", ["digest"])


def downgrade() -> None:
    for table in ("tags", "publications", "package_blobs", "packages"):
        op.drop_table(table)
