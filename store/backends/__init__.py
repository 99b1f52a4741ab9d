"""Where a store's files live: a local path natively, anything else through fsspec."""

from __future__ import annotations

import os
from pathlib import Path

from flare.store.backends.base import Backend, StoredFile, TempFile
from flare.store.backends.local import LocalBackend

__all__ = [
    "Backend",
    "LocalBackend",
    "StoredFile",
    "TempFile",
    "normalize_location",
    "open_backend",
]


def normalize_location(location: str | Path) -> str:
    """One spelling per store: a path or a `file://` URL becomes an absolute path (`~`
    expanded, `..` and trailing slashes gone), another URL loses its trailing slashes. Every
    store location (the config's, an option's) passes here, so that two spellings of one
    folder are one store, and so one registry with one index DB."""
    text = str(location)
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    if "://" in text:
        scheme, rest = text.split("://", 1)
        return f"{scheme}://{rest.rstrip('/')}"
    return os.path.abspath(os.path.expanduser(text))


def open_backend(location: str | Path) -> Backend:
    """A local backend for paths and file:// URLs, fsspec for any other URL."""
    text = normalize_location(location)
    if "://" in text:
        from flare.store.backends.remote import FsspecBackend  # fsspec costs 50 ms to import

        return FsspecBackend(text)
    return LocalBackend(Path(text))
