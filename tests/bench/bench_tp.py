"""Tensor-parallel decode on CPU: `flare serve` of one ~100M-parameter Llama built at 1, 2 and 4
ranks (the ranks as processes, gloo over loopback), one greedy stream at a time.

A fresh FLARE_HOME gets a signing key and a Llama of hidden 1024, 8 layers, 8 heads over 4 KV
heads (sane seeded weights, ~100M parameters), built with --ranks 1, 2 and 4. For each, the
server starts, answers one warm-up request, then REPEAT streamed requests of a 16-token prompt
and --tokens new tokens (ignore_eos). Reported per rank count: decode tokens/s (the tokens
after the first over the time after the first), and per step what rank zero spent in the
collectives (all-reduces and the logits' all-gather) and sending the step to the other ranks,
from /metrics; the ratio is tokens/s over the 1-rank server's, measured in the same run.

    python tests/bench/bench_tp.py [--tokens 64] [--repeat 3] [--workdir DIR] [--json]

On a host with fewer cores than ranks, more ranks are slower (they share the cores and add
collectives); the figures say what the collectives cost per step. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import log, scratch

RANKS = (1, 2, 4)
PROMPT = list(range(10, 26))


def prepare(home: Path) -> dict[str, str]:
    """A home with a signing key and the ~100M Llama built at every rank count."""
    from flare.build.tiny import make_tiny_llama

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    env["FLARE_BUILD_TARGET"] = "none"
    source = make_tiny_llama(home / "llama-100m", hidden=1024, layers=8)
    flare = [sys.executable, "-m", "flare"]
    subprocess.run([*flare, "key", "generate", "--publisher", "bench"], env=env, check=True)
    for ranks in RANKS:
        log(f"building --ranks {ranks}")
        command = [*flare, "build", str(source), "--name", "m", "--tag", f"r{ranks}"]
        subprocess.run([*command, "--ranks", str(ranks)], env=env, check=True, capture_output=True)
    return env


def metric(root: str, name: str) -> float:
    for line in httpx.get(f"{root}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def figures(root: str) -> dict[str, float]:
    return {
        "steps": metric(root, "flare_steps_total"),
        "collective": metric(root, 'flare_rank_collective_seconds_total{rank="0"}'),
        "send": metric(root, 'flare_rank_send_seconds_total{rank="0"}'),
    }


def stream(url: str, tokens: int) -> tuple[float, int]:
    """Seconds from the first streamed token to the last, and the tokens after the first."""
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    first, count = None, 0
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                count += 1
                first = first or time.perf_counter()
    assert first is not None
    return time.perf_counter() - first, count - 1


def measure(env: dict[str, str], ranks: int, tokens: int, repeat: int) -> dict[str, float]:
    command = [sys.executable, "-m", "flare", "serve", f"m:r{ranks}", "--port", "0"]
    server = subprocess.Popen(
        [*command, "--device", "cpu"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline() if server.stdout else ""
        url = line[line.index("http://") :].split()[0]
        root = url.removesuffix("/v1")
        stream(url, 8)
        before = figures(root)
        seconds, decoded = 0.0, 0
        for _ in range(repeat):
            took, count = stream(url, tokens)
            seconds, decoded = seconds + took, decoded + count
        after = figures(root)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    steps = max(after["steps"] - before["steps"], 1)
    return {
        "ranks": ranks,
        "decode_tokens_per_s": decoded / seconds,
        "collective_ms_per_step": 1000 * (after["collective"] - before["collective"]) / steps,
        "send_ms_per_step": 1000 * (after["send"] - before["send"]) / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with scratch(args.workdir, "flare-bench-tp-") as home:
        env = prepare(home)
        rows = []
        for ranks in RANKS:
            log(f"serving --ranks {ranks}")
            rows.append(measure(env, ranks, args.tokens, args.repeat))
    base = rows[0]["decode_tokens_per_s"]
    for row in rows:
        row["ratio_to_1_rank"] = row["decode_tokens_per_s"] / base
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    header = ("ranks", "decode tok/s", "vs 1 rank", "collectives/step", "send/step")
    print("{:>5} {:>13} {:>9} {:>17} {:>10}".format(*header))
    for row in rows:
        print(
            f"{row['ranks']:>5} {row['decode_tokens_per_s']:>13.1f} "
            f"{row['ratio_to_1_rank']:>8.2f}x {row['collective_ms_per_step']:>14.2f} ms "
            f"{row['send_ms_per_step']:>7.2f} ms"
        )


if __name__ == "__main__":
    main()
