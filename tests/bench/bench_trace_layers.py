"""What Dynamo's trace of the forward costs a start, by the number of decoder layers.

A server's warm-up traces the whole step (every layer) before Inductor loads the package's
graph; on the H200 that trace is most of the warm-up (docs/performance.md, "Start to
ready"). This script times the first step of flare's forward under torch.compile with
Dynamo's `eager` backend (the trace alone: no Inductor, nothing compiled), for Llamas that
differ only in their layer count, each in a fresh process. The fixed part is what compiling
one layer and reusing it for every layer would cost; the part that grows is what it saves.

    python tests/bench/bench_trace_layers.py [--layers 1 2 16 32]

Prints JSON: seconds of the first (traced) step and of the second (the traced code, run) for
each layer count.
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


blocks = BlockManager(64, 16)
runner = ModelRunner(model, attention, 16, cpu, forward)
seconds = []
for prompt in ([1, 2, 3], [4, 5, 6, 7]):
    seq = Sequence(prompt, SamplingParams(temperature=0), max_tokens=2)
    blocks.allocate(seq)
    started = time.perf_counter()
    runner.run([seq], prefill=True)
    seconds.append(round(time.perf_counter() - started, 3))
print(json.dumps(seconds))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 2, 16, 32])
    args = parser.parse_args()
    report = {}
    for layers in args.layers:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", ONE, str(layers)], capture_output=True, text=True, check=True
        )
        traced, run = json.loads(done.stdout.splitlines()[-1])
        report[layers] = {"traced_step_s": traced, "second_step_s": run}
        report[layers]["process_s"] = round(time.perf_counter() - started, 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
