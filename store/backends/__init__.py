"""Where a store's files live: a local path natively, anything else through fsspec."""

from __future__ import annotations

from pathlib import Path

from flare.store.backends.base import Backend, StoredFile, TempFile
from flare.store.backends.local import LocalBackend

__all__ = ["Backend", "LocalBackend", "StoredFile", "TempFile", "open_backend"]


def open_backend(location: str | Path) -> Backend:
    """A local backend for paths and file:// URLs, fsspec for any other URL."""
    text = str(location)
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    if "://" in text:
        from flare.store.backends.remote import FsspecBackend  # fsspec costs 50 ms to import

        return FsspecBackend(text)
    return LocalBackend(Path(text).expanduser().absolute())
