"""What a store reports about itself: the outcome of a verify pass, and what it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from flare.store.digest import Digest


@dataclass
class VerifyReport:
    """The outcome of re-hashing blobs."""

    checked: int = 0
    checked_bytes: int = 0
    corrupt: list[Digest] = field(default_factory=list)
    missing: list[Digest] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    """Where each corrupt blob went (empty with dry_run: nothing moves)."""
    reread: list[Digest] = field(default_factory=list)
    """Blobs whose first read hashed wrong but whose bytes as stored hash right (a stale or
    torn read through a client's cache): intact, left in place, reported."""
    restored: list[str] = field(default_factory=list)
    """Quarantined files that hash right now, put back under their blob names."""
    stray: list[str] = field(default_factory=list)
    """Files under blobs/ whose names are not blob names (left in place, reported)."""
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return not (self.corrupt or self.missing)


@dataclass(frozen=True)
class StoreUsage:
    """What a store holds, in bytes as kept on disk."""

    blobs: int
    stored_bytes: int
    temp_bytes: int
    quarantine_bytes: int
    trash_bytes: int
    free_bytes: int | None
