"""The model runtime behind `flare serve`: load a package, generate or embed.

`load_runtime` reads a verified, pulled package (its manifest and a local file per blob)
and returns a `Runtime`: a generating one runs the engine's step loop on a background
thread and streams `Delta`s to `RequestHandle`s; an embedding one answers `embed` calls.
The HTTP API codes against this module only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from flare.errors import InvalidInputError, NoSpaceError
from flare.serve import compilations, flashinfer_modules, install_hashes
from flare.serve.artifacts import RuntimeArtifacts, StartReport, runtime_artifacts
from flare.serve.compilations import Compilations
from flare.serve.compiled import CompiledForward, use_cache_folder, warm_up
from flare.serve.engine.attention import AttentionBackend
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.cuda_graphs import DecodeGraphs, release_unused
from flare.serve.engine.engine import Engine, EngineStopping
from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention
from flare.serve.engine.output import Delta, RequestFailed, RequestHandle
from flare.serve.engine.prefill_graphs import PrefillGraphs
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.scheduler import Scheduler
from flare.serve.engine.sequence import SamplingParams, TokenLogprob
from flare.serve.inductor_archive import PRECOMPILED, unpack
from flare.serve.memory_plan import (
    KvSizing,
    MemoryPlan,
    device_memory,
    memory_size,
    parameter_bytes,
)
from flare.serve.models import WeightsLoading, linear, model_kind, start_model
from flare.serve.models.files import PackageFiles, Quarantine
from flare.serve.package_text import PackageText, read_text_beside
from flare.serve.rank_group import LeaderRunner, RankGroup
from flare.serve.token_bytes import TokenBytes
from flare.serve.truncation import Truncation
from flare.store.package import Manifest

__all__ = [
    "Delta",
    "EmbedRuntime",
    "Embedded",
    "EngineStopping",
    "GenerateRuntime",
    "RequestFailed",
    "RequestHandle",
    "Runtime",
    "SamplingParams",
    "TokenLogprob",
    "load_runtime",
]

BLOCK_SIZE = 16
MAX_NUM_SEQS = 64
"""Sequences decoded together in one step."""
MAX_BATCHED_TOKENS = 8192
"""Prompt tokens prefilled in one step (one longer prompt still runs alone)."""
CPU_KV_BYTES = 1 << 30
GPU_KV_FRACTION = 0.85
"""Of the memory free after loading the weights."""
EMBED_BATCH = 32


def load_runtime(
    manifest: Manifest,
    files: Mapping[str, Path],
    device: str = "cpu",
    kv_cache_tokens: int | None = None,
    dtype: torch.dtype | None = None,
    memory_reserve: int = 0,
    attention: str = "auto",
    quarantine: Quarantine | None = None,
    compile_mode: str = "package",
    compile_root: Path | None = None,
    group: RankGroup | None = None,
    on_group_failure: Callable[[BaseException], None] | None = None,
    cuda_graphs: bool = True,
    batch_invariant: bool = False,
    prefill_graphs: bool | None = None,
    beside_read: Callable[[bool], None] | None = None,
) -> Runtime:
    """Load the package's model on `device` (fp32 on CPU, bf16 elsewhere unless `dtype` or
    the package's tuning says otherwise); `files` maps every blob's digest text to a local
    file, each checked against the manifest as it is read (a corrupt one goes to
    `quarantine`: see PackageFiles). A GPU's KV cache takes a share of the memory left after
    the weights and `memory_reserve`; `attention` picks the backend
    (serve/engine/attention_choice.py, `make_attention`; auto: the package's tuned one). A
    generating model's forward is the package's compiled one, compiled at start, or eager, as
    `compile_mode` says (serve/artifacts.py; `compile_root` holds compiled forwards); it is
    warmed up before this returns, so nothing compiles after. On CUDA, with FlashInfer
    attention and one rank, decode steps then run from CUDA graphs captured before this
    returns, unless `cuda_graphs` is off (serve/engine/cuda_graphs.py), and prefill steps
    too unless `prefill_graphs` is off (serve/engine/prefill_graphs.py; None: on unless
    `batch_invariant`, whose unpadded prefills they would pad). With
    `batch_invariant`, a greedy request gets the tokens it gets alone, whatever runs beside it
    (GenerateRuntime). The runtime's `memory_plan` says what each part took.

    A multi-rank package loads as rank zero of `group` (serve/rank_group.py): its part of
    the model, its forward eager (`on_group_failure` hears of a step the ranks could not
    run); the caller has started the other ranks.

    `beside_read` runs on this thread as soon as the weights' read has begun, told whether
    the forward is compiled (the engine process imports what the rest of the load needs
    there, rather than before the read: the compiler's modules only for a compiled forward)."""
    world = group.world if group is not None else 1
    refuse_prefill_graphs_alone(cuda_graphs, prefill_graphs)
    if batch_invariant:
        refuse_invariance_over_ranks(manifest.name, world)
        refuse_padded_invariance(prefill_graphs)
    if manifest.ranks != world:
        raise InvalidInputError(
            f"package {manifest.name} is built for {manifest.ranks} ranks, not {world}",
            "serve it with flare serve, which starts a process per rank",
        )
    package = PackageFiles(manifest, files, quarantine)
    kind = model_kind(package)
    reading = read_text_beside(package)
    target = torch.device(device)
    if group is not None:
        prepared = RuntimeArtifacts("eager", None, why="tensor-parallel ranks run eagerly")
    else:
        prepared = runtime_artifacts(package, target.type, compile_mode, compile_root)
    tuned = prepared.decisions.torch_dtype if prepared.decisions else None
    dtype = dtype or default_dtype(target, tuned)
    model, loading = start_model(package, target, dtype, group.shard if group is not None else None)
    runtime: Runtime
    try:
        if beside_read is not None:
            beside_read(prepared.compiler)
        if kind == "embed":
            loading.wait()
            runtime, kv = EmbedRuntime(package, reading.result(), model), None
        else:
            kv = _kv_sizing(model, target, dtype, memory_reserve, kv_cache_tokens)
            ranks = (group, on_group_failure) if group is not None else None
            runtime = GenerateRuntime(
                package,
                reading.result(),
                model,
                target,
                dtype,
                kv.tokens,
                attention,
                prepared,
                ranks,
                cuda_graphs,
                batch_invariant,
                prefill_graphs,
                loading,
            )
    finally:  # on any failure too: no thread may go on writing into the model
        loading.wait()
    runtime.memory_plan = _memory_plan(runtime, model, target, dtype, kv, memory_reserve, world)
    return runtime


def refuse_invariance_over_ranks(name: str, ranks: int) -> None:
    """Batch-invariant serving is one process's: its row limit and scheduler are set where
    the model runs, and tensor-parallel ranks each run products of their own."""
    if ranks > 1:
        raise InvalidInputError(
            f"package {name} runs on {ranks} ranks: --batch-invariant serves one-rank packages",
            "serve it without --batch-invariant",
        )


def refuse_padded_invariance(prefill_graphs: bool | None) -> None:
    """A prefill graph pads a step with sequences of its own, so its products are not the
    unpadded step's, which batch-invariant serving promises: asked for both (None is not
    asking), refused."""
    if prefill_graphs:
        raise InvalidInputError(
            "--prefill-graphs pads each prefill step; --batch-invariant prefills each "
            "prompt alone and unpadded",
            "serve with one of the two",
        )


def refuse_prefill_graphs_alone(cuda_graphs: bool, prefill_graphs: bool | None) -> None:
    """Prefill graphs are captured beside the decode graphs, into their pool, and only where
    those are: asked for with the decode graphs off (None is not asking), refused rather than
    silently not captured."""
    if prefill_graphs and not cuda_graphs:
        raise InvalidInputError(
            "--prefill-graphs replays prefill steps from CUDA graphs, which --no-cuda-graphs "
            "turns off",
            "serve with one of the two",
        )


def default_dtype(device: torch.device, tuned: torch.dtype | None = None) -> torch.dtype:
    """The package's tuned dtype, else float32 on CPU and bfloat16 elsewhere."""
    return tuned or (torch.float32 if device.type == "cpu" else torch.bfloat16)


@dataclass(frozen=True)
class Embedded:
    """Texts' vectors, and the tokens each was counted as (what the model saw of it)."""

    vectors: list[list[float]]
    token_counts: list[int]


class Runtime:
    """What every runtime offers; `kind` says which of submit or embed it serves."""

    kind = ""
    attention = ""
    """The attention backend a generating runtime runs (make_attention's name for it)."""
    failure: str | None = None
    """Why the runtime can serve no more (a tensor-parallel rank was lost, the engine process
    died): /health says it."""
    stall: str | None = None
    """Why the runtime makes no progress now (its engine finished no step, or its engine
    process gave no answer, for the stall timeout): /health says it until progress resumes."""
    on_lost: Callable[[], None] | None = None
    """Called, from any thread, once the runtime can serve no more: the server stops on it
    (serve/server.py) and exits non-zero, so that a supervisor starts it again."""

    def __init__(self, package: PackageFiles, context_length: int, text: PackageText) -> None:
        self.package = package
        self.model_name = package.manifest.name
        self.context_length = context_length
        self.text = text

    @property
    def tokenizer(self) -> Tokenizer:
        """The package's tokenizer (its text side's)."""
        return self.text.tokenizer

    def start(self) -> None:
        """Start serving (a no-op for runtimes without a background loop)."""

    def stop(self, drain: bool = True) -> None:
        """Stop serving; with drain, finish the requests in flight first."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        raise InvalidInputError(f"model {self.model_name} embeds text; it does not generate")

    def embed(self, texts: list[str]) -> Embedded:
        raise InvalidInputError(f"model {self.model_name} generates text; it does not embed")

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), for logprob entries."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """One token's raw bytes, for chat logprob entries (serve/token_bytes.py)."""
        return TokenBytes(self.tokenizer)

    def kv_stats(self) -> dict[str, int]:
        return {}

    def stats(self) -> dict[str, float]:
        return {}

    def rank_stats(self) -> dict[int, dict[str, float]]:
        """Figures per tensor-parallel rank, for /metrics' rank="R" labels (none for one)."""
        return {}

    start_report = StartReport("eager", "an embedding model serves uncompiled")
    """How the start went: the forward, and what warming it up took and compiled."""
    memory_plan: MemoryPlan | None = None
    """What each part of the runtime holds on its device (set by load_runtime)."""


class GenerateRuntime(Runtime):
    """A causal language model behind the continuous-batching engine."""

    kind = "generate"

    def __init__(
        self,
        package: PackageFiles,
        text: PackageText,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache_tokens: int,
        attention_kind: str = "auto",
        prepared: RuntimeArtifacts | None = None,
        ranks: tuple[RankGroup, Callable[[BaseException], None] | None] | None = None,
        cuda_graphs: bool = True,
        batch_invariant: bool = False,
        prefill_graphs: bool | None = None,
        weights: WeightsLoading | None = None,
    ) -> None:
        """With `batch_invariant`, every product of a decode batch up to 64 sums each row as
        it would alone (serve/models/linear.py), each prompt is prefilled whole (no cached
        prefix reused) in a step of its own (the scheduler), so a greedy request's tokens do
        not depend on the others, nor on what ran before; prefill steps replay CUDA graphs
        beside the decode steps' unless `prefill_graphs` is off (None: off with
        `batch_invariant` only, as padding would break its promise). `weights`, where the
        model's weights are still being read (load_runtime): the KV cache is made, the
        compiled forward warmed up and the CUDA graphs captured meanwhile (a capture records
        the device's work, not values, in a mode that lets the read's threads use the device:
        cuda_graphs.recording), and the read awaited before anything runs on its values."""
        linear.keep_rows_invariant(batch_invariant)
        prepared = prepared or RuntimeArtifacts("eager", None, why="none was asked for")
        decisions = prepared.decisions
        block = decisions.page_size if decisions else BLOCK_SIZE
        spec = model.attention_spec
        tokens = kv_cache_tokens
        num_blocks = tokens // block
        if num_blocks < 1:
            raise InvalidInputError(f"a KV cache of {tokens} tokens holds no {block}-block")
        self.vocab_size = model.vocab_size
        self.dtype = dtype
        if decisions is not None and attention_kind == "auto":
            attention_kind = decisions.backend
        self.attention, attention = make_attention(
            attention_kind,
            spec,
            num_blocks * block,
            block,
            dtype,
            device,
            decisions.variant if decisions else None,
        )
        graphs = attention if cuda_graphs and ranks is None and num_blocks > 1 else None
        if not isinstance(graphs, FlashInferPagedAttention):  # graphs replay its kernels only
            graphs = None
        usable = num_blocks - 1 if graphs is not None else num_blocks  # one block pads graphs
        super().__init__(package, min(model.context_length, usable * block), text)
        options = package.manifest.options
        max_concurrency = int(options.get("max_concurrency", MAX_NUM_SEQS))
        blocks = BlockManager(usable, block, reuse_prefixes=not batch_invariant)
        batched_tokens = int(options.get("prefill_chunk", MAX_BATCHED_TOKENS))
        if ranks is not None:
            if weights is not None:  # a rank's forward runs eagerly: nothing to overlap
                weights.wait()
            group, on_failure = ranks
            runner: ModelRunner = LeaderRunner(
                model, attention, block, device, group, on_failure or (lambda exc: None)
            )
            self.start_report = StartReport("eager", prepared.why)
        else:
            before = compilations.snapshot()
            runner, self.start_report = _start_forward(
                model, attention, block, device, prepared, blocks
            )
            if graphs is not None:
                shape = (max_concurrency, batched_tokens, usable)
                prefills = not batch_invariant if prefill_graphs is None else prefill_graphs
                self._capture_graphs(runner, graphs, *shape, prefills=prefills)
                self.start_report.compilations = compilations.snapshot() - before
            if weights is not None:
                weights.wait()
            if graphs is not None:
                release_unused(device)
        self.runner = runner
        self.rank_reports: dict[int, dict[str, float]] = {}
        """Each rank's load: seconds, weight and KV bytes (set once every rank is ready)."""
        scheduler = Scheduler(
            blocks,
            max_concurrency,
            max(batched_tokens, self.context_length),
            prefill_alone=batch_invariant,
        )
        self.engine = Engine(runner, scheduler, text.tokenizer, text.eos_token_ids)
        self._ready = compilations.snapshot()

    def _capture_graphs(
        self,
        runner: ModelRunner,
        attention: FlashInferPagedAttention,
        max_concurrency: int,
        batched_tokens: int,
        pad_block: int,
        prefills: bool,
    ) -> None:
        """Capture the decode steps' CUDA graphs, then, with `prefills`, the prefill steps'
        into the same memory pool, for `runner` to replay the steps they fit."""
        pages = max_concurrency * -(-self.context_length // attention.block_size)
        decode = DecodeGraphs(runner.forward, attention, max_concurrency, pages, pad_block)
        self.start_report.graphs = decode.capture()
        runner.graphs = decode
        if prefills:
            shape = (max_concurrency, batched_tokens, pages, pad_block)
            prefill = PrefillGraphs(runner.forward, attention, *shape)
            self.start_report.prefill_graphs = prefill.capture(decode.pool)
            runner.prefills = prefill

    def start(self) -> None:
        self.engine.start()
        if isinstance(self.runner, LeaderRunner):
            self.runner.start_ticking()

    def stop(self, drain: bool = True) -> None:
        """Stop the engine, then (tensor parallel) the other ranks, unless they are lost."""
        self.engine.stop(drain)
        if isinstance(self.runner, LeaderRunner) and self.failure is None:
            self.runner.stop_ranks()

    def fail(self, error: BaseException) -> None:
        """The runtime can serve no more (a rank was lost): every request in flight ends with
        `error`, new ones are refused, /health answers 503."""
        self.failure = str(error)
        self.engine.abort(error)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; raises ValueError for a prompt or budget this model cannot take."""
        max_tokens = token_budget(prompt_token_ids, params, self.context_length, self.vocab_size)
        return self.engine.submit(prompt_token_ids, params, max_tokens)

    def kv_stats(self) -> dict[str, int]:
        return self.engine.kv_stats()

    def stalled_for(self) -> float:
        return self.engine.stalled_for()

    def stats(self) -> dict[str, float]:
        """The engine's figures, and `compilations`: everything compiled since the runtime
        was ready (0 for a package whose compiled forward matches this host)."""
        return {**self.engine.stats(), "compilations": self.compilations_since_ready().total}

    def rank_stats(self) -> dict[int, dict[str, float]]:
        """Per tensor-parallel rank: rank zero's collective and send times; empty for one."""
        if not isinstance(self.runner, LeaderRunner):
            return {}
        group = self.runner.group
        figures = {rank: dict(report) for rank, report in self.rank_reports.items()}
        figures.setdefault(0, {}).update(
            rank_collective_seconds=group.shard.collective_seconds,
            rank_send_seconds=group.sent_seconds,
        )
        return figures

    def compilations_since_ready(self) -> Compilations:
        return compilations.snapshot() - self._ready


def token_budget(
    prompt: list[int], params: SamplingParams, context_length: int, vocab_size: int
) -> int:
    """The tokens a request may generate (its max_tokens, else the room left in the context);
    raises ValueError for settings, a prompt or a budget this model cannot take."""
    params.validate()
    if not prompt:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    room = context_length - len(prompt)
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room or room < 1:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) "
            f"exceeds the context length of {context_length}"
        )
    return max_tokens


class EmbedRuntime(Runtime):
    """A sentence encoder: texts in, one vector each out. Each text is tokenized once, cut
    to the context as sentence-transformers cuts it, and only as much of it as gives those
    tokens (serve/truncation.py), so a huge input costs what a context's worth of it does."""

    kind = "embed"

    def __init__(self, package: PackageFiles, text: PackageText, model: nn.Module) -> None:
        settings = package.json("sentence_bert_config.json") or {}
        length = settings.get("max_seq_length") or model.context_length
        if not isinstance(length, int) or length < 1:
            problem = f"has max_seq_length {length!r}, not a positive integer"
            raise package.malformed("sentence_bert_config.json", problem)
        super().__init__(package, length, text)
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.truncation = Truncation(self.tokenizer, length)
        if self.truncation.room < 1:
            problem = f"has max_seq_length {length}, no room beside the special tokens"
            raise package.malformed("sentence_bert_config.json", problem)
        self.model = model
        self.device = next(model.parameters()).device
        self._lock = threading.Lock()
        self._counters = {"requests_finished": 0, "prompt_tokens": 0}

    def embed(self, texts: list[str]) -> Embedded:
        """Pooled vectors, computed in batches, and each text's tokens (for usage); texts
        past the context length are cut to it."""
        if not texts:
            raise ValueError("nothing to embed: the input is empty")
        token_ids = self.truncation.token_ids(texts)
        vectors: list[list[float]] = []
        for start in range(0, len(texts), EMBED_BATCH):
            vectors += self._batch(token_ids[start : start + EMBED_BATCH])
        return Embedded(vectors, [len(ids) for ids in token_ids])

    @torch.inference_mode()
    def _batch(self, token_ids: list[list[int]]) -> list[list[float]]:
        width = max(len(tokens) for tokens in token_ids)
        ids = torch.zeros((len(token_ids), width), dtype=torch.int64)
        mask = torch.zeros((len(token_ids), width), dtype=torch.int64)
        for row, tokens in enumerate(token_ids):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(tokens)] = 1
        with self._lock:
            out = self.model(ids.to(self.device), mask.to(self.device))
            self._counters["requests_finished"] += 1
            self._counters["prompt_tokens"] += int(mask.sum())
        return out.float().cpu().tolist()

    def stats(self) -> dict[str, float]:
        return dict(self._counters)


def _start_forward(
    model: nn.Module,
    attention: AttentionBackend,
    block: int,
    device: torch.device,
    prepared: RuntimeArtifacts,
    blocks: BlockManager,
) -> tuple[ModelRunner, StartReport]:
    """The runner with its forward as `prepared` says, warmed up when compiled: unpacking
    and pointing Triton (and Inductor, for its graphs) at the compiled forward's folder, then
    its first steps, each timed. Without the compiler (CUDA), the forward is the model's own,
    its kernels the folder's."""
    if prepared.forward == "eager":
        return ModelRunner(model, attention, block, device), StartReport("eager", prepared.why)
    started = time.perf_counter()
    assert prepared.folder is not None
    if prepared.archive is not None:
        unpack(prepared.archive, prepared.folder)
    use_cache_folder(prepared.folder)
    if device.type == "cuda":
        flashinfer_modules.use_modules(prepared.folder)
    compilations.watch(compiler=prepared.compiler)
    install_hashes.wait()  # loading a kernel needs Triton's hash: not made twice
    before = compilations.snapshot()
    forward = CompiledForward(model, prepared.folder / PRECOMPILED) if prepared.compiler else None
    runner = ModelRunner(model, attention, block, device, forward)
    report = StartReport(
        prepared.forward,
        why=forward.not_loaded if forward else "",
        compiler=prepared.compiler,
        artifacts=time.perf_counter() - started,
    )
    started = time.perf_counter()
    warm_up(runner, blocks)
    if forward is not None:
        forward.trust_guards()
        if prepared.forward == "start":  # a later start of this package on this host loads them
            forward.save(prepared.folder / PRECOMPILED)
    report.warm_up = time.perf_counter() - started
    report.compilations = compilations.snapshot() - before
    return runner, report


def kv_cache_reservation(device: str) -> int:
    """Memory the default KV cache takes on top of the weights, for admission before a pull
    (on a GPU the cache fits itself into what is free, so nothing is added)."""
    return CPU_KV_BYTES if device == "cpu" else 0


def _kv_sizing(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    reserve: int,
    given: int | None,
) -> KvSizing:
    """Tokens the KV cache holds: `given` (--kv-cache-tokens), else a memory budget, but no
    more than a full batch of full contexts; and how that was decided, for the memory plan."""
    per_token = model.attention_spec.bytes_per_token(dtype)
    if given:
        _check_room_for(given, per_token, device, reserve)
        return KvSizing(given, f"given: --kv-cache-tokens {given}")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(max(0, free - reserve) * GPU_KV_FRACTION)
        source = (
            f"{GPU_KV_FRACTION:.0%} of the {memory_size(free)} free after the weights, "
            f"less memory.reserve"
        )
    else:  # the ranks of a CPU host share its budget (each caches its own KV heads)
        budget = CPU_KV_BYTES // getattr(getattr(model, "shard", None), "world", 1)
        source = f"the CPU budget of {memory_size(budget)}"
    full = model.context_length * MAX_NUM_SEQS
    if budget // per_token > full:
        return KvSizing(
            full,
            f"by memory: {MAX_NUM_SEQS} full contexts of {model.context_length} tokens, "
            f"within {source}",
        )
    return KvSizing(budget // per_token, f"by memory: {source}")


def _check_room_for(tokens: int, per_token: int, device: torch.device, reserve: int) -> None:
    """Refuse a KV cache of `tokens` (--kv-cache-tokens) that the device's free memory, the
    weights allocated, cannot hold beside memory.reserve, before allocating any of it: said
    as admission says it, rather than as the allocator's failure."""
    needed, free = tokens * per_token, device_memory(device.type)[0]
    if needed > free - reserve:
        raise NoSpaceError(
            f"--kv-cache-tokens {tokens} needs {memory_size(needed)} of KV cache, and "
            f"{device.type} has {memory_size(max(0, free - reserve))} free after the weights "
            "and memory.reserve",
            "give fewer tokens, or leave --kv-cache-tokens out to size the cache to the memory",
        )


def _memory_plan(
    runtime: Runtime,
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    kv: KvSizing | None,
    reserve: int,
    ranks: int,
) -> MemoryPlan:
    """The loaded runtime's memory: the KV cache and workspace as its attention backend
    allocated them (the tokens in whole blocks), the device's memory as it is now."""
    cache = workspace = graph_bytes = 0
    if isinstance(runtime, GenerateRuntime):
        graphs = runtime.start_report.graphs
        captured = (graphs, runtime.start_report.prefill_graphs)
        graph_bytes = sum(report.bytes for report in captured if report is not None)
        backend = runtime.runner.attention
        cache, workspace = backend.cache.nbytes, backend.workspace_bytes
        stats = runtime.kv_stats()
        block = stats["block_size"]
        tokens = stats["blocks_total"] * block
        assert kv is not None
        if graphs is not None:  # the cache holds one block more, for the graphs' padding rows
            kv = KvSizing(tokens, f"{kv.how}, less one {block}-token block for CUDA graphs")
        elif tokens != kv.tokens:
            kv = KvSizing(tokens, f"{kv.how}, in whole {block}-token blocks")
    free, total = device_memory(device.type)
    return MemoryPlan(
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        weights=parameter_bytes(model),
        kv=kv,
        kv_cache=cache,
        workspace=workspace,
        graphs=graph_bytes,
        reserve=reserve,
        total=total,
        free=free,
        ranks=ranks,
    )
