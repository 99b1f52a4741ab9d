"""FlashInfer attention against the torch reference, on one GPU: same tokens, how much faster.

A Llama of serving shape (hidden 2048, 16 query heads and 8 KV heads of 128, 8 layers, vocab
32,000; random bf16 weights, built on the GPU: no package needed) generates greedily for a
batch of prompts through flare's own ModelRunner, BlockManager and Sequence, once with each
backend. Baseline: the torch reference backend in the same process, same model, same prompts.

    python tests/bench/gpu_attention.py [--seqs 64] [--prompt 256] [--decode 128]

Prints JSON: prefill and decode time of each backend (CUDA-synchronised wall time, after one
untimed warm-up round), decode tokens/s, the speed-up, and how many sequences' greedy tokens
are identical between the backends. Random weights make logits nearly flat, so free-running
greedy sequences part at the first near tie that bf16 rounding flips; the lockstep check
therefore measures both bf16 backends against the float32 reference on the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from lockstep import Lockstep

from flare.build.tiny import llama_config
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sequence import SamplingParams, Sequence
from flare.serve.models.llama import LlamaForCausalLM

BLOCK = 16


def build_model(device: torch.device, heads: int = 16) -> LlamaForCausalLM:
    """Random bf16 weights (norms at 1), materialised on the GPU; `heads` query heads over 8
    KV heads (32: Llama-3.2-1B's grouping, whose decode runs on tensor cores)."""
    config = llama_config(32_000, 2048, 8, heads, 8)
    config["max_position_embeddings"] = 4096
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def generate(
    kind: str,
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    decode: int,
    one_by_one: bool = False,
) -> tuple[list[list[int]], float, float]:
    """Greedy tokens of every prompt, prefill seconds, decode seconds: the prompts prefilled
    in one step (or `one_by_one`, a step each), then decoded together."""
    runner, blocks, seqs = _engine(kind, torch.bfloat16, model, prompts, decode)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for group in [[seq] for seq in seqs] if one_by_one else [seqs]:
        _advance(group, _greedy(runner.run(group, prefill=True).logits), blocks)
    torch.cuda.synchronize()
    prefilled = time.perf_counter()
    for _ in range(decode - 1):
        _advance(seqs, _greedy(runner.run(seqs, prefill=False).logits), blocks)
    torch.cuda.synchronize()
    done = time.perf_counter()
    outputs = [seq.token_ids[len(p) :] for seq, p in zip(seqs, prompts, strict=True)]
    return outputs, prefilled - started, done - prefilled


def _engine(
    kind: str, dtype: torch.dtype, model: LlamaForCausalLM, prompts: list[list[int]], decode: int
) -> tuple[ModelRunner, BlockManager, list[Sequence]]:
    """A runner on the `kind` backend, a cache with room for every prompt and its `decode`
    tokens, and the prompts as sequences with their blocks allocated."""
    device = torch.device("cuda")
    need = sum(-(-(len(p) + decode) // BLOCK) for p in prompts)
    name, attention = make_attention(kind, model.attention_spec, need * BLOCK, BLOCK, dtype, device)
    assert name == kind, f"asked for {kind}, got {name}"
    blocks = BlockManager(need, BLOCK)
    seqs = [Sequence(p, SamplingParams(temperature=0), max_tokens=decode) for p in prompts]
    for seq in seqs:
        blocks.allocate(seq)
    return ModelRunner(model, attention, BLOCK, device), blocks, seqs


def _greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()


def _advance(seqs: list[Sequence], tokens: list[int], blocks: BlockManager) -> None:
    """Append each sequence's next token and make room for its KV."""
    for seq, token in zip(seqs, tokens, strict=True):
        seq.append(token)
        blocks.append_slot(seq)


def lockstep(model: LlamaForCausalLM, prompts: list[list[int]], decode: int) -> dict:
    """Three runs step by step on the same tokens: the torch reference in float32 (the truth,
    whose greedy choice is fed to all three), and the torch reference and FlashInfer in bf16.
    For each bf16 backend: its largest logit difference from float32, and how often its
    greedy choice differs from float32's. FlashInfer is as exact as the reference when its
    figures match the bf16 reference's: both only round differently from float32."""
    exact = copy.deepcopy(model).float()
    sides = [
        _engine("torch", torch.float32, exact, prompts, decode),
        _engine("torch", torch.bfloat16, model, prompts, decode),
        _engine("flashinfer", torch.bfloat16, model, prompts, decode),
    ]
    tally = Lockstep(("torch", "flashinfer"))
    for step in range(decode):
        truth, *rounded = (runner.run(seqs, prefill=step == 0).logits for runner, _, seqs in sides)
        forced = tally.add(truth, dict(zip(tally.names, rounded, strict=True)))
        for _, blocks, seqs in sides:
            _advance(seqs, forced, blocks)
    return tally.report(suffix="_bf16_vs_fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256, help="longest prompt (tokens)")
    parser.add_argument("--decode", type=int, default=128, help="tokens generated per prompt")
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_model(device)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt // 4, args.prompt + 1, (args.seqs,), generator=generator)
    prompts = [torch.randint(0, 32_000, (int(n),), generator=generator).tolist() for n in lengths]
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    results = {}
    for kind in ("torch", "flashinfer", "torch", "flashinfer"):  # the first round warms up
        tokens, prefill_s, decode_s = generate(kind, model, prompts, args.decode)
        results[kind] = (tokens, prefill_s, decode_s)
    decoded = args.seqs * (args.decode - 1)
    for kind, (_, prefill_s, decode_s) in results.items():
        report[kind] = {
            "prefill_s": round(prefill_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_tokens_per_s": round(decoded / decode_s, 1),
        }
    report["decode_speedup"] = round(results["torch"][2] / results["flashinfer"][2], 2)
    report["prefill_speedup"] = round(results["torch"][1] / results["flashinfer"][1], 2)
    ours, theirs = results["flashinfer"][0], results["torch"][0]
    report["sequences_identical"] = sum(a == b for a, b in zip(ours, theirs, strict=True))
    report["first_token_identical"] = sum(a[0] == b[0] for a, b in zip(ours, theirs, strict=True))
    report["lockstep"] = lockstep(model, prompts, args.decode)
    report["shape"] = {"seqs": args.seqs, "prompt_max": args.prompt, "decode": args.decode}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
