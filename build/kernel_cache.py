"""paths.kernel_cache: what tune and compile made, kept for later builds of the same shapes.

Tuning records are a lock file: a build of another package with the same shapes and toolchain
takes the recorded decisions as they are (`reused` in its phase table) instead of measuring
again, so timing noise never changes a package's digest; `--retune` measures again and
replaces them. Compiled forwards are kept the same way, so a second package of the same shapes
does not spend a minute compiling what the first did. Keys are digests of everything the
entry depends on (shapes, target, toolchain, records, flare's forward code), so an entry is
never taken for something it was not made for. The cache is local and disposable: deleting it
costs time, never correctness.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from flare.atomic import write_file_atomic
from flare.store.hashing import hash_bytes
from flare.store.package import canonical_json


def cache_key(kind: str, inputs: dict[str, Any]) -> str:
    """The hex digest naming an entry made from `inputs`."""
    return hash_bytes(canonical_json({"kind": kind, **inputs}).encode()).hex


class KernelCache:
    """Entries by kind (`tuning`, `compiled`) and key; None keeps nothing (every build makes
    its own, as `flare build --check` must)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    def path(self, kind: str, key: str, suffix: str) -> Path | None:
        """The entry's file if it is kept."""
        if self.root is None:
            return None
        path = self.root / kind / f"{key}{suffix}"
        return path if path.is_file() else None

    def keep(self, kind: str, key: str, suffix: str, source: Path) -> None:
        """Keep a copy of `source` as the entry (atomically: a reader sees all or nothing)."""
        if self.root is None:
            return
        folder = self.root / kind
        folder.mkdir(parents=True, exist_ok=True)
        if source.stat().st_size < (1 << 20):
            write_file_atomic(folder / f"{key}{suffix}", source.read_bytes())
            return
        partial = folder / f".{key}{suffix}.partial"
        shutil.copyfile(source, partial)
        partial.replace(folder / f"{key}{suffix}")
