"""A covering index on package_blobs (blob, package, size), replacing the one on blob alone.

A listing's unique sizes (bytes no other package shares) group package_blobs by blob; with
every column in the index that is one pass over it, with no table reads (SQLite, 10,000
packages: 33 ms instead of 58 ms).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_package_blobs_blob_package_size", "package_blobs", ["blob", "package", "size"]
    )
    op.drop_index("ix_package_blobs_blob", table_name="package_blobs")


def downgrade() -> None:
    op.create_index("ix_package_blobs_blob", "package_blobs", ["blob"])
    op.drop_index("ix_package_blobs_blob_package_size", table_name="package_blobs")
