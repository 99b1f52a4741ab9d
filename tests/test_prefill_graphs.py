"""Prefill steps from CUDA graphs: the buckets and the padding they replay (here), and on a
GPU the same logits and tokens as the steps run kernel by kernel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from registry_helpers import flare
from test_cuda_graphs import kernel_by_kernel_then_replayed
from test_runtime import build_package

from flare.build.tiny import make_tiny_llama
from flare.errors import InvalidInputError
from flare.serve.artifacts import StartReport
from flare.serve.engine.cuda_graphs import GraphReport
from flare.serve.engine.flashinfer_attention import page_counts
from flare.serve.engine.prefill_graphs import bucket_of, buckets, padded_prefill
from flare.serve.engine.runner import FreshRows, StepInput, StepLogits
from flare.serve.engine.sequence import BlockTable, join_pages
from flare.serve.runtime import GenerateRuntime, SamplingParams, load_runtime

GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
BLOCK = 16


def test_the_buckets_hold_every_step_up_to_the_budget_once_padded() -> None:
    """Largest first; every bucket has room for its sequences; a step goes to the smallest
    bucket (fewest tokens, then fewest sequences) with more sequences than it has and room
    for its tokens and the padding's; none holds a step past the largest."""
    shapes = buckets(max_sequences=64, max_tokens=8192)
    assert shapes == sorted(shapes, reverse=True) and shapes[0] == (65, 2080)
    assert {s for s, _ in shapes} == {5, 17, 33, 65} and all(t >= s for s, t in shapes)
    assert bucket_of(shapes, 1, 40) == (5, 160)
    assert bucket_of(shapes, 1, 156) == (5, 160)  # 156 tokens and four sequences of padding
    assert bucket_of(shapes, 1, 157) == (5, 288)
    assert bucket_of(shapes, 5, 40) == (17, 160)
    assert bucket_of(shapes, 16, 512) == (17, 544)  # 16 prompts of 32 tokens
    assert bucket_of(shapes, 64, 2048) == (65, 2080)  # 64 of them
    assert bucket_of(shapes, 64, 2080) is None and bucket_of(shapes, 65, 100) is None
    assert bucket_of(shapes, 1, 2077) is None
    for sequences in range(1, 65):
        for tokens in range(sequences, 2100, 37):
            found = bucket_of(shapes, sequences, tokens)
            if tokens <= 2048:  # every step within the budget has a bucket
                assert found is not None, (sequences, tokens)
            if found is not None:
                assert found[0] > sequences and found[1] >= tokens + found[0] - sequences
    assert buckets(max_sequences=8, max_tokens=256) == [(9, 288), (9, 160), (5, 288), (5, 160)]


def test_a_prefill_is_padded_with_sequences_in_the_pad_block() -> None:
    """The real rows are unchanged; the padding is one-token sequences, then one with the
    tokens left, each only in the pad block (its positions within one block, so no model's
    context is passed), and its page table names that block for each of its pages."""
    tables = [BlockTable([9, 3, 4]), BlockTable([7])]
    slots = [3 * BLOCK + 2, 3 * BLOCK + 3, 7 * BLOCK]
    step = StepInput([5, 6, 8], [34, 35, 0], slots, [2, 1], [36, 1], tables)
    padded = padded_prefill(step, 4, 64, pad_block=99, block_size=BLOCK)  # any shape pads
    assert padded.ids[:3] == step.ids and padded.positions[:3] == step.positions
    assert padded.slots[:3] == slots and padded.tables[:2] == tables
    assert padded.query_lens == [2, 1, 1, 60] and padded.context_lens == [36, 1, 1, 60]
    assert len(padded.ids) == len(padded.positions) == len(padded.slots) == 64
    assert padded.positions[3:] == [0, *(j % BLOCK for j in range(60))]
    assert all(s // BLOCK == 99 for s in padded.slots[3:])
    assert [s % BLOCK for s in padded.slots[3:]] == padded.positions[3:]
    assert [t.ids for t in padded.tables[2:]] == [[99], [99] * 4]
    pages, _ = page_counts(padded.context_lens, BLOCK)
    joined = np.zeros(sum(pages), dtype=np.int32)
    join_pages(padded.tables, pages, joined)
    assert joined.tolist() == [9, 3, 4, 7, 99, 99, 99, 99, 99]
    with pytest.raises(ValueError, match="does not pad"):
        padded_prefill(step, 2, 64, pad_block=99, block_size=BLOCK)
    with pytest.raises(ValueError, match="does not pad"):
        padded_prefill(step, 4, 4, pad_block=99, block_size=BLOCK)


def test_the_ready_line_gives_each_capture_its_time_and_takes_both_from_the_load() -> None:
    """The decode graphs' sizes and the prefill graphs' reach, each with its seconds, which
    are not counted again in the load's own time."""
    start = StartReport("package")
    start.graphs = GraphReport([1, 2, 4], 0.3, 1 << 20)
    start.prefill_graphs = GraphReport([160, 2080], 0.8, 1 << 20, "prefill", [5, 65])
    line = start.timeline(pull=0.1, load=2.0, total=2.1, weights=None)
    assert "load 0.90 s" in line
    assert "CUDA graphs 0.30 s (3 decode batch sizes, 1 to 4)" in line
    assert "prefill graphs 0.80 s (up to 64 sequences and 2080 tokens)" in line


def test_the_ready_line_takes_the_engines_own_start_after_the_pull_from_the_load() -> None:
    """An engine process still importing when the pull ended began its load later: that
    wait is shown apart (never more than the load, never below zero), and not in `load`."""
    start = StartReport("package", warm_up=0.5)
    start.began = 1000.0
    line = start.timeline(pull=0.1, load=2.0, total=2.1, weights=None, pulled_at=999.2)
    assert "pull 0.10 s, engine start 0.80 s, load 0.70 s" in line, line
    line = start.timeline(pull=0.1, load=2.0, total=2.1, weights=None, pulled_at=1000.5)
    assert "pull 0.10 s, load 1.50 s" in line, line  # the engine was waiting for the package
    assert "engine start" not in start.timeline(0.1, 2.0, 2.1, None)  # loaded in this process


def test_prefill_graphs_are_refused_with_batch_invariance(tmp_path: Path) -> None:
    """A padded prefill's products are not the unpadded step's, which --batch-invariant
    promises: asking for both is an invalid input, named, before anything loads; batch
    invariance alone turns the default prefill graphs off and loads."""
    source = make_tiny_llama(tmp_path / "tiny")
    manifest, files, _ = build_package(source, tmp_path, "tiny")
    with pytest.raises(InvalidInputError, match="--prefill-graphs pads each prefill step"):
        load_runtime(manifest, files, "cpu", batch_invariant=True, prefill_graphs=True)
    assert isinstance(load_runtime(manifest, files, "cpu", batch_invariant=True), GenerateRuntime)
    with pytest.raises(InvalidInputError, match="which --no-cuda-graphs turns off"):
        load_runtime(manifest, files, "cpu", cuda_graphs=False, prefill_graphs=True)
    unasked = load_runtime(manifest, files, "cpu", cuda_graphs=False, prefill_graphs=False)
    assert isinstance(unasked, GenerateRuntime)


def test_the_serve_command_refuses_both_flags_in_one_line_and_loads_nothing(
    tmp_path: Path, flare_env: dict[str, str]
) -> None:
    """`flare serve --prefill-graphs --batch-invariant`, and `--prefill-graphs
    --no-cuda-graphs` (prefill graphs are captured only beside decode graphs): exit 4, one
    line naming both flags and what to do, before the engine loads a weight (no memory plan
    printed)."""
    source = make_tiny_llama(tmp_path / "tiny")
    flare(flare_env, "key", "generate", "--publisher", "alice")
    flare(flare_env, "build", str(source), "--name", "tiny")
    serve = ("serve", "tiny", "--port", "0", "--device", "cpu", "--prefill-graphs")
    done = flare(flare_env, *serve, "--batch-invariant", check=False)
    assert done.returncode == 4, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "error: --prefill-graphs pads each prefill step; --batch-invariant prefills each "
        "prompt alone and unpadded; serve with one of the two"
    ], done.stderr
    done = flare(flare_env, *serve, "--no-cuda-graphs", check=False)
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --prefill-graphs replays prefill steps from CUDA graphs, which "
        "--no-cuda-graphs turns off; serve with one of the two"
    ], done.stderr


@pytest.mark.skipif(not GPU, reason="needs CUDA and the flashinfer-python package")
def test_graph_prefill_gives_the_logits_of_the_kernel_by_kernel_prefill(tmp_path: Path) -> None:
    """A tiny Llama in bfloat16: prefill steps of one prompt, of five of different lengths,
    of twenty, and of prompts whose first blocks are cached (queries shorter than their
    contexts), each run from its graph and again kernel by kernel, give the same logits
    within bfloat16's rounding; the greedy tokens of those requests are those of a runtime
    without prefill graphs (nine in ten at least: random weights have near ties); the
    capture, on by default, is in the start report, which built no kernel."""
    source = make_tiny_llama(tmp_path / "tiny", hidden=512, layers=2)
    manifest, files, _ = build_package(source, tmp_path, "tiny", target="cuda")
    runtime = load_runtime(manifest, files, "cuda", kv_cache_tokens=16384)  # graphs by default
    assert isinstance(runtime, GenerateRuntime)
    start = runtime.start_report
    assert (start.forward, start.compilations.kernels) == ("package", 0), start.describe()
    report = start.prefill_graphs
    assert report is not None and report.kind == "prefill" and report.sizes[0] == 160
    assert "prefill graphs" in start.timeline(0.1, 1.0, 1.2, None)
    runner, compared = runtime.runner, []
    run_step = runner.run_step

    def both(step: StepInput, fresh: FreshRows | None = None) -> StepLogits:
        """The step kernel by kernel, then from its graph."""
        plain, graphed = kernel_by_kernel_then_replayed(runner, "prefills", run_step, step, fresh)
        if plain is None:
            return graphed
        assert graphed.logits.shape == plain.shape
        cached = max(c - q for c, q in zip(step.context_lens, step.query_lens, strict=True))
        diff = float((graphed.logits - plain).abs().max())
        compared.append((len(step.query_lens), cached, diff))
        return graphed

    def generate(batches: list[list[list[int]]]) -> list[list[int]]:
        greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
        tokens = []
        for prompts in batches:
            handles = [runtime.submit(p, greedy) for p in prompts]
            tokens += [[t for d in h for t in d.token_ids] for h in handles]
        return tokens

    rng = np.random.default_rng(3)

    def prompt(n: int) -> list[int]:
        return rng.integers(3, runtime.vocab_size, n).tolist()

    shared = prompt(48)
    batches = [
        [prompt(40)],
        [prompt(n) for n in (5, 17, 40, 2, 33)],
        [prompt(3 + 5 * i) for i in range(20)],
        [shared + prompt(9)],
        [shared + prompt(n) for n in (1, 30, 200)],  # the first 48 tokens' blocks are cached
    ]
    runtime.start()
    try:
        runner.run_step = both  # type: ignore[method-assign]
        graphed = generate(batches)
        runner.run_step = run_step  # type: ignore[method-assign]
        prefills, runner.prefills = runner.prefills, None
        plain = generate(batches)
        runner.prefills = prefills
    finally:
        runtime.stop()
    assert max(sequences for sequences, _, _ in compared) >= 5, compared
    assert max(cached for _, cached, _ in compared) >= 48, compared
    assert max(diff for _, _, diff in compared) <= 2e-2, compared
    equal = sum(a == b for a, b in zip(graphed, plain, strict=True))
    assert equal >= 0.9 * len(plain), (graphed, plain)  # near ties of random weights aside
