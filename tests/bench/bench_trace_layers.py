"""What Dynamo's trace of the forward costs a start, by the number of decoder layers.

A server's warm-up traces the whole step (every layer) before Inductor loads the package's
graph; on the H200 that trace is most of the warm-up (docs/performance.md, "Start to
ready"). This script times the first step of flare's forward under torch.compile with
Dynamo's `eager` backend (the trace alone: no Inductor, nothing compiled), for Llamas that
differ only in their layer count, each in a fresh process: `whole` traces the step as the
server does; `regional` traces one decoder layer's call and reuses it for every layer after
the first (each layer's attention holds its index as a tensor, an input of the graph, as
serve/compiled.py's CompiledForward compiles it; the first layer runs uncompiled here).

    python tests/bench/bench_trace_layers.py [--layers 1 2 16 32]

Prints JSON: for each way and layer count, seconds of the first (traced) step, of the steps
after it (the traced code, run), and the graphs Dynamo made.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

ONE = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
from flare.build.tiny import llama_config
from flare.serve.engine.attention_choice import make_attention
from flare.serve.engine.attention_op import OperatorAttention, bound_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sequence import SamplingParams, Sequence
from flare.serve.models.llama import LlamaForCausalLM

with torch.device("meta"):
    model = LlamaForCausalLM(llama_config(1000, 256, int(sys.argv[1]), 8, 4))
model = model.to_empty(device="cpu").float().eval()
for param in model.parameters():
    torch.nn.init.normal_(param, 0.0, 0.02)
cpu = torch.device("cpu")
_, attention = make_attention("torch", model.attention_spec, 64 * 16, 16, torch.float32, cpu)
operator = OperatorAttention()
layers = model.model.layers
if sys.argv[2] == "whole":
    step = torch.compile(
        lambda ids, pos, last: model.compute_logits(model.forward(ids, pos, operator)[last]),
        backend="eager",
        fullgraph=True,
    )

    def forward(ids, pos, last, bound):
        for tensor in (ids, pos, last):
            torch._dynamo.decorators.mark_unbacked(tensor, 0)
        with bound_attention(bound):
            return step(ids, pos, last)
else:
    run_layer = torch.compile(
        lambda layer, x, residual, rotary: layer(x, residual, rotary, operator),
        backend="eager",
        fullgraph=True,
    )

    def forward(ids, pos, last, bound):
        with bound_attention(bound):
            rotary = model.model.rotary(pos)
            x, residual = layers[0](model.model.embed_tokens(ids), None, rotary, operator)
            for layer in layers[1:]:
                for tensor in (x, residual, rotary):
                    torch._dynamo.decorators.mark_unbacked(tensor, 0)
                x, residual = run_layer(layer, x, residual, rotary)
            return model.compute_logits(model.model.norm.add(x, residual)[0][last])


blocks = BlockManager(64, 16)
runner = ModelRunner(model, attention, 16, cpu, forward)
seconds = []
for prompt in ([1, 2, 3], [4, 5, 6, 7], [8, 9]):
    seq = Sequence(prompt, SamplingParams(temperature=0), max_tokens=2)
    blocks.allocate(seq)
    started = time.perf_counter()
    runner.run([seq], prefill=True)
    seconds.append(round(time.perf_counter() - started, 3))
print(json.dumps([seconds[0], max(seconds[1:]), counters["stats"]["unique_graphs"]]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 2, 16, 32])
    args = parser.parse_args()
    report: dict[str, dict] = {}
    for way in ("whole", "regional"):
        for layers in args.layers:
            started = time.perf_counter()
            command = [sys.executable, "-c", ONE, str(layers), way]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            traced, after, graphs = json.loads(done.stdout.splitlines()[-1])
            report.setdefault(way, {})[layers] = {
                "traced_step_s": traced,
                "later_steps_s": after,
                "graphs": graphs,
                "process_s": round(time.perf_counter() - started, 2),
            }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
