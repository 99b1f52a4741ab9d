"""What `flare build`'s tune and compile phases run: this runtime's own code, in a fresh process.

    python -m flare.serve.prepare tune SPEC.json OUT.json
    python -m flare.serve.prepare compile SPEC.json OUT_FOLDER

build runs this as a program rather than importing it: what is prepared must come from the
code that serves it, and a fresh process starts with empty in-memory compile caches (a kernel
an earlier compile in the same process loaded would otherwise be missing from the folder that
is packed) and with TORCHINDUCTOR_CACHE_DIR set before the compiler is imported. Build sets
PYTHONHASHSEED so nothing ordered by a string hash differs between builds.

tune writes the tuning records (serve/tuning.py). compile writes `forward.tar`, the Inductor
cache folder of the compiled forward (serve/inductor_archive.py), and `result.json`: the
shapes it covers and what compiling it took. On a CPU the folder holds Inductor's graphs of
the forward and their kernels. On CUDA, where a forward calls flare's own kernels directly
and runs eagerly on them (serve/artifacts.py), it holds those kernels: the FlashInfer
modules its attention built (serve/flashinfer_modules.py) and the Triton kernels of its
norms, activation and KV store, of its few-row products at every block of rows they take
(serve/models/linear.py), of its decode graphs' inputs and greedy picks
(serve/engine/graph_step.py) and of their attention (serve/engine/decode_attention.py). A
failure prints one line on stderr and exits 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flare.serve import compilations, flashinfer_modules
from flare.serve.compiled import CompiledForward, use_cache_folder, warm_up
from flare.serve.engine import decode_attention, graph_step
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.flashinfer_attention import FlashInferPagedAttention
from flare.serve.engine.runner import ModelRunner
from flare.serve.inductor_archive import PRECOMPILED, pack
from flare.serve.models import empty_model, linear
from flare.serve.tuning import Decisions, tune

ARCHIVE = "forward.tar"
RESULT = "result.json"
WARM_UP_BLOCKS = 16
"""KV blocks the compile's own runner has: enough for warm-up's few short sequences."""


def compile_forward(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """Compile the forward of the spec's model shapes in a fresh Inductor cache under `out`
    (on CUDA, only the kernels it runs), pack that cache, and say what it covers."""
    started = time.perf_counter()
    cuda = spec["target"] == "cuda"
    use_cache_folder(out / "inductor")
    if cuda:
        flashinfer_modules.build_into(out)
    decisions = Decisions.from_records(spec["records"])
    device, dtype = torch.device(spec["target"]), decisions.torch_dtype
    recipe = spec["recipe"]
    model = empty_model(recipe["name"], recipe["version"], spec["config"], device, dtype)
    block = decisions.page_size
    _, attention = make_attention(
        decisions.backend,
        model.attention_spec,
        WARM_UP_BLOCKS * block,
        block,
        dtype,
        device,
        decisions.variant,
    )
    compilations.watch(compiler=not cuda)
    forward = None if cuda else CompiledForward(model)
    runner = ModelRunner(model, attention, block, device, forward)
    before = compilations.snapshot()
    warm_up(runner, BlockManager(WARM_UP_BLOCKS, block))
    if cuda:
        linear.build_kernels(device)
    if isinstance(attention, FlashInferPagedAttention):  # it serves decodes from CUDA graphs
        graph_step.build_kernels(model.vocab_size, dtype, device)
        decode_attention.build_kernels(model.attention_spec, block, dtype, device)
    made = compilations.snapshot() - before
    if forward is not None:
        _check_graphs(made, forward)
        forward.save(out / "inductor" / PRECOMPILED)
    modules = flashinfer_modules.collect(out, out / "inductor") if cuda else []
    if decisions.backend == "flashinfer" and not modules:
        raise RuntimeError("FlashInfer built no kernel module in the compile's workspace")
    members = pack(out / "inductor", out / ARCHIVE)
    shapes = {
        **spec["plan"],
        "dtype": decisions.dtype,
        "kv_block_size": block,
        "dynamic": ["tokens", "sequences"],
    }
    return {
        "shapes": shapes,
        "members": len(members),
        "kernels": made.kernels,
        "seconds": time.perf_counter() - started,
        "not_ahead": forward.not_ahead if forward is not None else "",
    }


def _check_graphs(made: compilations.Compilations, forward: CompiledForward) -> None:
    """A warm-up traces and compiles each of the forward's graphs once: more is a recompile,
    which a batch of another size would cause at serve."""
    if made.compiled != forward.graphs or made.traced != forward.graphs:
        raise RuntimeError(
            f"the forward compiled into {made.describe()}, not {forward.graphs} graphs"
        )


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("tune", "compile"):
        print(__doc__, file=sys.stderr)
        return 2
    action, spec_path, out = argv[0], Path(argv[1]), Path(argv[2])
    spec = json.loads(spec_path.read_text())
    try:
        if action == "tune":
            records = tune(spec["target"], spec["shapes"], spec["decode_batch_sizes"])
            out.write_text(json.dumps(records))
        else:
            out.mkdir(parents=True, exist_ok=True)
            result = compile_forward(spec, out)
            (out / RESULT).write_text(json.dumps(result))
    except Exception as exc:  # any failure: one line for the build to show
        print(f"{action} failed: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
