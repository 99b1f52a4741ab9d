"""Opening a store's files without blocking on, or reading, what is not a file.

Anyone who may write to a shared registry (or a broken NAS sync) can leave a FIFO, a socket or
a device node where a blob, ref or lease file belongs. A plain open(2) of a FIFO blocks until
a writer comes, which may be never. So a store's file is opened with O_NONBLOCK (a FIFO's
open returns at once) and O_NOCTTY, and checked through its descriptor before a byte is read:
a special file is refused unread. (A device node's open still runs its driver's open; making
one needs root.)
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


def open_fd(path: str | Path, flags: int = os.O_RDONLY, folders: bool = False) -> int:
    """A descriptor on the regular file at `path` (or, with `folders`, on a folder there),
    opened with `flags` and O_CLOEXEC. A folder otherwise raises IsADirectoryError, as
    open(2) for reading does; a special file raises NotAFileError without being read, and a
    missing one the open's FileNotFoundError. No stat comes before the open: on sshfs a stat
    answers from the client's cache, whose stale size then cut a file another host had just
    rewritten longer (a ref record read half)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket (no open(2) takes one)
            raise NotAFileError(path, os.stat(path).st_mode) from exc
        raise
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
