"""One request can never fail another, over the real HTTP API of a real runtime (a tiny random
Llama served from a thread on loopback).

A value the schema accepts must sample sanely in a full batch: six requests in flight, one of
them with a temperature or top_p as small as a float gets, all answer, the tiny one greedily.
Where a sequence's own processing does fail (a fault injected into the real sampler), that
request alone ends with an OpenAI error (a 500, or an SSE error event then [DONE]), its KV
pages are freed and counted as a failure, and the five beside it answer as if alone. A
forward that fails (a fault injected into the real model runner) fails its own batch only,
and the engine goes on serving; so does a fault of the engine itself (injected into the real
block manager), which fails what is in flight but never stops the engine."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import torch
from checkpoints import make_llama
from test_runtime import Package, build_package

from flare.serve.api import ServedPackage, create_app
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import FreshTokens, ModelRunner, StepLogits
from flare.serve.engine.sampler import Picked, RowMaxima, Sampled, Sampler
from flare.serve.engine.sequence import Sequence
from flare.serve.runtime import (
    GenerateRuntime,
    RequestFailed,
    RequestHandle,
    SamplingParams,
    load_runtime,
)
from flare.serve.server import background_server

PROMPTS = [
    "the registry keeps packages",
    "every blob is named by",
    "a server pulls and verifies",
    "the quick brown fox jumps over",
    "flare builds packages from checkpoints",
    "nothing is trusted by name",
]
TOKENS = 24
FAIL_SAMPLING_SEED = 13
"""A request with this seed fails while its third token is sampled (the injected fault)."""
FAIL_FORWARD_SEED = 14
"""A prefill batch holding a request with this seed fails in the forward (the injected fault)."""
FAIL_LOGITS_SEED = 15
"""A request with this seed gets a NaN in its logits for its third token (the injected fault)."""
NAN_MESSAGE = "ValueError: the model's logits for this request hold NaN or infinity"


class FaultySampler(Sampler):
    """The real sampler, failing the marked request's row once it is decoding beside others
    (as a row the model broke fails); it notes how many sequences that step held."""

    def __init__(self) -> None:
        self.rows_at_fault: list[int] = []

    def launch(
        self, logits: torch.Tensor, seqs: list[Sequence], maxima: RowMaxima | None = None
    ) -> Sampled:
        rows = [
            row
            for row, seq in enumerate(seqs)
            if seq.params.seed == FAIL_SAMPLING_SEED and seq.num_output_tokens == 2
        ]
        if rows:
            self.rows_at_fault.append(len(seqs))
        return FaultySampled(super().launch(logits, seqs, maxima), rows)


class FaultySampled:
    """A step's real sampling whose marked rows read back as failed."""

    def __init__(self, sampled: Sampled, rows: list[int]) -> None:
        self.tokens, self._sampled, self._rows = sampled.tokens, sampled, rows

    def read(self) -> list[Picked | Exception]:
        results = self._sampled.read()
        for row in self._rows:
            results[row] = RuntimeError("injected sampling fault")
        return results


class FaultyRunner(ModelRunner):
    """The real model runner, failing every prefill that holds the marked request before the
    model writes its KV (as an allocation failure at the start of a forward would), and
    putting a NaN into another marked request's logits once it is decoding beside others (as
    a model that breaks on one prompt would); it notes how many sequences that step held."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.rows_at_fault: list[int] = []

    def run(
        self, seqs: list[Sequence], prefill: bool, fresh: FreshTokens | None = None
    ) -> StepLogits:
        if prefill and any(seq.params.seed == FAIL_FORWARD_SEED for seq in seqs):
            raise RuntimeError("injected forward fault")
        logits = super().run(seqs, prefill, fresh).logits
        for row, seq in enumerate(seqs):
            if seq.params.seed == FAIL_LOGITS_SEED and seq.num_output_tokens == 2:
                self.rows_at_fault.append(len(seqs))
                with torch.inference_mode():  # the forward's logits are inference tensors
                    logits[row, 7] = float("nan")
        return StepLogits(logits)  # the rows' maxima, if any were made, are of the logits before


@dataclass
class Served:
    url: str
    runtime: GenerateRuntime

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url.removesuffix('/v1')}/metrics").text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

    def wait_running(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while self.runtime.stats()["requests_running"] < n:
            assert time.monotonic() < deadline, self.runtime.stats()
            time.sleep(0.005)


@contextlib.contextmanager
def serving(package: Package, faulty: bool) -> Iterator[Served]:
    """The real API over a real runtime; with `faulty`, the marked requests meet the faults."""
    manifest, files, _ = package
    runtime = load_runtime(manifest, files)
    assert isinstance(runtime, GenerateRuntime)
    if faulty:
        engine, real = runtime.engine, runtime.engine.runner
        engine.sampler = FaultySampler()
        engine.runner = FaultyRunner(real.model, real.attention, real.block_size, real.device)
    app = create_app(runtime, ServedPackage("tiny", "blake3:" + "0" * 64, None, 0))
    with background_server(app, runtime) as url:
        yield Served(url, runtime)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Package:
    root = tmp_path_factory.mktemp("isolation")
    return build_package(make_llama(root / "checkpoint"), root, "tiny")


@pytest.fixture(scope="module")
def plain(package: Package) -> Iterator[Served]:
    with serving(package, faulty=False) as served:
        yield served


@pytest.fixture(scope="module")
def faulty(package: Package) -> Iterator[Served]:
    with serving(package, faulty=True) as served:
        yield served


@pytest.fixture(scope="module")
def greedy_answers(plain: Served) -> list[str]:
    """Each prompt's greedy answer, asked alone."""
    return [ask(plain.url, prompt)[1]["text"] for prompt in PROMPTS]


# -- asking -------------------------------------------------------------------------------


def ask(url: str, prompt: str, stream: bool = False, **settings: Any) -> tuple[int, dict]:
    """POST a completion; the status and either the text or the error (streamed or not).
    A stream's answer also says whether it ended with [DONE] and how many chunks came."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
    body |= {"ignore_eos": True, "stream": stream} | settings
    if not stream:
        reply = httpx.post(f"{url}/completions", json=body, timeout=120)
        data = reply.json()
        return reply.status_code, data.get("error") or {"text": data["choices"][0]["text"]}
    with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [c["error"] for c in chunks if "error" in c]
    text = "".join(c["choices"][0]["text"] for c in chunks if "choices" in c)
    answer = {"text": text, "done": events[-1] == "[DONE]", "chunks": len(chunks) - len(errors)}
    return reply.status_code, (errors[0] | answer if errors else answer)


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls on threads at once; their results (or what they raised) in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # shown by the caller's assertions
            results[i] = (exc, {})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


# -- sane sampling for every accepted value -----------------------------------------------


@pytest.mark.parametrize(
    "tiny",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-45},
        {"temperature": 5e-324},
        {"temperature": 1.0, "top_p": 5e-324},
        {"temperature": 2.0, "top_p": 1e-300, "top_k": 10**9},
    ],
    ids=lambda tiny: ",".join(f"{k}={v}" for k, v in tiny.items()),
)
def test_a_tiny_temperature_or_top_p_among_six_requests_is_greedy_and_fails_none(
    plain: Served, greedy_answers: list[str], tiny: dict[str, float]
) -> None:
    calls = [lambda p=p, s=i % 2 == 1: ask(plain.url, p, stream=s) for i, p in enumerate(PROMPTS)]
    calls[2] = lambda: ask(plain.url, PROMPTS[2], stream=False, **tiny)
    calls[3] = lambda: ask(plain.url, PROMPTS[3], stream=True, seed=5, **tiny)
    answers = together(calls)
    assert [status for status, _ in answers] == [200] * 6, answers
    assert [answer["text"] for _, answer in answers] == greedy_answers
    assert all(answer.get("done", True) for _, answer in answers)
    assert plain.metric("flare_requests_failed_total") == 0


def test_logprobs_of_a_tiny_temperature_are_finite(plain: Served) -> None:
    api = openai.OpenAI(base_url=plain.url, api_key="none", max_retries=0)
    reply = api.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=1e-300, logprobs=20
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and len(logprobs.token_logprobs) == 6
    assert all(-100 < value <= 0 for value in logprobs.token_logprobs)
    for top in logprobs.top_logprobs:  # a dict by token text: tokens of equal text are one
        assert top and all(-1e4 <= value <= 0 for value in top.values())


# -- a sequence that fails ends alone -----------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (FAIL_SAMPLING_SEED, "RuntimeError: injected sampling fault"),
        (FAIL_LOGITS_SEED, NAN_MESSAGE),
    ],
    ids=["sampling-fault", "nan-logits"],
)
def test_a_failing_sequence_ends_alone_and_the_five_beside_it_answer(
    faulty: Served,
    greedy_answers: list[str],
    stream: bool,
    seed: int,
    message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fault in the sampler's result for one row, or a row of logits that cannot be sampled
    (the real sampler's check), in a step of six."""
    engine = faulty.runtime.engine
    assert isinstance(engine.sampler, FaultySampler) and isinstance(engine.runner, FaultyRunner)
    injected = engine.sampler if seed == FAIL_SAMPLING_SEED else engine.runner
    failed_before = faulty.metric("flare_requests_failed_total")
    long = {"max_tokens": 200}
    others = [
        lambda p=p, s=i % 2 == 0: ask(faulty.url, p, stream=s, **long)
        for i, p in enumerate(PROMPTS[:5])
    ]

    def poisoned() -> tuple[int, dict]:
        faulty.wait_running(5)  # the five are decoding: the fault lands in their steps
        return ask(faulty.url, PROMPTS[5], stream=stream, seed=seed)

    with caplog.at_level(logging.ERROR, logger="flare.serve.engine.engine"):
        *answers, (status, error) = together([*others, poisoned])

    assert injected.rows_at_fault[-1] == 6  # it failed in a step it shared with the five
    assert [s for s, _ in answers] == [200] * 5
    for (_, answer), alone in zip(answers, greedy_answers, strict=False):
        assert answer["text"].startswith(alone)
    assert status == (200 if stream else 500)
    assert error["type"] == "server_error"
    found = re.fullmatch(rf"request (\d+) failed: {re.escape(message)}", error["message"])
    assert found, error
    if stream:  # the status had gone: what was made (two tokens), the error event, [DONE]
        assert error["done"] and error["chunks"] <= 2
        assert greedy_answers[5].startswith(error["text"])
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert logged == [f"request {found.group(1)} failed: {message}"]
    assert faulty.metric("flare_requests_failed_total") == failed_before + 1
    assert faulty.metric("flare_kv_blocks_used") == 0
    assert faulty.metric("flare_requests_running") == 0


def test_the_openai_client_sees_a_server_error_and_the_server_goes_on(faulty: Served) -> None:
    api = openai.OpenAI(base_url=faulty.url, api_key="none", max_retries=0)
    settings = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8}
    settings |= {"seed": FAIL_SAMPLING_SEED, "extra_body": {"ignore_eos": True}}
    with pytest.raises(openai.InternalServerError, match="injected sampling fault"):
        api.completions.create(**settings)
    with pytest.raises(openai.APIError, match="injected sampling fault"):
        for _ in api.completions.create(stream=True, **settings):
            pass
    assert api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8).choices


# -- a forward that fails ends its batch only ---------------------------------------------


def test_a_failed_forward_fails_its_batch_only_and_the_engine_goes_on(
    faulty: Served, plain: Served, greedy_answers: list[str]
) -> None:
    """A request already decoding finishes; the failed prompt's blocks, named when they were
    handed out but never written, are not served to a later request with the same prompt."""
    failed_before = faulty.metric("flare_requests_failed_total")
    prompt = " ".join(PROMPTS)  # several full blocks

    def poisoned() -> tuple[int, dict]:
        faulty.wait_running(1)
        return ask(faulty.url, prompt, seed=FAIL_FORWARD_SEED)

    running = lambda: ask(faulty.url, PROMPTS[0], stream=True, max_tokens=200)  # noqa: E731
    (status, answer), (failed, error) = together([running, poisoned])
    assert (status, answer["done"]) == (200, True)
    assert answer["text"].startswith(greedy_answers[0])
    assert failed == 500 and "injected forward fault" in error["message"], error
    assert faulty.metric("flare_requests_failed_total") == failed_before + 1
    assert ask(faulty.url, prompt)[1]["text"] == ask(plain.url, prompt)[1]["text"]
    assert faulty.metric("flare_kv_blocks_used") == 0


# -- a fault of the engine itself ends what is in flight, never the engine ----------------


class FaultyBlocks(BlockManager):
    """The real block manager, raising once when armed: in the middle of assembling a decode
    batch, when the sequences being scheduled are out of the running queue."""

    armed = False

    def append_slot(self, seq: Sequence) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected scheduler fault")
        super().append_slot(seq)


def finish_within(handle: RequestHandle, seconds: float) -> list[Any]:
    """The request's deltas, or what reading it raised; fails the test if it hangs."""
    out: list[Any] = []

    def read() -> None:
        try:
            out.extend(handle)
        except Exception as exc:  # the caller checks what came
            out.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "the request hangs: the engine stopped"
    return out


def test_an_engine_fault_fails_what_is_in_flight_and_the_engine_serves_on(
    package: Package, greedy_answers: list[str]
) -> None:
    manifest, files, _ = package
    runtime = load_runtime(manifest, files)
    assert isinstance(runtime, GenerateRuntime)
    scheduler = runtime.engine.scheduler
    blocks = FaultyBlocks(len(scheduler.blocks.blocks), scheduler.blocks.block_size)
    scheduler.blocks = blocks
    prompt = runtime.tokenizer.encode(PROMPTS[0]).ids
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=TOKENS)
    runtime.start()
    try:
        handle = runtime.submit(prompt, greedy)
        first = next(iter(handle))
        blocks.armed = True
        rest = finish_within(handle, 30)
        assert first.finish_reason is None and isinstance(rest[-1], RequestFailed)
        assert "injected scheduler fault" in str(rest[-1])
        again = finish_within(runtime.submit(prompt, greedy), 30)
        assert "".join(d.text for d in again) == greedy_answers[0]
        assert runtime.stats()["requests_failed"] == 1
        assert runtime.kv_stats()["blocks_used"] == 0
    finally:
        runtime.stop()
