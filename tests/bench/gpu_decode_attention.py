"""Decode attention as a decode graph runs it, FlashInfer's variants and flare's: µs a layer.

Decode graphs (serve/engine/cuda_graphs.py) ran FlashInfer's decode wrapper in its CUDA-graph
mode, whose work split is fixed when the graph is captured: on its tensor-core path the KV is
always split and a merge kernel follows. This times, for a model's head shape, every variant
flare could run, each layer's call captured in one CUDA graph of LAYERS calls over caches of
their own (so the KV is read from memory, as in a step whose weights pass through L2 between
two layers' attention), median replay over REPLAYS:

- `tc-graph` (what flare runs where tuning picks tensor cores: FA3 on Hopper), `tc-fa2-graph`,
  `cc-graph` (CUDA cores): the wrapper in graph mode, planned for the case;
- `tc-eager`, `tc-fa2-eager`, `cc-eager`, `tc-fa2-nosplit`: the wrapper planned as an eager
  step is (its split chosen for the case, or none), the planned calls then captured: what a
  kernel needs when its split fits the case;
- `flare`: flare's own decode kernel (serve/engine/decode_attention.py), which decode graphs
  run; it has no plan (its `plan_us` is 0). `flare:BLOCK_N:STAGES:WARPS` runs it with another
  `Tiling`.

Each variant's output is compared with torch's attention in float32 on the same cache (max
abs). And the host time of one plan (µs, median of PLANS). Cases: batch 1, 16, 64 at contexts
64-2,048 tokens, and batch 1 at 8,192.

    python tests/bench/gpu_decode_attention.py [--shapes 1b,8b] [--out DIR]

Prints a table (stderr) and one JSON report (stdout, and under --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import replay_seconds

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128)}
"""Query heads, KV heads, head size."""
CASES = [(b, c) for b in (1, 16, 64) for c in (64, 256, 512, 2048)] + [(1, 8192)]
PAGE = 16
LAYERS = 16
REPLAYS = 20
PLANS = 50
VARIANTS = (
    "tc-graph",
    "tc-fa2-graph",
    "cc-graph",
    "tc-eager",
    "tc-fa2-eager",
    "cc-eager",
    "tc-fa2-nosplit",
    "flare",
)


def wrapper(variant: str, batch: int, pages: int, workspace: torch.Tensor) -> Any:
    """The decode wrapper of `variant`, its graph-mode buffers sized for the case."""
    import flashinfer

    device = workspace.device
    options: dict[str, Any] = {"use_tensor_cores": variant.startswith("tc")}
    if "fa2" in variant:
        options["backend"] = "fa2"
    if variant.endswith("graph"):

        def table(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        options |= {
            "use_cuda_graph": True,
            "paged_kv_indptr_buffer": table(batch + 1),
            "paged_kv_indices_buffer": table(batch * pages),
            "paged_kv_last_page_len_buffer": table(batch),
        }
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **options)


def plan(variant: str, decode: Any, batch: int, context: int, shape: tuple[int, int, int]) -> None:
    """Plan every sequence at `context` tokens over pages of its own."""
    pages = -(-context // PAGE)
    indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32)
    indices = torch.arange(batch * pages, dtype=torch.int32)
    last = torch.full((batch,), (context - 1) % PAGE + 1, dtype=torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    heads, kv_heads, dim = shape
    extra: dict[str, Any] = {"disable_split_kv": True} if variant.endswith("nosplit") else {}
    decode.plan(
        indptr,
        indices.cuda() if variant.endswith("graph") else indices,
        last,
        heads,
        kv_heads,
        dim,
        PAGE,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        sm_scale=dim**-0.5,
        seq_lens=lengths,
        **extra,
    )


def reference(
    q: torch.Tensor, cache: torch.Tensor, batch: int, context: int, pages: int
) -> torch.Tensor:
    """Attention in float32: each sequence's query against its own first `context` slots
    (`cache` in flare's layout, [slots, 2, kv_heads, dim], a sequence's pages in a row)."""
    heads, kv_heads = q.shape[1], cache.shape[2]
    kv = cache.view(batch, pages * PAGE, 2, kv_heads, -1)[:, :context].float()
    k, v = (kv[:, :, i].repeat_interleave(heads // kv_heads, dim=2) for i in range(2))
    scores = torch.einsum("bhd,bthd->bht", q.float(), k) * q.shape[-1] ** -0.5
    return torch.einsum("bht,bthd->bhd", scores.softmax(-1), v)


def time_case(
    variant: str, shape: tuple[int, int, int], batch: int, context: int, workspace: torch.Tensor
) -> dict[str, Any]:
    """µs a layer (median replay of LAYERS calls), the plan's host µs, and the error. The
    caches are flare's ([slots, 2, kv_heads, dim]); FlashInfer reads them as flare hands
    them over, K and V as strided "NHD" page views."""
    heads, kv_heads, dim = shape
    pages = -(-context // PAGE)
    device = workspace.device
    generator = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    caches = [
        torch.randn(
            (batch * pages * PAGE, 2, kv_heads, dim),
            dtype=torch.bfloat16,
            device=device,
            generator=generator,
        )
        for _ in range(LAYERS)
    ]
    q = torch.randn((batch, heads, dim), dtype=torch.bfloat16, device=device, generator=generator)
    run, planned = caller(variant, shape, q, batch, context, pages, workspace)
    out = run(caches[0])
    torch.cuda.synchronize()
    error = (out.float() - reference(q, caches[0], batch, context, pages)).abs()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for cache in caches:
            run(cache)
    seconds = replay_seconds(graph, REPLAYS)
    del graph, caches
    return {
        "us_per_layer": round(1e6 * seconds / LAYERS, 2),
        "plan_us": round(planned, 1),
        "max_abs_error": round(error.max().item(), 4),
    }


def caller(
    variant: str,
    shape: tuple[int, int, int],
    q: torch.Tensor,
    batch: int,
    context: int,
    pages: int,
    workspace: torch.Tensor,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], float]:
    """A layer's call of `variant` on a cache, returning its output (planned first, unless
    flare's), and the host µs of its plan."""
    heads, kv_heads, dim = shape
    if variant.startswith("flare"):
        from flare.serve.engine.decode_attention import DecodeWorkspace, Tiling, paged_decode

        tiling = Tiling(*map(int, variant.split(":")[1:]))

        device = q.device
        indptr = torch.arange(0, batch * pages + 1, pages, dtype=torch.int32, device=device)
        indices = torch.arange(batch * pages, dtype=torch.int32, device=device)
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        space = DecodeWorkspace(batch, kv_heads, heads // kv_heads, dim, device)

        def run(cache: torch.Tensor) -> torch.Tensor:
            scale = dim**-0.5
            return paged_decode(
                q, cache, indptr, indices, lengths, scale, PAGE, space, tiling=tiling
            )

        return run, 0.0
    decode = wrapper(variant, batch, pages, workspace)
    plan(variant, decode, batch, context, shape)
    planned = _host_us(lambda: plan(variant, decode, batch, context, shape))
    out = torch.empty_like(q)
    paged = (batch * pages, PAGE, kv_heads, dim)

    def fi_run(cache: torch.Tensor) -> torch.Tensor:
        return decode.run(q, (cache[:, 0].view(paged), cache[:, 1].view(paged)), out=out)

    return fi_run, planned


def _host_us(action: Callable[[], None]) -> float:
    spent = []
    for _ in range(PLANS):
        started = time.perf_counter()
        action()
        spent.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(spent)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "cases": []}
    for name in args.shapes.split(","):
        for variant in args.variants.split(","):
            for batch, context in CASES:
                row = {"shape": name, "variant": variant, "batch": batch, "context": context}
                try:
                    row |= time_case(variant, SHAPES[name], batch, context, workspace)
                except Exception as error:  # a variant FlashInfer refuses is a finding too
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                report["cases"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(report["cases"]), file=sys.stderr)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_attention.json").write_text(text)
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """µs a layer: a line per shape, batch and context, a column per variant."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["shape batch context  " + "  ".join(f"{v:>14}" for v in variants)]
    keys = dict.fromkeys((r["shape"], r["batch"], r["context"]) for r in rows)
    for shape, batch, context in keys:
        cells = []
        for variant in variants:
            row = next(
                r
                for r in rows
                if (r["shape"], r["batch"], r["context"], r["variant"])
                == (shape, batch, context, variant)
            )
            cells.append(f"{row.get('us_per_layer', 'x'):>14}")
        lines.append(f"{shape:>5} {batch:>5} {context:>7}  " + "  ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
