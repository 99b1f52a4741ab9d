"""The decode step's matrix products on one GPU: flare's `few_rows` kernel against cuBLAS.

For each weight shape of the Llama 1B and 8B shapes (q/k/v, o_proj, gate/up, down_proj,
lm_head) and each row count, times cuBLAS (`F.linear`) and `few_rows` under every tiling of a
grid, and prints each one's time and read bandwidth, the best tiling, and how far the tiling
that `linear.tiling` picks is from it. Every result is checked against a float32 product.

Timing: a CUDA graph of back-to-back products, cycling through copies of the weight that
together pass 4x the L2 cache, so every product reads its weight from HBM as a step does;
the graph is replayed and timed with CUDA events; the figure is the median replay's time
divided by its products.

    python tests/bench/gpu_linear.py --out $OUT            # the grid (a few minutes)
    python tests/bench/gpu_linear.py --picked --out $OUT   # only linear.tiling's choices
    python tests/bench/gpu_linear.py --chain --out $OUT    # whole layers, see below

`--chain` times a decode step's products in their order, as a model's layers run them, every
layer with weights of its own: add+norm, q/k/v, (a stand-in for attention), o_proj, add+norm,
gate/up, silu*mul, down_proj, and the logits, one CUDA graph a step. Ways: cuBLAS,
`few_rows`, and `few_rows` with some of its kernels launched as dependents of the kernel ahead
(serve/engine/dependent_launch.py: the products; the norms; the stand-in and silu*mul, which
Inductor compiles, with `triton.enable_pdl`). It prints each way's step time, its ratio to
cuBLAS, and how far the ways' logits are apart.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from common import replay_seconds

from flare.serve.models.linear import Tiling, few_rows, tiling

SHAPES = {
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
           "down": (2048, 8192), "lm_head": (128256, 2048)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336), "lm_head": (128256, 4096)},
}  # fmt: skip
"""(n, k) of each weight: output features, input features."""
ROWS = (1, 16, 64)
LAYERS = {"1b": 16, "8b": 32}
L2_BYTES = 50 * 2**20
PRODUCTS = 24
"""Products a timed graph runs (at least; enough copies to pass 4x L2)."""
REPLAYS = 7


def grid() -> list[Tiling]:
    return [
        Tiling(block_n=n, block_k=k, split=s, stages=st)
        for n, k, s, st in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (3, 5))
    ]


def copies_of(weight: torch.Tensor) -> list[torch.Tensor]:
    count = max(2, math.ceil(4 * L2_BYTES / (weight.numel() * weight.element_size())))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def time_graph(run, weights: list[torch.Tensor]) -> float:
    """Seconds a product, as the median replay of a graph of them, or inf if it fails."""
    launches = max(PRODUCTS, len(weights))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for weight in weights[:2]:
            run(weight)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            run(weights[i % len(weights)])
    return replay_seconds(graph, REPLAYS) / launches


def check(x: torch.Tensor, weight: torch.Tensor, want: torch.Tensor, cut: Tiling) -> float:
    """`few_rows`'s difference from the float32 product."""
    return _error(few_rows(x, weight, cut), want)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference, in units of bf16's spacing at the product's RMS."""
    spacing = float(want.pow(2).mean().sqrt()) * 2**-8
    return float((got.float() - want).abs().max()) / spacing


def measure(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    cuts = [] if args.picked else grid()
    for shape_name in args.shapes:
        for name, (n, k) in SHAPES[shape_name].items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            weights = copies_of(weight)
            nbytes = weight.numel() * 2
            for rows in args.rows:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                want = x.float() @ weight.float().T
                key = f"{shape_name}.{name}.m{rows}"
                entry: dict = {"n": n, "k": k, "rows": rows, "mb": round(nbytes / 1e6, 2)}
                cublas = time_graph(lambda w, x=x: F.linear(x, w), weights)
                entry["cublas_us"] = round(cublas * 1e6, 2)
                entry["cublas_tb_s"] = round(nbytes / cublas / 1e12, 2)
                entry["cublas_err_ulp"] = round(_error(F.linear(x, weight), want), 2)
                picked = tiling(n, k)
                results = []
                for cut in [picked, *[c for c in cuts if c != picked]]:
                    try:
                        seconds = time_graph(lambda w, x=x, c=cut: few_rows(x, w, c), weights)
                        error = check(x, weight, want, cut)
                    except Exception as exc:  # out of shared memory, and the like
                        results.append({"cut": cut.__dict__, "failed": str(exc)[:120]})
                        continue
                    results.append(
                        {"cut": cut.__dict__, "us": round(seconds * 1e6, 2),
                         "tb_s": round(nbytes / seconds / 1e12, 2), "err_ulp": round(error, 2)}
                    )  # fmt: skip
                timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
                entry["picked"] = results[0]
                entry["best"] = timed[:5]
                entry["bad"] = [r for r in timed if r["err_ulp"] > 8][:3]
                entry["failed"] = len([r for r in results if "failed" in r])
                report[key] = entry
                best = timed[0] if timed else {"us": float("nan"), "cut": {}}
                print(
                    f"{key:18} {entry['mb']:8.1f} MB  cuBLAS {entry['cublas_us']:8.2f} us "
                    f"{entry['cublas_tb_s']:5.2f} TB/s | picked {results[0].get('us')} us "
                    f"{results[0].get('tb_s')} TB/s | best {best['us']} us "
                    f"{best.get('tb_s')} TB/s {best['cut']}",
                    flush=True,
                )
            del weights, weight
            torch.cuda.empty_cache()
    return report


def chain_weights(shape: str, device: str) -> dict:
    """One layer's weights a layer (and the logits'), std 0.02, as gpu_serving's checkpoint."""
    dims = SHAPES[shape]
    hidden = dims["o"][0]

    def draw(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02

    layers = [
        {name: draw(*dims[name]) for name in ("qkv", "o", "gate_up", "down")}
        | {"norm": torch.ones(hidden, device=device, dtype=torch.bfloat16)}
        for _ in range(LAYERS[shape])
    ]
    return {"layers": layers, "lm_head": draw(*dims["lm_head"]), "hidden": hidden}


@dataclass
class Way:
    """How a chain runs: its product (which says itself whether it launches as a dependent),
    and whether the norms and Inductor's kernels launch as dependents of the kernel ahead."""

    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    norms: bool = False
    inductor: bool = False

    def __post_init__(self) -> None:
        options = {"triton.enable_pdl": self.inductor}
        self.attend = torch.compile(_stand_in, options=options, dynamic=False)
        self.silu_mul = torch.compile(_silu_mul, options=options, dynamic=False)


def dependent(products: bool, norms: bool, inductor: bool) -> Way:
    """A `few_rows` chain whose kernels launch as dependents as the flags say."""
    return Way(lambda x, w: few_rows(x, w, pdl=products), norms, inductor)


def _stand_in(qkv: torch.Tensor, width: int) -> torch.Tensor:
    return qkv[:, :width] * 1


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@contextlib.contextmanager
def launched_as(way: Way):
    """add_rms_norm launches as a dependent as the way says (it asks the device otherwise)."""
    from flare.serve.models import rms_norm

    chained = rms_norm.chained
    rms_norm.chained = lambda device: way.norms
    try:
        yield
    finally:
        rms_norm.chained = chained


def chain_step(weights: dict, x: torch.Tensor, way: Way) -> torch.Tensor:
    """A decode step's products and norms in order; attention is a copy of q's columns."""
    from flare.serve.models.rms_norm import add_rms_norm

    hidden, residual = x, torch.zeros_like(x)
    width = weights["hidden"]
    product = way.product
    for layer in weights["layers"]:
        normed, residual = add_rms_norm(hidden, residual, layer["norm"], 1e-5)
        qkv = product(normed, layer["qkv"])
        attended = way.attend(qkv, width)
        out = product(attended, layer["o"])
        normed, residual = add_rms_norm(out, residual, layer["norm"], 1e-5)
        hidden = product(way.silu_mul(product(normed, layer["gate_up"])), layer["down"])
    normed, _ = add_rms_norm(hidden, residual, weights["layers"][0]["norm"], 1e-5)
    return product(normed, weights["lm_head"])


def time_chain(weights: dict, x: torch.Tensor, way: Way) -> tuple[float, torch.Tensor]:
    """Seconds a step (the median of REPLAYS replays of its graph) and its logits."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), launched_as(way):
        chain_step(weights, x, way)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), launched_as(way):
        logits = chain_step(weights, x, way)
    return replay_seconds(graph, REPLAYS * 3), logits.clone()


def measure_chain(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 256
    ways = {
        "cublas": Way(lambda x, w: F.linear(x, w)),
        "few_rows": dependent(False, False, False),
        "dependent_all": dependent(True, True, True),
        "dependent_products": dependent(True, False, False),
        "dependent_norms_inductor": dependent(False, True, True),
    }
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for shape in args.shapes:
        weights = chain_weights(shape, "cuda")
        for rows in args.rows:
            x = torch.randn(rows, weights["hidden"], device="cuda", dtype=torch.bfloat16)
            entry: dict = {}
            reference = None
            for name, way in ways.items():
                try:
                    seconds, logits = time_chain(weights, x, way)
                except Exception as exc:
                    entry[name] = {"failed": f"{type(exc).__name__}: {exc}"[:200]}
                    continue
                reference = logits if reference is None else reference
                spread = float(reference.float().std())
                entry[name] = {
                    "step_us": round(seconds * 1e6, 1),
                    "max_diff_in_std": round(
                        float((logits.float() - reference.float()).abs().max()) / spread, 4
                    ),
                }
            base = entry.get("cublas", {}).get("step_us")
            for figures in entry.values():
                if base and "step_us" in figures:
                    figures["of_cublas"] = round(figures["step_us"] / base, 3)
            report[f"{shape}.chain.m{rows}"] = entry
            print(f"{shape}.chain.m{rows}: {entry}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--picked", action="store_true", help="time linear.tiling's choice only")
    parser.add_argument("--chain", action="store_true", help="time whole layers' products")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    report = measure_chain(args) if args.chain else measure(args)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "gpu_linear_chain.json" if args.chain else "gpu_linear.json"
        (args.out / name).write_text(json.dumps(report, indent=1))
    print(f"done in {report['seconds']} s")


if __name__ == "__main__":
    main()
