"""Decode steps from CUDA graphs: the padding and page tables they replay (here), and on a
GPU the same tokens as the steps run kernel by kernel."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runtime import build_package

from flare.build.tiny import make_tiny_llama
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.cuda_graphs import captured, held_bytes, padded_to
from flare.serve.engine.flashinfer_attention import page_counts, page_table
from flare.serve.engine.runner import FreshRows, ModelRunner, StepInput, StepLogits
from flare.serve.engine.sampler import row_max
from flare.serve.engine.sequence import BlockTable, Sequence, join_pages
from flare.serve.runtime import GenerateRuntime, SamplingParams, load_runtime

GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
BLOCK = 16


def test_a_batch_is_padded_with_one_token_rows_in_the_pad_block() -> None:
    """The rows past the batch write their KV into the pad block only and read one token of it:
    no sequence's blocks are touched, and the real rows are unchanged."""
    slots = [3 * BLOCK + 4, 7 * BLOCK + 3]
    tables = [BlockTable([9, 3]), BlockTable([7])]
    step = StepInput([5, 6], [20, 3], slots, [1, 1], [21, 4], tables)
    padded = padded_to(step, 4, pad_block=99, block_size=BLOCK)
    assert padded.ids == [5, 6, 0, 0] and padded.positions == [20, 3, 0, 0]
    assert padded.slots == [*slots, 99 * BLOCK, 99 * BLOCK]
    assert padded.query_lens == [1] * 4 and padded.context_lens == [21, 4, 1, 1]
    assert [table.ids for table in padded.tables] == [[9, 3], [7], [99], [99]]
    assert padded_to(step, 2, pad_block=99, block_size=BLOCK) == step


def test_the_page_table_names_each_sequences_blocks_up_to_its_context() -> None:
    """FlashInfer's view: pages per sequence, those pages in turn (never the table's padding
    past the context), and how full each last page is."""
    tables = [[4], [1, 2, -1], [5, 6, 7], [8, 9]]
    pages, indices, last = page_table([1, 16, 17, 32], tables, BLOCK)
    assert pages == [1, 1, 2, 2]
    assert indices == [4, 1, 5, 6, 8, 9]
    assert last == [1, 16, 1, 16]


def test_a_block_table_array_follows_its_list_as_it_grows() -> None:
    """The int32 array a replay joins its pages from holds the list's ids, past the length
    it started with; a step cannot ask more pages of it than it holds."""
    table = BlockTable([7, 3])
    for block in range(100, 140):
        table.append(block)
        assert table.pages(len(table.ids)).tolist() == table.ids
    assert table.pages(3).tolist() == [7, 3, 100]
    with pytest.raises(ValueError, match="43 pages asked of a block table of 42"):
        table.pages(43)


def test_a_replay_stages_the_page_table_of_the_sequences_lists() -> None:
    """Sequences through the block manager's life (a shared cached prefix, decode steps over
    block boundaries, one freed and readmitted), at every decode step: the pages joined from
    their block tables' arrays are page_table's indices from their lists, the pad rows'
    too, and a step sent to another rank as JSON joins the same."""
    manager = BlockManager(num_blocks=64, block_size=4)
    prompt = list(range(1, 10))
    seqs = [Sequence([*prompt, i], SamplingParams(), max_tokens=64) for i in range(3)]
    seqs.append(Sequence(list(range(20, 25)), SamplingParams(), max_tokens=64))
    for s in seqs:
        manager.allocate(s)
    for step in range(11):
        if step == 5:  # one leaves and comes back: its blocks are handed out again
            manager.free_sequence(seqs[1])
            manager.allocate(seqs[1])
        for s in seqs:
            s.append(40 + step)
            manager.append_slot(s)
        contexts = [len(s) for s in seqs]
        decode = StepInput([0] * 4, [0] * 4, [0] * 4, [1] * 4, contexts, [s.kv_table for s in seqs])
        padded = padded_to(decode, 6, pad_block=63, block_size=4)
        lists = [table.ids for table in padded.tables]
        pages, want, _ = page_table(padded.context_lens, lists, 4)
        for made in (padded, StepInput.from_json(json.loads(json.dumps(padded.to_json())))):
            counts, _ = page_counts(made.context_lens, 4)
            got = np.zeros(sum(counts), dtype=np.int32)
            join_pages(made.tables, counts, got)
            assert counts == pages and got.tolist() == want
    assert seqs[0].block_table[:2] == seqs[2].block_table[:2]  # the prefix was shared


@pytest.mark.skipif(not GPU, reason="needs CUDA and the flashinfer-python package")
def test_graph_decode_gives_the_logits_of_the_kernel_by_kernel_decode(tmp_path: Path) -> None:
    """A tiny Llama (heads of 64, which FlashInfer takes) in bfloat16, five requests of
    different lengths decoding together: every decode step, run from its graph (batches of
    5, 4, 3, 2, 1 padded to 8, 4, 4, 2, 1) and again kernel by kernel, gives the same logits
    within bfloat16's rounding, and the rows' maxima and their indices the graph found beside
    its logits are exactly `row_max`'s of them; the tokens (one request sampled with a seed,
    one greedy with logprobs, the rest greedy) are those of steps that land before the next
    is launched (the input tokens read from the device, where a sampled row's token replaced
    the greedy one, or sent from the host); the capture is in the start report and the
    memory plan (its memory, and the KV block its padding rows take); the start built no
    kernel (Triton's, its products' and its KV store's among them, come with the package)."""
    source = make_tiny_llama(tmp_path / "tiny", hidden=512, layers=2)
    manifest, files, _ = build_package(source, tmp_path, "tiny", target="cuda")
    runtime = load_runtime(manifest, files, "cuda", kv_cache_tokens=4096)
    assert isinstance(runtime, GenerateRuntime)
    start = runtime.start_report
    assert (start.forward, start.compilations.kernels) == ("package", 0), start.describe()
    report, plan = start.graphs, runtime.memory_plan
    assert report is not None and report.sizes[:3] == [1, 2, 4]
    assert plan is not None and plan.graphs > 0
    assert plan.kv is not None and "block for CUDA graphs" in plan.kv.how
    runner, compared, agreed = runtime.runner, [], []
    run_step = runner.run_step

    def both(step: StepInput, fresh: FreshRows | None = None) -> StepLogits:
        """The step kernel by kernel, then from its graph (which reads the pending tokens
        where the step before left them, so it goes second)."""
        plain, graphed = kernel_by_kernel_then_replayed(runner, "graphs", run_step, step, fresh)
        if plain is None:
            return graphed
        assert graphed.maxima is not None
        values, indices = row_max(graphed.logits)
        agreed.append(
            torch.equal(values, graphed.maxima.values)
            and torch.equal(indices, graphed.maxima.indices)
            and torch.equal(graphed.maxima.packed[:, 0].long(), indices)
        )
        compared.append((len(step.ids), float((graphed.logits - plain).abs().max())))
        return graphed

    runner.run_step = both  # type: ignore[method-assign]
    runtime.start()
    try:
        params = [
            SamplingParams(temperature=0, ignore_eos=True, max_tokens=4 + 3 * i) for i in range(5)
        ]
        params[1] = SamplingParams(temperature=0.8, seed=7, ignore_eos=True, max_tokens=7)
        params[3] = SamplingParams(temperature=0, logprobs=2, ignore_eos=True, max_tokens=13)
        prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 2, 33)]
        ahead = [runtime.submit(p, g) for p, g in zip(prompts, params, strict=True)]
        deltas = [list(h) for h in ahead]
        tokens = [[t for d in h for t in d.token_ids] for h in deltas]
        assert [len(t) for t in tokens] == [4, 7, 10, 13, 16]
        chosen = [lp.token_id for d in deltas[3] for lp in d.logprobs or []]
        assert chosen == tokens[3]
        runtime.engine.overlap = False  # each step lands before the next is launched
        landed_first = [runtime.submit(p, g) for p, g in zip(prompts, params, strict=True)]
        assert [[t for d in h for t in d.token_ids] for h in landed_first] == tokens
    finally:
        runtime.stop()
    assert {rows for rows, _ in compared} >= {5, 3, 1}
    assert max(diff for _, diff in compared) <= 2e-2, compared
    assert agreed and all(agreed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shared", [False, True])
def test_a_capture_without_a_run_first_that_fails_is_made_again_after_one(shared: bool) -> None:
    """A start captures most graphs without running their step first (`captured`); one
    whose capture raises (here a wait for the device, which no capture allows) is run once,
    then captured again, and its graph replays the step's work on new inputs. In a pool that
    other graphs share (a start's), too: torch leaves the broken capture's pool recording, and
    the retry and the set's next graph (which a start captures into the pool of the graph
    before) still capture, and every graph replays its own work."""
    x = torch.ones(4, device="cuda")
    capturing: list[bool] = []
    first, first_out = captured(lambda: x + 1, None, warm=False) if shared else (None, None)
    pool = first.pool() if first is not None else None

    def step() -> torch.Tensor:
        capturing.append(torch.cuda.is_current_stream_capturing())
        if len(capturing) == 1:
            torch.cuda.synchronize()
        return x * 2

    graph, out = captured(step, pool, warm=False)
    assert capturing == [True, False, True]
    after, added = captured(lambda: x + 5, graph.pool(), warm=False)
    x.fill_(3)
    graph.replay()
    after.replay()
    if first is not None:
        first.replay()
        assert first_out.tolist() == [4.0] * 4
    assert out.tolist() == [6.0] * 4 and added.tolist() == [8.0] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_are_captured_while_another_thread_reads_onto_the_device() -> None:
    """A start captures its graphs while the weights' read goes on (serve/runtime.py): on
    threads and a stream of their own, it allocates, copies and waits for its copies, which
    CUDA's default capture mode forbids every thread. Here a reader does all three, in a
    loop, while graphs are captured (each capture sleeps inside, so reads land during it):
    no call fails, every read lands whole, each graph replays its own work alone, and the
    memory the captures hold is counted without the reader's buffers (`held_bytes`)."""
    x = torch.ones(1 << 20, device="cuda")
    source = torch.arange(1 << 23, dtype=torch.float32).pin_memory()
    stop, landed, errors = threading.Event(), [], []

    def read() -> None:
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    target = torch.empty(source.shape, device="cuda")
                    target.copy_(source, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                    done.synchronize()
                    landed.append(torch.equal(target[-4:].cpu(), source[-4:]))
        except BaseException as exc:  # raised below, on the test's thread
            errors.append(exc)

    def step(factor: float) -> torch.Tensor:
        time.sleep(0.02)  # the GIL let go inside the capture: the reader runs meanwhile
        return x * factor

    reader = threading.Thread(target=read)
    held = held_bytes(torch.device("cuda"))
    reader.start()
    graphs, pool, during = [], None, []
    try:
        for factor in range(2, 12):
            before = len(landed)
            graph, out = captured(lambda f=factor: step(f), pool, warm=False)
            graphs.append((graph, out, factor))
            pool = graph.pool()
            during.append(len(landed) - before)
        taken = held_bytes(torch.device("cuda")) - held
    finally:
        stop.set()
        reader.join()
    assert not errors, errors
    assert landed and all(landed) and sum(during) > 0, during
    x.fill_(3)
    for graph, out, factor in graphs:
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.full_like(x, 3.0 * factor))
    assert len(graphs) * x.nbytes <= taken < len(graphs) * x.nbytes + source.nbytes, taken


def kernel_by_kernel_then_replayed(
    runner: ModelRunner,
    replay: str,
    run_step: Callable[[StepInput, FreshRows | None], StepLogits],
    step: StepInput,
    fresh: FreshRows | None,
) -> tuple[torch.Tensor | None, StepLogits]:
    """The step's logits kernel by kernel, with the runner's `replay` (its attribute's name)
    set aside (None where that replay does not fit the step), then the step as the runner
    runs it, from the replay where it fits."""
    graphs = getattr(runner, replay)
    if graphs is None or not graphs.fits(step):
        return None, run_step(step, fresh)
    setattr(runner, replay, None)
    try:
        plain = run_step(step, fresh).logits.clone()
    finally:
        setattr(runner, replay, graphs)
    return plain, run_step(step, fresh)


START_IN_ENGINE = """
import json
import sys
from pathlib import Path

from flare.registry.registry import Registry
from flare.serve.runtime import load_runtime

tmp = Path(sys.argv[1])
files = {digest: Path(path) for digest, path in json.loads(sys.argv[2]).items()}
manifest = Registry(str(tmp / "registry"), f"sqlite:///{tmp / 'index.db'}").manifest("tiny")[2]
start = load_runtime(manifest, files, "cuda", kv_cache_tokens=4096).start_report
compilers = [name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules]
print(start.forward, start.compilations.kernels, ",".join(compilers) or "-", start.describe())
"""


@pytest.mark.skipif(not GPU, reason="needs CUDA and FlashInfer")
def test_a_start_in_an_engine_process_builds_no_kernel(tmp_path: Path) -> None:
    """A CUDA package loaded as `flare serve`'s engine process loads it (a process of its own)
    builds none of the Triton kernels the package carries: flare's own kernels (its products,
    its KV store, its norm) were keyed at build as they are looked up here, with the same
    ptxas. And it imports neither Dynamo nor Inductor: the forward calls those kernels
    directly, and the two imports were about 3 s of the H200's host."""
    source = make_tiny_llama(tmp_path / "tiny", hidden=512, layers=2)
    _, files, _ = build_package(source, tmp_path, "tiny", target="cuda")
    paths = json.dumps({digest: str(path) for digest, path in files.items()})
    done = subprocess.run(
        [sys.executable, "-c", START_IN_ENGINE, str(tmp_path), paths],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    forward, kernels, compilers, described = done.stdout.split(maxsplit=3)
    assert (forward, kernels, compilers) == ("package", "0", "-"), described
