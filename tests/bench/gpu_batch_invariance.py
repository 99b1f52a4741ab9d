"""Which part of a step makes a request's greedy tokens depend on the requests beside it.

The GPU-serving issue asks that 64 concurrent greedy requests give the tokens each gives
alone; on the 1B shape 15 of 64 did (docs/performance.md). This script finds which of a
step's parts breaks that, on one GPU, in-process: gpu_attention.py's Llama of serving shape
with Llama-3.2-1B's heads (32 over 8 KV heads of 64: FlashInfer's tensor-core decode, whose
plan takes `disable_split_kv`; random bf16 weights built on the GPU, no package), flare's
own ModelRunner with FlashInfer, eager (the compiled forward launches the same products and
attention). Each prompt is generated alone, then all together, with each of these turned on
in turn, cumulatively:

- `as served`: products of up to FEW_ROWS rows in `few_rows`, more in cuBLAS; FlashInfer
  splitting a long KV as its plan sees fit; the prompts prefilled in one step together;
- `few_rows to 64`: every decode product in `few_rows`, whose sums do not depend on the rows;
- `no KV split`: FlashInfer's plans with `disable_split_kv` (the same reduction at any batch);
- `prefill alone`: each prompt prefilled in a step of its own, then the decodes together.

    python tests/bench/gpu_batch_invariance.py [--seqs 64] [--prompt 256] [--decode 32]

Prints JSON: for each setting, how many requests' tokens (and first tokens) equal their
tokens alone, and the together run's decode tokens/s (what the setting costs, eager).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from gpu_attention import build_model, generate

from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention
from flare.serve.models import linear

SETTINGS = ("as served", "few_rows to 64", "no KV split", "prefill alone")


def apply(setting: str, plan_kinds: Callable[[Any], dict]) -> None:
    """Turn on `setting` (the ones before it stay on)."""
    if setting == "few_rows to 64":
        linear.keep_rows_invariant(True)
    elif setting == "no KV split":

        def unsplit(self: FlashInferPagedAttention) -> dict:
            return plan_kinds(self) | {"disable_split_kv": True}

        FlashInferPagedAttention.plan_kinds = unsplit  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256, help="longest prompt (tokens)")
    parser.add_argument("--decode", type=int, default=32, help="tokens generated per prompt")
    args = parser.parse_args()
    model = build_model(torch.device("cuda"), heads=32)
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt // 16, args.prompt + 1, (args.seqs,), generator=generator)
    prompts = [torch.randint(0, 32_000, (int(n),), generator=generator).tolist() for n in lengths]
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "seqs": args.seqs}
    plan_kinds = FlashInferPagedAttention.plan_kinds
    generate("flashinfer", model, prompts[:2], 2)  # FlashInfer's modules, Triton's kernels
    for setting in SETTINGS:
        apply(setting, plan_kinds)
        one_by_one = setting == "prefill alone"
        alone = [generate("flashinfer", model, [p], args.decode)[0][0] for p in prompts]
        together, _, decode_s = generate("flashinfer", model, prompts, args.decode, one_by_one)
        rate = args.seqs * (args.decode - 1) / decode_s
        pairs = list(zip(together, alone, strict=True))
        report[setting] = {
            "equal_to_alone": sum(a == b for a, b in pairs),
            "first_token_equal": sum(a[0] == b[0] for a, b in pairs),
            "together_decode_tokens_per_s": round(rate, 1),
        }
        print(setting, report[setting], flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
