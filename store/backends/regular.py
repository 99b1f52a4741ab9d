"""Opening a store's files without blocking on, or reading, what is not a file.

Anyone who may write to a shared registry (or a broken NAS sync) can leave a FIFO, a socket or
a device node where a blob, ref or lease file belongs. A plain open(2) of a FIFO blocks until
a writer comes, which may be never, and opening a device runs its driver's open (a tape
rewinds, a watchdog arms). So a store's file is looked at first (a special file is refused
without being opened), then opened with O_NONBLOCK (a FIFO swapped in meanwhile does not
block the open) and checked once more through its descriptor before a byte is read.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

from flare.errors import IntegrityError

HINT = "it holds no stored bytes: remove it (verify moves one at a blob's name to quarantine)"


class NotAFileError(IntegrityError):
    """Something other than a file or folder (a FIFO, socket or device) where a file belongs."""

    def __init__(self, path: str | Path, mode: int) -> None:
        self.kind = kind(mode)
        super().__init__(f"{path} is {self.kind}, not a file", HINT)


def kind(mode: int) -> str:
    """What a file mode is, for people."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def is_special(mode: int) -> bool:
    """Neither a regular file nor a folder: nothing a store reads or lists as a folder."""
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def special_at(path: str | Path) -> int | None:
    """The mode of a special file at `path`; None for a file, a folder or nothing (or a
    stat that fails: the open that follows gives the authoritative answer)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return mode if is_special(mode) else None


def open_fd(path: str | Path, flags: int = os.O_RDONLY, folders: bool = False) -> int:
    """A descriptor on the regular file at `path` (or, with `folders`, on a folder there),
    opened with `flags` and O_CLOEXEC. A folder otherwise raises IsADirectoryError, as
    open(2) for reading does; a special file raises NotAFileError without being read, and a
    missing one the open's FileNotFoundError."""
    mode = special_at(path)
    if mode is not None:
        raise NotAFileError(path, mode)
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode) and not folders:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if is_special(mode):
            raise NotAFileError(path, mode)
        if not flags & os.O_NONBLOCK:  # the file's reads and locks as they would be without it
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | Path, buffering: int = -1) -> BinaryIO:
    """open(path, "rb") through `open_fd`: a binary reader of the regular file at `path`."""
    handle = open(open_fd(path), "rb", buffering=buffering)  # noqa: SIM115 (the caller's)
    raw = handle if buffering == 0 else handle.raw  # type: ignore[attr-defined]
    raw.name = str(path)  # as open(path) names it, not by its descriptor
    return handle  # type: ignore[return-value]
