"""The names a server's threads carry where the OS shows threads (top -H, /proc/PID/task/*/comm):
Python names its threads for itself alone, and whoever watches a busy server (top -H, the
benches' CPU per thread) needs to tell the engine from the API's event loop and the threads
that carry deltas between the server's two processes."""

from __future__ import annotations

import ctypes
import sys

ENGINE_THREAD = "flare-engine"
"""The engine's step loop (serve/engine/engine.py)."""
READER_THREAD = "flare-reader"
"""The API process's reader of the engine process's messages (serve/engine_client.py)."""
WRITER_THREAD = "flare-writer"
"""The API process's writer of requests and cancels to the engine process."""
WATCHDOG_THREAD = "flare-watchdog"
"""The API process's watch on the engine's progress (serve/engine_client.py)."""
SENDER_THREAD = "flare-sender"
"""The engine process's sender of each step's deltas (serve/engine_process.py)."""
WEIGHTS_THREAD = "flare-weights"
"""The weights' read into the model at start, beside the warm-up (serve/models/__init__.py)."""

PR_SET_NAME = 15
"""prctl's option that names the calling thread for the OS."""


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` where the OS shows threads (Linux; elsewhere nothing)."""
    if sys.platform == "linux":  # the process's own symbols include libc's prctl
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
