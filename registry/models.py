"""The index DB's tables. Everything here can be rebuilt from the store (`reindex`)."""

from __future__ import annotations

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

DIGEST = String(71)
"""`blake3:` and 64 hex digits."""


class Base(DeclarativeBase):
    pass


class Package(Base):
    """A package index: what the manifest says, once per digest."""

    __tablename__ = "packages"

    digest: Mapped[str] = mapped_column(DIGEST, primary_key=True)
    model_id: Mapped[str] = mapped_column(String(256))
    revision: Mapped[str | None] = mapped_column(String(128))
    recipe: Mapped[str] = mapped_column(String(64))
    ranks: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(BigInteger)
    """Bytes of the index and every blob it names."""


class Blob(Base):
    """A blob a package needs (its index included), with its size."""

    __tablename__ = "package_blobs"

    package: Mapped[str] = mapped_column(
        DIGEST, ForeignKey("packages.digest", ondelete="CASCADE"), primary_key=True
    )
    blob: Mapped[str] = mapped_column(DIGEST, primary_key=True, index=True)
    size: Mapped[int] = mapped_column(BigInteger)


class Publication(Base):
    """A package published under a name."""

    __tablename__ = "publications"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(
        DIGEST, ForeignKey("packages.digest", ondelete="CASCADE"), primary_key=True
    )
    created: Mapped[str] = mapped_column(String(32))
    publisher: Mapped[str | None] = mapped_column(String(256))
    pinned: Mapped[bool] = mapped_column(default=False)

    __table_args__ = (Index("ix_publications_digest", "digest"),)


class Tag(Base):
    """NAME:TAG → digest."""

    __tablename__ = "tags"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    tag: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(DIGEST, index=True)
