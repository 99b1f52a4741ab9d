"""The one error a signature check raises, with its own exit code so scripts can tell an
untrusted package (11) from a corrupt (6) or missing (3) one."""

from __future__ import annotations

from flare.errors import FlareError


class UntrustedError(FlareError):
    """A package that is unsigned, signed by an unknown or revoked key, or whose signature
    does not verify, is malformed, or was made for other bytes."""

    exit_code = 11
