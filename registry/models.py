"""The index DB's tables. Everything here can be rebuilt from the store (`reindex`).

SQLAlchemy Core tables, not ORM classes: the registry reads and writes rows, never object
graphs, and importing the ORM costs every command about 50 ms of start-up.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    false,
)

DIGEST = String(71)
"""`blake3:` and 64 hex digits."""

metadata = MetaData()

# A package index: what the manifest says, once per digest.
packages = Table(
    "packages",
    metadata,
    Column("digest", DIGEST, primary_key=True),
    Column("model_id", String(256), nullable=False),
    Column("revision", String(128)),
    Column("recipe", String(64), nullable=False),
    Column("ranks", Integer, nullable=False),
    Column("size", BigInteger, nullable=False),  # bytes of the index and every blob it names
)

# A blob a package needs (its index included), with its size.
package_blobs = Table(
    "package_blobs",
    metadata,
    Column(
        "package",
        DIGEST,
        ForeignKey("packages.digest", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("blob", DIGEST, primary_key=True),
    Column("size", BigInteger, nullable=False),
    # Covering: a listing's unique sizes are one pass over it, in blob order, with no row reads.
    Index("ix_package_blobs_blob_package_size", "blob", "package", "size"),
)

# A package published under a name.
publications = Table(
    "publications",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("digest", DIGEST, ForeignKey("packages.digest", ondelete="CASCADE"), primary_key=True),
    Column("created", String(32), nullable=False),
    Column("publisher", String(256)),
    Column("pinned", Boolean, nullable=False, server_default=false()),
    Index("ix_publications_digest", "digest"),
)

# NAME:TAG -> digest.
tags = Table(
    "tags",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("tag", String(128), primary_key=True),
    Column("digest", DIGEST, nullable=False, index=True),
)
