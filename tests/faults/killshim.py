"""Run `flare` and SIGKILL it at a point inside flare that `FLARE_CRASH_AT` does not offer.

    SOAK_KILL_AT=MODULE:ATTR[.ATTR]:before|after[:N] python killshim.py FLARE-ARGS...

kills the process the N-th time (default first) the named function is called, before it runs
or right after it returns, exactly as a dead host would: no handler, no cleanup. The process
is the real `flare` command; only the moment of death is chosen. Used for the windows a kill at
a random time rarely hits (between two statements that must go together).
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def kill_at(spec: str) -> None:
    """Wrap the function SPEC names so that the N-th call kills this process."""
    module_name, path, when, *count = spec.split(":")
    if when not in ("before", "after"):
        raise SystemExit(f"killshim: {spec!r}: say before or after")
    target = int(count[0]) if count else 1
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    original: Callable[..., Any] = getattr(owner, attr)
    calls = 0

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == target and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls == target and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, attr, wrapper)


def main() -> None:
    sys.path.remove(os.path.dirname(os.path.abspath(__file__)))  # its neighbours are not flare's
    spec = os.environ.get("SOAK_KILL_AT")
    if spec:
        kill_at(spec)
    from flare.__main__ import main as flare_main

    sys.argv = ["flare", *sys.argv[1:]]
    flare_main()


if __name__ == "__main__":
    main()
