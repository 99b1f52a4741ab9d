"""The interpreter's switch interval, shortened while threads that take the GIL back often
(between reads, copies and hash calls that let it go) run beside a busy main thread.

At the default 5 ms such a thread waits up to a whole interval each time it wants the GIL
back while the main thread imports or traces: the weights' read, and the hash of Triton's
415 MB library (4.5 s beside a start's main thread on the H200 host, py-spy, against 0.4 s
alone). Several may run at once: the interval is short from the first `quicken` until the
last `relax`, then what it was before, unless something set another meanwhile (the engine
sets its own as it starts serving, maybe before a hash nobody waited for is done)."""

from __future__ import annotations

import sys
import threading

QUICK_S = 1e-4
"""The interval while any such thread runs."""

_lock = threading.Lock()
_holders = 0
_before = 0.0
_quick = 0.0
"""The interval as `quicken` set it (read back: the interpreter keeps it in microseconds)."""


def quicken() -> None:
    """Shorten the interval until the matching `relax`."""
    global _holders, _before, _quick
    with _lock:
        if _holders == 0:
            _before = sys.getswitchinterval()
            sys.setswitchinterval(min(_before, QUICK_S))
            _quick = sys.getswitchinterval()
        _holders += 1


def relax() -> None:
    """End one `quicken`; the last one puts the interval back as it was before the first,
    where it is still the one `quicken` set."""
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0 and sys.getswitchinterval() == _quick:
            sys.setswitchinterval(_before)
