"""A lead for the start: the forward's graphs as AOTInductor packages, against the precompiled
graphs a start loads now.

A start loads the forward's three graphs (the first decoder layer's, the other layers', the
logits') as Dynamo's ahead-of-time compile saved them (serve/precompiled.py). Loading them
needs Dynamo's and Inductor's imports: 1.1 s and 1.9 s of the engine's main thread on the
H200's host, on the path to ready (docs/performance.md). AOTInductor compiles an exported
graph into a shared library with a C++ wrapper, which `torch._C._aoti.AOTIModelPackageLoader`
loads and runs with neither import. This script measures what that would change, on one
Llama of random weights (heads 64 wide, four query heads a KV head, as Llama-3.2-1B's),
each graph exported with the same inputs as flare's (weights and the layer's index as
inputs, attention as the `flare::paged_attention` operator, the token and row dimensions
dynamic), so a package of code alone serves every layer:

- a build, in a process of its own: the graphs compiled both ways into one folder (the
  precompiled way alone where this torch loads no AOTInductor package on the device, which
  is checked first);
- `--repeat` starts of each way in turn, each in a fresh process: torch's and flare's imports
  (alike in both), the imports the way needs to load its graphs (Dynamo's and Inductor's for
  the precompiled graphs, none for AOTInductor), the load, the warm-up (flare's `warm_up`,
  which calls every graph), then a decode step's median over `--steps` steps of four
  sequences (on CUDA replayed from decode graphs captured as a start captures them, and the
  capture's seconds); and which of Dynamo and Inductor the process had imported at its end, what
  imported Dynamo first and how long that import took (flare's operators, registered by
  `torch.library.custom_op`, import Dynamo at their first call, in the warm-up);
- a third way, `aoti-no-dynamo`: AOTInductor's with flare's operators registered as an
  integration would register them, their kernels kept from Dynamo only once Dynamo was
  imported (here by patching `torch._disable_dynamo` before flare's operators are defined);
- the logits of every step, each way against eager.

    python tests/bench/bench_aoti_start.py [--layers 16] [--hidden 512] [--repeat 3]
        [--device cpu|cuda] [--steps 30]

Prints JSON: each start's figures, their medians, and the logits' largest distance from
eager's. What fails is reported and the rest still measured, for one device call to tell as
much as it can: a graph AOTInductor does not compile (`aoti_failed`), or a torch that does
not load AOTInductor's packages on the device at all (`aoti_loads_here`, a product compiled
and loaded in a process of its own): then only the precompiled graphs start; a start's
process that fails (`failed`: its exit status, the ends of its output); a capture that
fails (`graphs_captured`, the error in place of the seconds: its steps then run
without graphs). Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

COMMON = """
import builtins, json, statistics, sys, time, traceback
began = time.perf_counter()
first_dynamo = []
_import = builtins.__import__


def _watch(name, *args, **kwargs):
    # the first import of Dynamo: where it was made, and how long it took
    if first_dynamo or not name.startswith("torch._dynamo") or "torch._dynamo" in sys.modules:
        return _import(name, *args, **kwargs)
    frames = [f for f in traceback.format_stack()[:-1] if "importlib" not in f]
    first_dynamo.append(frames[-1].strip().splitlines()[0])
    started = time.perf_counter()
    try:
        return _import(name, *args, **kwargs)
    finally:
        first_dynamo.append(time.perf_counter() - started)


builtins.__import__ = _watch
import functools
from pathlib import Path

import torch


def _disable_once_imported(fn=None, recursive=True):
    # torch._disable_dynamo as the AOTInductor way's operators would need it: Dynamo kept
    # out of an operator's kernel only where Dynamo was imported (none can run otherwise)
    if fn is None:
        return functools.partial(_disable_once_imported, recursive=recursive)

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            return torch._dynamo.disable(fn, recursive)(*args, **kwargs)
        return fn(*args, **kwargs)

    return kernel


if sys.argv[1] == "aoti-no-dynamo":  # before flare's operators are registered
    torch._disable_dynamo = _disable_once_imported

from flare.build.tiny import llama_config
from flare.serve import compiled
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.attention_op import OperatorAttention, bound_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.cuda_graphs import DecodeGraphs
from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sequence import SamplingParams, Sequence
from flare.serve.models import empty_model
from flare.serve.models.linear import linear

folder, layers, hidden, device = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
steps = int(sys.argv[6])
device = torch.device(device)
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
imported = time.perf_counter() - began
torch.manual_seed(0)
heads = hidden // 64  # Llama-3.2-1B's heads at hidden 2048: 64 wide, four queries a KV head
config = llama_config(2000, hidden, layers, heads, max(1, heads // 4))
model = empty_model("llama", 2, config, device, dtype)
with torch.no_grad():
    for parameter in model.parameters():
        parameter.normal_(0, 0.05)
weights = {id(layer): [p.detach() for p in layer.parameters()] for layer in model.model.layers}
table = model.model.embed_tokens.weight if model.tied else model.lm_head.weight


class AOTIForward:
    # flare's forward with each graph run by AOTInductor's loader, as CompiledForward runs
    # its graphs: the embeddings, the rotary rows and the final norm as they are between them

    def __init__(self, packages):
        # each run single-threaded: the container's threaded run hands the next call a model
        # only once the call before has ended on the device (cudaEventQuery, then
        # cudaEventSynchronize with one model), a wait at every layer's call that a CUDA
        # graph's capture also forbids
        self.operator = OperatorAttention()
        loader = torch._C._aoti.AOTIModelPackageLoader
        index = -1 if device.type == "cpu" else torch.cuda.current_device()
        self.graphs = {
            kind: loader(str(path), "model", True, 1, index) for kind, path in packages.items()
        }

    def _layer(self, layer, x, residual, rotary, attention):
        inputs = [x, rotary, layer.self_attn.layer, *weights[id(layer)]]
        if residual is None:
            return tuple(self.graphs["first"].run(inputs))
        return tuple(self.graphs["layers"].run([residual, *inputs]))

    def __call__(self, input_ids, positions, last, attention):
        with bound_attention(attention):
            hidden = model.forward(input_ids, positions, self.operator, self._layer)
            return self.graphs["logits"].run([hidden, last, table])[0]


def run_steps(forward, graphs=False):
    # one prefill of four prompts, then `steps` greedy decode steps: every step's logits and
    # the decode steps' median wall time; with `graphs` (CUDA), the decode steps replayed
    # from CUDA graphs captured as a start captures them (the seconds that took)
    _, attention = make_attention("auto", model.attention_spec, 256 * 16, 16, dtype, device)
    runner = ModelRunner(model, attention, 16, device, forward)
    blocks = BlockManager(255 if graphs else 256, 16)  # one block pads the graphs' rows
    if graphs and isinstance(attention, FlashInferPagedAttention):
        pages = 4 * ((100 + steps) // 16 + 2)
        decode = DecodeGraphs(forward, attention, 4, pages, 255)
        try:
            captured.append(decode.capture().seconds)
            runner.graphs = decode
        except Exception as exc:  # say why, and step without graphs
            captured.append(f"{type(exc).__name__}: {exc}"[:400])
    greedy = SamplingParams(temperature=0)
    seqs = [Sequence(list(range(1, n + 1)), greedy, max_tokens=steps + 2) for n in (1, 3, 37, 100)]
    for seq in seqs:
        blocks.allocate(seq)
    logits, walls = [runner.run(seqs, prefill=True).logits.float().cpu()], []
    for _ in range(steps):
        for row, seq in enumerate(seqs):
            seq.append(int(logits[-1][row].argmax()))
            blocks.append_slot(seq)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = runner.run(seqs, prefill=False).logits
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - started)
        logits.append(out.float().cpu())
    return runner, blocks, logits, statistics.median(walls)


captured = []
"""

BUILD = (
    COMMON
    + """
from torch import nn

compiled.settings()
compiled.use_cache_folder(folder / "inductor")
with torch.inference_mode():
    forward = compiled.CompiledForward(model)
    runner, blocks, eager, _ = run_steps(None)
    compiled.warm_up(ModelRunner(model, runner.attention, 16, device, forward), blocks)
forward.save(folder / "graphs")
tokens, rows = torch.export.Dim("tokens", max=65536), torch.export.Dim("rows", max=65536)


class LayerGraph(nn.Module):
    # a decoder layer with its weights and its index as inputs: one graph for every layer
    def __init__(self, template):
        super().__init__()
        self.names = [name for name, _ in template.named_parameters()]
        self.template = [template]  # in a list: not a submodule, whose weights export would keep

    def forward(self, residual, x, rotary, index, *tensors):
        layer = self.template[0]
        layer.self_attn.layer = index
        given = dict(zip(self.names, tensors))
        inputs = (x, residual, rotary, OperatorAttention())
        return torch.func.functional_call(layer, given, inputs)


class FirstGraph(LayerGraph):
    def forward(self, x, rotary, index, *tensors):
        return super().forward(None, x, rotary, index, *tensors)


class LogitsGraph(nn.Module):
    def forward(self, hidden, last, weight):
        return linear(hidden[last], weight, None)


n = 5
x = torch.randn(n, hidden, device=device, dtype=dtype)
rotary = model.model.rotary(torch.arange(n, device=device))
index = model.model.layers[1].self_attn.layer
tensors = tuple(weights[id(model.model.layers[1])])
per_token = {0: tokens}
cases = {
    "first": (FirstGraph(model.model.layers[0]), (x, rotary, index, *tensors),
              (per_token, per_token, None, (None,) * len(tensors))),
    "layers": (LayerGraph(model.model.layers[1]), (x.clone(), x, rotary, index, *tensors),
               (per_token, per_token, per_token, None, (None,) * len(tensors))),
    "logits": (LogitsGraph(), (x, torch.tensor([1, 4], device=device), table),
               (per_token, {0: rows}, None)),
}
seconds, failed = {}, {}
for kind, (graph, args, dynamic) in cases.items() if sys.argv[1] == "build" else ():
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            exported = torch.export.export(graph, args, dynamic_shapes=dynamic)
        path = str(folder / f"{kind}.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=path)
    except Exception as exc:  # say why: the precompiled graphs are still measured
        failed[kind] = f"{type(exc).__name__}: {exc}"[:1000]
    seconds[kind] = round(time.perf_counter() - started, 2)
torch.save(eager, folder / "eager.pt")
print(json.dumps({"aoti_compile_s": seconds, "aoti_failed": failed}))
"""
)

START = (
    COMMON
    + """
way = sys.argv[1]
started = time.perf_counter()
if way == "precompiled":  # Inductor's settings, its cache and the engine's backend imports
    compiled.settings()
    compiled.use_cache_folder(folder / "inductor")
    import torch._inductor.compile_fx  # noqa: F401
    from flare.serve import precompiled  # noqa: F401
backends = time.perf_counter() - started
started = time.perf_counter()
if way == "precompiled":
    forward = compiled.CompiledForward(model, folder / "graphs")
else:
    forward = AOTIForward({kind: folder / f"{kind}.pt2" for kind in ("first", "layers", "logits")})
loaded = time.perf_counter() - started
started = time.perf_counter()
with torch.inference_mode():
    _, attention = make_attention("auto", model.attention_spec, 64 * 16, 16, dtype, device)
    compiled.warm_up(ModelRunner(model, attention, 16, device, forward), BlockManager(64, 16))
    if way == "precompiled":
        forward.trust_guards()
    warm = time.perf_counter() - started
    ready = time.perf_counter() - began
    _, _, logits, step = run_steps(forward, graphs=device.type == "cuda")
eager = torch.load(folder / "eager.pt")
distance = max(float((a - b).abs().max()) for a, b in zip(logits, eager, strict=True))
print(json.dumps({
    "way": way, "imports_s": imported, "backend_imports_s": backends, "load_s": loaded,
    "warm_up_s": warm, "ready_s": ready, "decode_step_ms": 1000 * step,
    "max_abs_from_eager": distance, "graphs_captured": captured[0] if captured else None,
    "not_loaded": getattr(forward, "not_loaded", ""),
    "dynamo_imported": "torch._dynamo" in sys.modules,
    "inductor_imported": "torch._inductor" in sys.modules,
    "dynamo_first_imported_at": first_dynamo[0] if first_dynamo else None,
    "dynamo_import_s": first_dynamo[1] if first_dynamo else 0.0,
}))
"""
)


LOADS = """
import json, sys, tempfile
from pathlib import Path

import torch

device = torch.device(sys.argv[2])


class Product(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w) + 1


x, w = torch.randn(8, 64, device=device), torch.randn(64, 64, device=device)
path = str(Path(tempfile.mkdtemp()) / "product.pt2")
torch._inductor.aoti_compile_and_package(torch.export.export(Product(), (x, w)), package_path=path)
loaded = torch._inductor.aoti_load_package(path)
print(json.dumps({"max_abs": float((loaded(x, w) - Product()(x, w)).abs().max())}))
"""
"""Whether this torch loads an AOTInductor package on the device at all: a product and an
add, no flare (torch 2.11.0+cu130 on the device's CUDA hosts dies of a segmentation fault in
the load, twenty-sixth session)."""

FIGURES = (
    *("imports_s", "backend_imports_s", "load_s", "warm_up_s", "ready_s", "dynamo_import_s"),
    *("decode_step_ms", "max_abs_from_eager"),
)
"""What each way's starts are summed up by: their medians."""


def run(script: str, *args: str) -> dict[str, object]:
    """`script` in a fresh process (what a start is): its last line's JSON, or where the
    process failed, `failed`: its exit status and the ends of what it printed."""
    command = [sys.executable, "-X", "faulthandler", "-c", script, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:  # a signal's death prints nothing but faulthandler's stacks
        ends = f"stderr: {done.stderr[-2500:]}; stdout: {done.stdout[-500:]}"
        return {"way": args[0], "failed": f"exit {done.returncode}; {ends}"}
    return json.loads(done.stdout.splitlines()[-1])


def medians(figures: list[dict[str, object]]) -> dict[str, float] | None:
    """The starts' medians of FIGURES, over those that did not fail (None: all failed)."""
    done = [start for start in figures if "failed" not in start]
    if not done:
        return None
    return {key: statistics.median(float(start[key]) for start in done) for key in FIGURES}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flare-aoti-") as scratch:
        shape = (scratch, str(args.layers), str(args.hidden), args.device, str(args.steps))
        loads = run(LOADS, "loads", args.device)  # first: no AOTInductor compile for nothing
        report: dict[str, object] = {"aoti_loads_here": "failed" not in loads}
        if "failed" in loads:
            report["aoti_load_failed"] = loads["failed"]
        build = run(BUILD, "build" if "failed" not in loads else "build-precompiled", *shape)
        report["build"] = build
        if "failed" in build:
            print(json.dumps(report, indent=2))
            return 1
        usable = "failed" not in loads and not build["aoti_failed"]
        aoti = ["aoti", "aoti-no-dynamo"] if usable else []
        starts: dict[str, list[dict[str, object]]] = {way: [] for way in ["precompiled", *aoti]}
        for _ in range(args.repeat):
            for way, figures in starts.items():
                figures.append(run(START, way, *shape))
        report["starts"] = starts
        report["medians"] = {way: medians(figures) for way, figures in starts.items()}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
