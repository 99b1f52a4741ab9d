"""Package names and tags: the one rule every component checks them by.

Kept apart from the manifest model so that commands which only read names (`registry ls`)
need not load pydantic.
"""

from __future__ import annotations

import re

from flare.errors import InvalidInputError

_ALL_HEX = re.compile(r"[0-9a-f]{8,}")
"""Names that would read as a digest prefix."""
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


def check_name(name: str, what: str = "package name") -> str:
    """Names and tags: lowercase letters, digits, `.`, `_`, `-`; at most 128 characters.

    `fullmatch`, not `match` with `$`, which would let a trailing newline through."""
    if not _NAME.fullmatch(name) or _ALL_HEX.fullmatch(name):
        raise InvalidInputError(
            f"bad {what} {name!r}",
            "use lowercase letters, digits, '.', '_' and '-' (max 128; not 8+ hex digits alone)",
        )
    return name
