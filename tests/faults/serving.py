"""A real `flare serve` for the trials, and the hostile requests sent to it (issue 13 items 1, 2,
3 and 6): each answered as documented, none harming another request in flight."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from faults.lab import Home, kill_group

if TYPE_CHECKING:
    from faults.trial import Trial

START_TIMEOUT_S = 90.0
HEALTH_LIMIT_S = 1.0
"""/health must answer within this while a huge prompt is refused (the issue asks 100 ms of an
idle machine; the soak shares two cores with other work, so it allows ten times that)."""
REFUSAL_LIMIT_S = 5.0
"""A 5 MB prompt must be refused within this (it took 9-13 s when tokenized first)."""
BIG_PROMPT_BYTES = 5 << 20


class Server:
    """A `flare serve REF --port 0` process and what it printed."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.url: str | None = None
        self.out: list[str] = []
        self.errs: list[str] = []
        self._ready = threading.Event()
        self._readers = [
            threading.Thread(target=self._read, args=(process.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(process.stderr, self.errs), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @classmethod
    @contextmanager
    def start(cls, home: Home, ref: str) -> Iterator[Server]:
        """Serve REF from the home's registry on CPU; stopped (SIGTERM, then SIGKILL) on exit."""
        args = ("serve", ref, "--port", "0", "--device", "cpu", "--kv-cache-tokens", "4096")
        server = cls(home.start(*args))
        try:
            server._wait()
            yield server
        finally:
            server.stop()

    def _read(self, stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)
            if line.startswith("serving ") and " at http" in line:
                self.url = line[line.index("http://") :].split()[0]  # then "(ready in ...)"
                self._ready.set()
        if stream is self.process.stdout:
            self._ready.set()

    def _wait(self) -> None:
        if not self._ready.wait(START_TIMEOUT_S):
            kill_group(self.process)
        if self.url is None:
            self.process.wait()
            for reader in self._readers:
                reader.join(timeout=5)

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    @property
    def err(self) -> str:
        return "".join(self.errs)

    def message(self) -> str:
        lines = [line.strip() for line in self.errs if line.strip()]
        return lines[-1] if lines else f"(no output; exit {self.returncode})"

    def stop(self) -> int | None:
        """SIGTERM (serve's documented stop) and its exit code; SIGKILL after 20 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                kill_group(self.process)
                self.process.wait()
        return self.process.returncode


@dataclass
class Answer:
    status: int
    """The HTTP status; 0 when no answer came (connection refused or reset, timeout)."""
    body: bytes
    seconds: float

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def request(url: str, payload: object | None = None, timeout: float = 60.0) -> Answer:
    """GET url, or POST payload as JSON (a lone surrogate goes as its JSON escape, valid JSON
    that decodes to an invalid string, as any JSON client sends it)."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    started = time.monotonic()
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=data, headers=headers), timeout=timeout
        ) as response:
            try:
                body = response.read()
            except http.client.IncompleteRead as exc:  # a 200 whose body broke off
                body = exc.partial + b"\n(the body broke off here)"
            return Answer(response.status, body, time.monotonic() - started)
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read(), time.monotonic() - started)
    except (OSError, http.client.HTTPException):
        return Answer(0, b"", time.monotonic() - started)


def hostile_requests(t: Trial, server: Server) -> None:
    """Every hostile request of items 1, 2, 3 and 6, then an ordinary one."""
    assert server.url is not None
    openapi(t, server.url)
    surrogates(t, server.url)
    poisoned_batch(t, server.url)
    huge_prompt(t, server.url)
    after = request(f"{server.url}/completions", _completion(max_tokens=4))
    if after.status != 200:
        t.violate(f"after the hostile requests, an ordinary completion got {after.status}", item=1)


def _completion(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "the registry keeps", "max_tokens": 12, **extra}


def openapi(t: Trial, url: str) -> None:
    """Item 6: the server describes its API at /openapi.json."""
    t.fault()
    answer = request(url.removesuffix("/v1") + "/openapi.json")
    paths = (answer.json() or {}).get("paths", {}) if answer.status == 200 else {}
    if "/v1/chat/completions" in paths:
        t.caught()
    else:
        t.violate(f"GET /openapi.json answered {answer.status} without the API's paths", item=6)


def surrogates(t: Trial, url: str) -> None:
    """Item 3: a lone surrogate in a chat message or a prompt gets a 4xx with an OpenAI error
    body."""
    cases = {
        "chat": (
            f"{url}/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]},
        ),
        "prompt": (f"{url}/completions", _completion(prompt="\udfff")),
    }
    for what, (route, payload) in cases.items():
        t.fault()
        answer = request(route, payload)
        error = (answer.json() or {}).get("error") if isinstance(answer.json(), dict) else None
        if 400 <= answer.status < 500 and isinstance(error, dict) and error.get("message"):
            t.caught()
        else:
            t.violate(
                f"a lone surrogate in the {what} got {answer.status}: {answer.body[:80]!r}", item=3
            )


POISON = [{"temperature": 1e-300}, {"temperature": 1e-45}, {"top_p": 5e-324}]


def poisoned_batch(t: Trial, url: str) -> None:
    """Item 1: six ordinary completions (one streamed) in flight beside one whose sampling
    parameter is tiny but valid: every ordinary one answers 200, the tiny one is answered
    too (it samples sanely)."""
    poison = t.rng.choice(POISON)
    answers: dict[str, Answer] = {}

    def send(key: str, payload: dict[str, Any]) -> None:
        answers[key] = request(f"{url}/completions", payload)

    jobs = {f"ordinary-{i}": _completion(temperature=0.8, seed=i) for i in range(5)}
    jobs["streamed"] = _completion(temperature=0.8, stream=True)
    jobs["poison"] = _completion(max_tokens=24, **poison)
    threads = [threading.Thread(target=send, args=item) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    t.fault()
    broken = [k for k, a in answers.items() if k != "poison" and not _answered(a, k)]
    if broken:
        t.violate(f"{poison} broke the ordinary requests beside it: {broken}", item=1)
    elif answers["poison"].status != 200:
        t.violate(f"{poison} (a valid value) got {answers['poison'].status}", item=1)
    else:
        t.caught()


def _answered(answer: Answer, key: str) -> bool:
    if answer.status != 200:
        return False
    if key == "streamed":
        return answer.body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in answer.body
    return bool((answer.json() or {}).get("choices"))


def huge_prompt(t: Trial, url: str) -> None:
    """Item 2: a 5 MB prompt is refused fast with a 4xx, and /health keeps answering within
    HEALTH_LIMIT_S meanwhile."""
    prompt = "flare " * (BIG_PROMPT_BYTES // 6)
    answers: list[Answer] = []
    sender = threading.Thread(
        target=lambda: answers.append(request(f"{url}/completions", _completion(prompt=prompt)))
    )
    health = url.removesuffix("/v1") + "/health"
    t.fault()
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        slowest = max(slowest, request(health, timeout=30).seconds)
        time.sleep(0.1)
    sender.join()
    big = answers[0]
    if not 400 <= big.status < 500:
        t.violate(f"a 5 MB prompt got {big.status}", item=2)
    elif big.seconds > REFUSAL_LIMIT_S:
        t.violate(f"a 5 MB prompt was refused after {big.seconds:.1f} s", item=2)
    elif slowest > HEALTH_LIMIT_S:
        t.violate(f"/health took {slowest:.1f} s while a 5 MB prompt was refused", item=2)
    else:
        t.caught()
