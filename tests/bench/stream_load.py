"""Streamed completions as a load: N concurrent streams from client processes, each stream's
tokens counted from the server's own usage figures, not from its events.

Why not threads in the bench process, counting `data:` lines: a server whose event loop falls
behind its engine joins the deltas of one request into one event (serve/engine/output.py), so
a line is not a token, and counting lines under-reports exactly the fastest servers; and one
Python process parsing 64 streams holds a GIL that the load then measures as well. Here each
client process runs its share of the streams on its own event loop, every stream asks for its
usage (`stream_options.include_usage`), and the streams of all processes start together
(each process, up and connected, waits at one barrier), so the total rate is the tokens of
all over the span from the first start to the last end; `start_spread_s` says how far apart
the first and the last stream started.

    from stream_load import completion_body, one_stream, streams
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

PROCESSES = 8
"""Client processes at most (each runs width / PROCESSES streams on one event loop)."""
READY_TIMEOUT_S = 120.0
"""How long a client process waits at the barrier for the others to be up."""
RESULT_TIMEOUT_S = 900.0
"""How long the bench waits for a client process's streams to end."""
ENGINE_THREAD = "flare-engine"
READER_THREAD = "flare-reader"
SENDER_THREAD = "flare-sender"
"""The OS names of the server's engine thread (serve/engine/engine.py) and of the threads
that carry deltas between its two processes (serve/engine_process.py)."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Streamed:
    """One stream: the tokens the server says it generated, and wall-clock instants (time.time,
    comparable across processes) of its request, its first event and its end."""

    tokens: int
    started: float
    first: float
    ended: float

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time after the first."""
        return (self.tokens - 1) / max(self.ended - self.first, 1e-9)


async def _stream(client: object, url: str, body: dict) -> Streamed:
    started, first, tokens = time.time(), None, None
    async with client.stream("POST", f"{url}/completions", json=body, timeout=900) as reply:  # type: ignore[attr-defined]
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            first = first or time.time()
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    if tokens is None:
        raise RuntimeError(f"a stream from {url} ended without its usage")
    ended = time.time()
    return Streamed(tokens, started, first or ended, ended)


def completion_body(name: str, prompt: str, tokens: int) -> dict:
    """A streamed greedy completion of `tokens` tokens (end of sequence ignored) that ends
    with its usage."""
    return {
        "model": name,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _share(url: str, bodies: list[dict], ready: Barrier | None) -> list[Streamed]:
    import httpx

    limits = httpx.Limits(max_connections=len(bodies) + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        (await client.get(f"{url}/models")).raise_for_status()  # the client's first-use costs
        if ready is not None:
            ready.wait(READY_TIMEOUT_S)  # nothing else runs on this loop yet
        return await asyncio.gather(*(_stream(client, url, body) for body in bodies))


def _client(url: str, bodies: list[dict], ready: Barrier, results: Queue) -> None:
    """A client process: its streams, started once every client process is ready; its
    results, or its error, go to `results`."""
    try:
        results.put(asyncio.run(_share(url, bodies, ready)))
    except BaseException as exc:
        results.put(RuntimeError(f"a client process failed: {type(exc).__name__}: {exc}"))
        raise


def one_stream(url: str, name: str, prompt: str, tokens: int) -> Streamed:
    """One streamed completion, in this process."""
    return asyncio.run(_share(url, [completion_body(name, prompt, tokens)], None))[0]


def thread_cpu(pid: int) -> dict[Path, tuple[str, float]]:
    """Every thread of the server `pid` and of its child processes (the engine process): its
    role and the CPU seconds it has spent. Roles: the API's main thread (its event loop), the
    engine thread, the threads that carry deltas between the two processes (the API's reader,
    the engine's sender), and every other thread."""
    threads = {}
    for task in _tasks(pid):
        try:
            name = (task / "comm").read_text().strip()
            seconds = _on_cpu(task)
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        role = "event_loop" if task.name == str(pid) else THREAD_ROLES.get(name, "other")
        threads[task] = (role, seconds)
    return threads


def server_cpu(pid: int, before: dict[Path, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds by role since `before` (thread_cpu's): a thread alive at both reads counts
    its difference, a new one all it spent; one that ended in between is left out (what it
    spent after `before` is lost with it, rather than all it ever spent subtracted)."""
    spent = dict.fromkeys(("event_loop", "engine", "reader", "sender", "other"), 0.0)
    for task, (role, seconds) in thread_cpu(pid).items():
        spent[role] += seconds - before.get(task, (role, 0.0))[1]
    return spent


def _on_cpu(task: Path) -> float:
    """A thread's time on a CPU: the scheduler's own count in nanoseconds (schedstat), else
    user + system time in clock ticks (stat), which charges a whole 10 ms tick to whichever
    thread the tick finds running and so blurs threads that run briefly and often."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except FileNotFoundError:
        if not task.exists():
            raise
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


THREAD_ROLES = {ENGINE_THREAD: "engine", READER_THREAD: "reader", SENDER_THREAD: "sender"}


def _tasks(pid: int) -> list[Path]:
    """Every thread of `pid` and of its descendants."""
    tasks = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        tasks.append(task)
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in children:
            tasks += _tasks(int(child))
    return tasks


@dataclass(frozen=True)
class Load:
    """What `width` concurrent streams gave, and (with the server's pid) the server's CPU
    seconds by role over the load."""

    width: int
    tokens: int
    seconds: float
    first_token_s: float
    start_spread_s: float
    """From the first stream's start to the last's: near zero where the load was concurrent."""
    cpu: dict[str, float] | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def report(self) -> dict[str, float]:
        out = {
            "tok_s": round(self.tok_s, 1),
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "median_first_token_s": round(self.first_token_s, 4),
            "start_spread_s": round(self.start_spread_s, 4),
        }
        for role, seconds in (self.cpu or {}).items():
            out[f"{role}_cpu_us_per_token"] = round(1e6 * seconds / self.tokens, 1)
            out[f"{role}_busy"] = round(seconds / self.seconds, 2)
        return out


def streams(url: str, name: str, prompts: list[str], tokens: int, pid: int | None = None) -> Load:
    """All `prompts` streamed at once (`tokens` each, end of sequence ignored) from up to
    PROCESSES client processes (spawned: the bench process may hold a CUDA context); with the
    server's `pid`, its CPU time by role over the load (`server_cpu`)."""
    before = thread_cpu(pid) if pid is not None else None
    bodies = [completion_body(name, prompt, tokens) for prompt in prompts]
    processes = min(PROCESSES, len(bodies))
    context = multiprocessing.get_context("spawn")
    ready, results = context.Barrier(processes), context.Queue()
    clients = [
        context.Process(target=_client, args=(url, bodies[i::processes], ready, results))
        for i in range(processes)
    ]
    for client in clients:
        client.start()
    done = [results.get(timeout=RESULT_TIMEOUT_S) for _ in clients]
    for client in clients:
        client.join()
    failed = [share for share in done if isinstance(share, Exception)]
    if failed:
        raise failed[0]
    cpu = None
    if pid is not None and before is not None:
        cpu = server_cpu(pid, before)
    every = [s for share in done for s in share]
    starts = [s.started for s in every]
    span = max(s.ended for s in every) - min(starts)
    firsts = sorted(s.first - s.started for s in every)
    median_first = firsts[len(firsts) // 2]
    spread = max(starts) - min(starts)
    return Load(len(every), sum(s.tokens for s in every), span, median_first, spread, cpu)
