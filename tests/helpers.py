"""Small helpers the tests share."""

from __future__ import annotations

import random
from pathlib import Path


def write_random(path: Path, size: int, seed: int = 0) -> bytes:
    """A file of seeded pseudo-random bytes; returns them."""
    data = random.Random(seed).randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data
