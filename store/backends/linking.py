"""Sharing bytes between files instead of copying them: reflinks, then hardlinks."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

FICLONE = 0x40049409
"""ioctl(2) request that makes the destination share the source's extents (Linux)."""

_CANNOT_SHARE = {
    errno.EXDEV,
    errno.EOPNOTSUPP,
    errno.ENOTTY,
    errno.EINVAL,
    errno.EPERM,
    errno.EMLINK,
}


def reflink(source_fd: int, dest_fd: int) -> bool:
    """Clone the source's extents into the (empty) destination; False where unsupported."""
    try:
        fcntl.ioctl(dest_fd, FICLONE, source_fd)
    except OSError as exc:
        if exc.errno in _CANNOT_SHARE or exc.errno == errno.ENOSYS:
            return False
        raise
    return True


def hardlink(source: Path, dest: Path) -> bool:
    """Give the source a second name; False where the filesystem or policy refuses."""
    try:
        os.link(source, dest)
    except OSError as exc:
        if exc.errno in _CANNOT_SHARE:
            return False
        raise
    return True
