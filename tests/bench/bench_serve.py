"""Load benchmark of `flare serve`: concurrent streaming clients against the tiny model on CPU.

A fresh FLARE_HOME gets a signing key, the seeded tiny Llama is built and published, and
`flare serve` runs it as a separate process. C clients (default 32) each send streaming chat
requests with the official `openai` client, one after another, for D seconds (default 60).
Reported: requests/s, completion tokens/s, time to first token p50/p99, errors, and the
server's resident memory after warm-up and at the end (it must stay flat).

Baseline, timed in the same run: transformers `generate` on the same checkpoint, greedy, one
request at a time, the same prompts and token counts, for the same number of requests that a
single client completes; the ratio is flare's tokens/s over transformers' tokens/s.

    python tests/bench/bench_serve.py [--clients 32] [--seconds 60] [--max-tokens 32]
        [--workdir DIR] [--json]

Nothing asserts on time: the script prints its figures (and PASS/MISS for zero errors and
flat memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import log, scratch

PROMPTS = [
    "what does the registry keep?",
    "how does a build resume?",
    "tell me about blobs and digests.",
    "who signs a package?",
]
FLAT_GROWTH = 0.10
"""Resident memory may grow this much after warm-up and still count as flat."""


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def prepare(home: Path) -> tuple[dict[str, str], Path]:
    """A home with a signing key and the tiny model built; returns the env and the source."""
    from flare.build.tiny import make_tiny_llama

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages, as the recorded figures were
    source = make_tiny_llama(home / "tiny-llama")
    flare = [sys.executable, "-m", "flare"]
    for args in (("key", "generate", "--publisher", "bench"), ("build", source, "--name", "tiny")):
        run_in(env, *flare, *args)
    return env, source


def run_in(env: dict[str, str], *args: str | Path) -> None:
    """Run a command in env; fail loudly with its stderr."""
    done = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed: {done.stderr.strip()}")


def start_server(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """`flare serve tiny` on a free port; returns the process and its base URL."""
    server = subprocess.Popen(
        [sys.executable, "-m", "flare", "serve", "tiny", "--port", "0", "--device", "cpu"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = server.stdout.readline() if server.stdout else ""
    if "http://" not in line:
        server.kill()
        raise RuntimeError(f"flare serve did not start: {line}{server.stderr.read()}")
    return server, line[line.index("http://") :].split()[0]


async def client(url: str, until: float, max_tokens: int, index: int, results: list) -> None:
    """One user: streaming chat requests back to back until the deadline."""
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    turn = 0
    while time.monotonic() < until:
        started, first, tokens, error = time.monotonic(), None, 0, None
        try:
            stream = await api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": PROMPTS[(index + turn) % len(PROMPTS)]}],
                max_tokens=max_tokens,
                temperature=0.8,
                seed=index * 1000 + turn,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
        except Exception as exc:  # every failure is counted, none stops the run
            error = repr(exc)
        results.append((started, first, time.monotonic(), tokens, error))
        turn += 1
    await api.close()


async def load(url: str, clients: int, seconds: float, max_tokens: int, server_pid: int) -> dict:
    results: list = []
    start = time.monotonic()
    until = start + seconds
    memory: list[tuple[float, int]] = []

    async def sample_memory() -> None:
        while time.monotonic() < until:
            memory.append((time.monotonic() - start, rss_bytes(server_pid)))
            await asyncio.sleep(1.0)

    await asyncio.gather(
        sample_memory(),
        *(client(url, until, max_tokens, i, results) for i in range(clients)),
    )
    elapsed = time.monotonic() - start
    done = [r for r in results if r[4] is None]
    ttft = sorted((r[1] - r[0]) for r in done if r[1] is not None)
    warm = [m for t, m in memory if t >= seconds * 0.2]
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests": len(done),
        "errors": len(results) - len(done),
        "error_examples": sorted({r[4] for r in results if r[4]})[:3],
        "requests_per_s": round(len(done) / elapsed, 2),
        "tokens_per_s": round(sum(r[3] for r in done) / elapsed, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1) if ttft else None,
        "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))], 1)
        if ttft
        else None,
        "rss_after_warmup_mib": round(warm[0] / 2**20, 1) if warm else None,
        "rss_end_mib": round(warm[-1] / 2**20, 1) if warm else None,
        "rss_max_mib": round(max(warm) / 2**20, 1) if warm else None,
    }


def transformers_baseline(source: Path, requests: int, max_tokens: int) -> float:
    """Tokens/s of transformers' greedy `generate`, one request at a time, same prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tokens, started = 0, time.perf_counter()
    with torch.inference_mode():
        for turn in range(requests):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": PROMPTS[turn % len(PROMPTS)]}],
                add_generation_prompt=True,
                tokenize=False,
            )
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
            tokens += out.shape[1] - ids.shape[1]
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with scratch(args.workdir, "flare-bench-serve-") as work:
        env, source = prepare(work)
        server, url = start_server(env)
        log(f"server at {url}; {args.clients} clients for {args.seconds:.0f} s")
        try:
            figures = asyncio.run(
                load(url, args.clients, args.seconds, args.max_tokens, server.pid)
            )
        finally:
            server.terminate()
            figures["server_exit"] = server.wait(timeout=120)
        baseline_requests = max(4, figures["requests"] // args.clients)
        log(f"transformers baseline: {baseline_requests} requests")
        baseline = transformers_baseline(source, baseline_requests, args.max_tokens)
    figures["transformers_tokens_per_s"] = round(baseline, 1)
    figures["ratio_vs_transformers"] = round(figures["tokens_per_s"] / baseline, 2)
    growth = (figures["rss_end_mib"] or 0) / (figures["rss_after_warmup_mib"] or 1) - 1
    figures["memory_flat"] = growth <= FLAT_GROWTH
    print_figures(figures, args.json)


def print_figures(figures: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(figures, indent=2))
        return
    for key, value in figures.items():
        print(f"{key:28} {value}")
    print(f"{'zero errors':28} {'PASS' if figures['errors'] == 0 else 'MISS'}")
    print(f"{'memory flat after warm-up':28} {'PASS' if figures['memory_flat'] else 'MISS'}")


if __name__ == "__main__":
    main()
