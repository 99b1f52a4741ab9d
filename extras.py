"""flare's optional dependencies (pip extras) and how a user adds one.

pip knows flare as DISTRIBUTION, not as `flare`: that name on PyPI is another project, so a
hint that named `flare[serve]` installed someone else's package. Every install hint is
written here, once.
"""

from __future__ import annotations

DISTRIBUTION = "flare-llm"
"""The distribution name in pyproject.toml; the import name and the command stay `flare`."""


def install_hint(extra: str) -> str:
    """The command that adds `extra` to the flare installed here (pip finds the installed
    distribution by its name, also an editable install from a clone, and adds only what the
    extra needs)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
