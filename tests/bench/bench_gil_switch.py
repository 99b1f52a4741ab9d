"""What sharing the GIL costs a step loop: a thread shaped like the engine's (0.4 ms of Python
a step, then RELEASES calls that let go of the GIL and return at once, as a CUDA graph replay
and a wait for a device already past do) beside a thread busy in 1 ms bursts, as the API's
event loop is while it streams. Prints ms per step, alone and beside the busy thread, at
Python's default switch interval (5 ms) and at the engine's (serve/engine/engine.py).

    python tests/bench/bench_gil_switch.py [--releases 3] [--steps 500]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from flare.serve.engine.engine import GIL_SWITCH_SECONDS


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def steps(count: int, releases: int) -> float:
    """Seconds per step of the engine-shaped loop."""
    started = time.perf_counter()
    for _ in range(count):
        spin(0.4)
        for _ in range(releases):
            time.sleep(0)  # lets go of the GIL and takes it back
    return (time.perf_counter() - started) / count


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        spin(1.0)
        time.sleep(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--releases", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    for interval in (0.005, GIL_SWITCH_SECONDS):
        sys.setswitchinterval(interval)
        alone = steps(args.steps, args.releases)
        stop = threading.Event()
        neighbour = threading.Thread(target=busy, args=(stop,))
        neighbour.start()
        shared = steps(args.steps, args.releases)
        stop.set()
        neighbour.join()
        print(
            f"switch interval {interval * 1000:.2f} ms, {args.releases} releases a step: "
            f"alone {alone * 1000:.3f} ms/step, beside a busy thread {shared * 1000:.3f} ms/step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
