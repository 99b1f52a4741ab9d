"""The files under a folder, as `BlobStore.put_tree` (and so `flare store put`) takes them:
regular files, links followed, in one sorted order whatever the filesystem lists first."""

from __future__ import annotations

import os
from pathlib import Path

from flare.errors import FlareError, NotFoundError, from_os_error


def list_tree(root: Path) -> list[str]:
    """Every regular file under a folder (following links), as sorted relative POSIX paths."""
    if not root.is_dir():
        if not root.exists():
            raise NotFoundError(f"no such folder: {root}", "check the path")
        raise FlareError(f"not a folder: {root}", "pass a folder, or the file itself")
    found = []
    for dirpath, _dirs, files in os.walk(root, followlinks=True, onerror=_raise_walk_error):
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / name).as_posix() for name in files)
    return sorted(found)


def _raise_walk_error(exc: OSError) -> None:
    raise from_os_error(exc, "list", exc.filename)
