"""What a streamed token costs `flare serve`'s host: CPU microseconds per token, of the API's
event loop, of the engine thread, and of the other threads.

On a GPU host at 64 streams the event loop writes an event a token, tens of thousands a second,
and shares the GIL with the engine thread: its cost per token bounds the tokens a second that
HTTP carries whatever the GPU does (docs/performance.md, "Streaming over HTTP"). This script
measures that cost on any machine: the seeded tiny Llama built eager, served by `flare serve`
on the CPU, WIDTH streams of TOKENS tokens each from client processes (stream_load.py), and the
server's CPU time by thread (/proc/PID/task/*/stat, the engine process's threads included)
read before and after the load: the API process's main thread (the event loop), the engine
thread (named flare-engine for the OS), the two threads that carry deltas between the
processes (flare-reader in the API process, flare-sender in the engine process) and the rest
(torch's threads, here running the forward).

    python tests/bench/bench_stream_cost.py [--width 64] [--tokens 256] [--repeat 3] [--json]

Nothing asserts on time: the script prints its figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from bench_serve import prepare, start_server
from stream_load import one_stream, streams

ROLES = ("event_loop", "engine", "reader", "sender", "other")


def measure(url: str, pid: int, width: int, tokens: int) -> dict[str, float]:
    prompts = [f"stream {i} asks about blobs and digests" for i in range(width)]
    load = streams(url, "tiny", prompts, tokens, pid=pid)
    assert load.cpu is not None
    figures = {"tok_s": load.tok_s}
    figures |= {f"{role}_us_per_token": 1e6 * load.cpu[role] / load.tokens for role in ROLES}
    return figures


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
        costs = ", ".join(f"{role} {report[f'{role}_us_per_token']} us" for role in ROLES)
        print(
            f"{args.width} streams x {args.tokens} tokens: {report['tok_s']} tok/s; server CPU"
            f" per token: {costs} (median of {args.repeat})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
