"""What a streamed token costs `flare serve`'s host: CPU microseconds per token, of the API's
event loop (the process's main thread) and of every other thread (the engine with its forward).

On a GPU host at 64 streams the event loop writes an event a token, tens of thousands a second,
and shares the GIL with the engine thread: its cost per token bounds the tokens a second that
HTTP carries whatever the GPU does (docs/performance.md, "Streaming over HTTP"). This script
measures that cost on any machine: the seeded tiny Llama built eager, served by `flare serve`
on the CPU, WIDTH streams of TOKENS tokens each from client processes (stream_load.py), and the
server's per-thread CPU time (/proc/PID/task/*/stat) read before and after the load.

    python tests/bench/bench_stream_cost.py [--width 64] [--tokens 256] [--repeat 3] [--json]

Nothing asserts on time: the script prints its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from bench_serve import prepare, start_server
from stream_load import one_stream, streams

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread id."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return seconds


def loop_and_rest(
    pid: int, before: dict[int, float], after: dict[int, float]
) -> tuple[float, float]:
    """CPU seconds spent between two readings by the main thread (the event loop) and by all
    the others."""
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = spent.pop(pid, 0.0)
    return loop, sum(spent.values())


def measure(url: str, pid: int, width: int, tokens: int) -> dict[str, float]:
    prompts = [f"stream {i} asks about blobs and digests" for i in range(width)]
    before = thread_cpu(pid)
    load = streams(url, "tiny", prompts, tokens)
    loop, rest = loop_and_rest(pid, before, thread_cpu(pid))
    return {
        "tok_s": load.tok_s,
        "loop_us_per_token": 1e6 * loop / load.tokens,
        "rest_us_per_token": 1e6 * rest / load.tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flare-stream-cost-") as work:
        env, _ = prepare(Path(work))
        server, url = start_server(env)
        try:
            one_stream(url, "tiny", "a warm-up", 8)
            runs = [measure(url, server.pid, args.width, args.tokens) for _ in range(args.repeat)]
        finally:
            server.terminate()
            server.wait(timeout=60)
    report = {
        "width": args.width,
        "tokens": args.tokens,
        **{key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{args.width} streams x {args.tokens} tokens: {report['tok_s']} tok/s; CPU per token:"
            f" event loop {report['loop_us_per_token']} us, other threads"
            f" {report['rest_us_per_token']} us (median of {args.repeat})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
