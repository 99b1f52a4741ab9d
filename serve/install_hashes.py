"""Triton's hash of its own install, made on a thread of its own early in a GPU start.

Triton keys every kernel it loads with a hash of its sources and of its 415 MB library,
made once a process, at the first kernel loaded: in a start, as the package's compiled
graphs load, on the main thread, on the path to ready (0.42 s of their 1.1 s in an 8B
start's py-spy on the H200). Made here beside the start's imports and weights' read instead,
mostly outside the GIL (hashlib lets it go for large buffers; the interval is short while it
runs: switching.py). `wait` before the first kernel loads, so that the main thread does not
hash the library a second time."""

from __future__ import annotations

import threading

from flare.serve import switching

_thread: threading.Thread | None = None


def start() -> None:
    """Begin hashing (once a process), where Triton is installed. Import Triton first: the
    hash walks its packages, importing any not imported yet, which no other thread may be
    importing at the same time."""
    global _thread
    if _thread is not None:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no Triton (a CPU build of torch): no kernel of its is loaded
        return

    def run() -> None:
        try:
            triton_key()
        finally:
            switching.relax()

    switching.quicken()
    _thread = threading.Thread(target=run, name="flare-triton-hash", daemon=True)
    _thread.start()


def wait() -> None:
    """Return once the hash `start` began is made (at once where none was begun)."""
    if _thread is not None:
        _thread.join()
