"""The first token of a burst: WIDTH streamed requests sent at once to `flare serve`, and
where the API process's event loop spends its time while it admits them.

The seeded tiny Llama is built eager into a fresh FLARE_HOME and served on the CPU; each
burst comes from client processes that start at one instant (stream_load.py), each request
asking for TOKENS tokens. Reported per width: the median first-token time of each of REPEAT
bursts, and the event loop's CPU microseconds per streamed token. With `--profile FILE`,
py-spy records the server process (raw, collapsed stacks) while bursts of the widest width
run for `--profile-seconds`; the script then prints the event loop's busiest frames.

    python tests/bench/bench_api_burst.py [--widths 16,64] [--tokens 4] [--repeat 3]
        [--profile FILE] [--profile-seconds 20]

Nothing asserts on time: the script prints its figures.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from bench_serve import prepare, start_server
from stream_load import one_stream, streams

MAIN_THREAD_MARK = "serve_command"
"""A frame only the server's main thread (its event loop) has in its stacks."""


def burst_prompts(width: int) -> list[str]:
    return [f"burst {i} asks about blobs" for i in range(width)]


def measure(url: str, pid: int, width: int, tokens: int, repeat: int) -> dict[str, object]:
    firsts, loop_us = [], []
    for _ in range(repeat):
        load = streams(url, "tiny", burst_prompts(width), tokens, pid=pid)
        firsts.append(round(1000 * load.first_token_s, 1))
        loop_us.append(load.report()["event_loop_cpu_us_per_token"])
    return {"width": width, "median_first_token_ms": firsts, "event_loop_us_per_token": loop_us}


def profile(url: str, pid: int, width: int, tokens: int, out: Path, seconds: float) -> None:
    """py-spy on the server while bursts of `width` run back to back."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    command = [spy, "record", "-p", str(pid), "-o", str(out), "-f", "raw", "-r", "500"]
    recorder = subprocess.Popen(
        [*command, "-d", str(int(seconds) + 5)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        streams(url, "tiny", burst_prompts(width), tokens)
    recorder.wait()


def busiest_frames(raw: Path, top: int = 30) -> list[tuple[float, str]]:
    """The event loop's functions by the share of its samples they appear in, leaving out
    those in every sample (the start-up frames under the loop, and the loop's own run)."""
    within: Counter[str] = Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if MAIN_THREAD_MARK not in stack:
            continue
        samples += int(count)
        for function in {frame.split(" (")[0] for frame in stack.split(";")}:
            within[function] += int(count)
    shares = [(n / samples, function) for function, n in within.most_common()]
    return [(share, function) for share, function in shares if share < 1][:top]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="16,64")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--profile-seconds", type=float, default=20.0)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    with tempfile.TemporaryDirectory(prefix="flare-api-burst-") as work:
        env, _ = prepare(Path(work))
        server, url = start_server(env)
        try:
            one_stream(url, "tiny", "a warm-up", 4)
            for width in widths:
                print(measure(url, server.pid, width, args.tokens, args.repeat))
            if args.profile is not None:
                seconds = args.profile_seconds
                profile(url, server.pid, max(widths), args.tokens, args.profile, seconds)
        finally:
            server.terminate()
            server.wait(timeout=60)
    if args.profile is not None:
        for share, frame in busiest_frames(args.profile):
            print(f"{share:6.1%}  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
