"""Small files written whole or not at all, and the temp names that make that possible.

A shared module at the top of the package: config, trust policies, keys, journals and the
store's backends all write small files that a crash must leave either old or new, never half
written, so the one way to do it lives below all of them.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from flare.errors import from_os_error


def fsync_dir(path: Path) -> None:
    """Make a rename or link inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write a small file durably: temp file beside it, fsync, rename, fsync the folder."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{temp_name()}")
        try:
            with open(partial, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        fsync_dir(path.parent)
    except OSError as exc:
        raise from_os_error(exc, "write", path) from exc


def temp_name() -> str:
    """A unique temp file name that says which host and process writes it."""
    return f"{host_name()}.{os.getpid()}.{secrets.token_hex(8)}.part"


def host_name() -> str:
    """This host as temp names spell it (no dots: they separate a temp name's fields), so a
    sweep can tell its own host's temp files from another's."""
    return socket.gethostname().replace(".", "_") or "host"
