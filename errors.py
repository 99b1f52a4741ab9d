"""Errors every flare component raises, each with an exit code a script can tell apart.

A shared module at the top of the package: every component, from store/ up to the
commands, raises these, and it imports nothing of flare.
"""

from __future__ import annotations

import errno
from pathlib import Path


class FlareError(Exception):
    """A failure the user can act on: printed as one line, never with a traceback."""

    exit_code = 1

    def __init__(self, what: str, hint: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.what}; {self.hint}" if self.hint else self.what


class NotFoundError(FlareError):
    """A file, blob or reference that does not exist."""

    exit_code = 3


class InvalidInputError(FlareError):
    """Malformed input: a bad digest, prefix, setting or argument."""

    exit_code = 4


class AmbiguousError(FlareError):
    """A prefix that names more than one object."""

    exit_code = 5


class IntegrityError(FlareError):
    """Bytes that do not match their digest, or a source that changed while it was read."""

    exit_code = 6


class PermissionDeniedError(FlareError):
    """The operating system refused access to a path."""

    exit_code = 7


class NoSpaceError(FlareError):
    """The filesystem ran out of space or quota."""

    exit_code = 8


_ERRNO_CLASSES: dict[int, type[FlareError]] = {
    errno.ENOENT: NotFoundError,
    errno.ENOTDIR: NotFoundError,
    errno.EACCES: PermissionDeniedError,
    errno.EPERM: PermissionDeniedError,
    errno.EROFS: PermissionDeniedError,
    errno.ENOSPC: NoSpaceError,
    errno.EDQUOT: NoSpaceError,
}

_ERRNO_HINTS: dict[type[FlareError], str] = {
    NotFoundError: "check the path",
    PermissionDeniedError: "check the owner and mode of the path",
    NoSpaceError: "free space on that filesystem or point the store elsewhere; nothing was stored",
}


def from_os_error(exc: OSError, action: str, path: str | Path) -> FlareError:
    """Turn an OSError into the FlareError a user reads: what failed, where, and what to do."""
    cls = _ERRNO_CLASSES.get(exc.errno or 0, FlareError)
    reason = exc.strerror or str(exc)
    return cls(f"cannot {action} {path}: {reason}", _ERRNO_HINTS.get(cls, ""))
