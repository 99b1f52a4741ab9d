"""Where a decode step's time goes: host time against GPU time per engine step, and kernel
launches, for N sequences decoding (N = 1, 16, 64), on each step path (runtime_package.PATHS).

    python tests/bench/gpu_step_profile.py [--shapes 1b] [--out DIR]
    python tests/bench/gpu_step_profile.py --device cpu --shapes tiny   # the script's own check

The shape's package (gpu_serving.py's checkpoint: random bf16 Llama weights, the real
vocabulary) is built by `flare build --target TARGET --max-concurrency 64` (default target: the
device) and loaded in this process as `flare serve` loads it (runtime_package.py), once per
decode path: CUDA graphs and eager where this flare's `load_runtime` has the `cuda_graphs`
switch, eager alone before. Its engine is not started: this thread steps it, as the engine's
loop does. For each N, N greedy requests (32-token prompts, `ignore_eos`) are submitted and
stepped through their prefill and WARMUP decode steps, then:

- host time: the wall of each of STEPS `engine.step()` calls, nothing subtracted (the step
  reads the sampled tokens, so it waits for the GPU where the GPU is the slower); median, p90;
- the host time by phase: STEPS more steps with the engine's phases timed where they are
  called (`host_us_per_step`: scheduling, the step's input lists, the step's run (on a GPU
  its launch; on a CPU the forward itself), and within it on the CUDA-graph path the
  staging of a step (a prefill graph's with FlashInfer's plan) and the replay, the
  sampler's launch, the landing of a step with its wait for the device apart, and the
  delivery of its tokens: detokenizing, the deltas), each phase's microseconds a step,
  nested ones inside their caller's (a timer costs about 0.3 µs a call, and delivery is one
  call a sequence);
- on CUDA, PROFILED more steps under torch.profiler: the GPU's time per step (the union of
  the kernels' and copies' spans: kernels launched as dependents overlap the one ahead, so
  their sum, also given, counts some time twice), the GPU busy share (that over the host
  time), the device's gaps per step
  (seams between kernels under SEAM_US, and idle time waiting for the host), and per step the
  kernels run, the launch calls the host made (kernel launches; graph launches apart),
  host-to-device copies and stream or device synchronisations, and the last step's kernels in
  order (`last_step`: which kernels a step is made of, what fused and what did not).

Then the first token of one LONG_PROMPT-token prompt alone (gpu_serving.py's 8K case, without
HTTP): its wall from submission to the token landed, the host phases of those steps, and on
CUDA the GPU's busy time and kernels for it; with `--py-spy BIN`, py-spy's frames with the
most samples over a few more (where a prefill's launch spends its host time). Then the same
for SHORT_PREFILL (16 prompts of 32 tokens prefilled together: the 16-stream case's first
tokens, which prefill graphs replay on the `prefill_graphs` path), without py-spy.

On the CPU it reports host time only. Nothing asserts on time: it prints a table (stderr) and
one JSON report (stdout, and under --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from gpu_package import publish
from gpu_serving import SHAPES, make_checkpoint, py_spy
from runtime_package import PATHS, build, load, scratch_home

from flare.serve.runtime import GenerateRuntime, SamplingParams

WIDTHS = (1, 16, 64)
PROMPT = 32
LONG_PROMPT = 8192
SHORT_PREFILL = (16, PROMPT)
"""The 16-stream case's first tokens: 16 prompts prefilled together."""
PREFILLS = 3
SPIED = 24
"""Prefills run under py-spy: about 500 samples of 8K-token prefills at its 500 a second (3
gave 41 on the H200, too few to rank frames)."""
WARMUP = 8
STEPS = 32
PROFILED = 8
TOP = 25
SEAM_US = 20.0
"""Gaps between device activities shorter than this are seams between kernels; longer ones,
the GPU idle (waiting for the host)."""
KV_CACHE_TOKENS = 16384
LAUNCHES = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
}
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch"}
COPIES = {"cudaMemcpyAsync", "cudaMemcpy", "cuMemcpyHtoDAsync_v2", "cuMemcpyAsync"}
SYNCS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}


def profile_path(runtime: GenerateRuntime, device: str) -> dict[str, Any]:
    """Every width's figures on one runtime, by width."""
    return {str(n): profile_width(runtime, n, device) for n in WIDTHS}


def profile_width(runtime: GenerateRuntime, n: int, device: str) -> dict[str, Any]:
    """N sequences decoding: host time per step, and (CUDA) the profiler's figures."""
    engine = runtime.engine
    budget = WARMUP + 2 * STEPS + PROFILED + 2  # the timed steps, host_phases', the profiled
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    generator = torch.Generator().manual_seed(n)
    prompts = torch.randint(2, runtime.vocab_size, (n, PROMPT), generator=generator).tolist()
    handles = [runtime.submit(prompt, params) for prompt in prompts]
    for _ in range(1 + WARMUP):  # the prefill, then decode steps
        engine.step()
    scheduler = engine.scheduler
    if scheduler.waiting or len(scheduler.running) != n:
        raise RuntimeError(f"{len(scheduler.running)} of {n} sequences decode together")
    walls = []
    generated = engine.counters.generated_tokens
    for _ in range(STEPS):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
    if engine.counters.generated_tokens - generated != n * STEPS:
        raise RuntimeError("a timed step was not a decode of every sequence")
    host = statistics.median(walls)
    out: dict[str, Any] = {
        "host_ms_per_step": round(1000 * host, 3),
        "host_ms_p90": round(1000 * sorted(walls)[int(0.9 * len(walls))], 3),
        "tokens_per_s": round(n / host, 1),
        "host_us_per_step": host_phases(engine, n),
    }
    if device == "cuda":
        out |= kernel_figures(engine.step, host)
    for handle in handles:
        handle.cancel()
    engine.step()  # takes the cancellations: every sequence's blocks are free again
    return out


def profile_prefill(
    runtime: GenerateRuntime,
    device: str,
    spy: Path | None = None,
    raw: Path | None = None,
    prompts: tuple[int, int] = (1, LONG_PROMPT),
) -> dict[str, Any]:
    """`prompts` (count, tokens: by default one LONG_PROMPT-token prompt, gpu_serving.py's
    first-token case) submitted together, in-process: the wall from their submission to
    their one token each landed (median of PREFILLS, after one untimed), those steps' host
    phases, and on CUDA one more under the profiler: how much of a first token is the GPU's,
    in which kernels. With py-spy (`spy`, its samples to `raw`), SPIED more under it:
    where the host's time in them goes, by frame."""
    engine = runtime.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    generator = torch.Generator().manual_seed(LONG_PROMPT)
    count, length = prompts[0], min(prompts[1], runtime.context_length - 1)  # a tiny model's

    def first_token() -> None:
        handles = []
        for _ in range(count):
            prompt = torch.randint(2, runtime.vocab_size, (length,), generator=generator)
            handles.append(runtime.submit(prompt.tolist(), params))
        engine.step()  # takes the requests from the engine's inbox and launches their prefill
        while engine.busy():  # until the step that sampled their tokens has landed
            engine.step()
        for handle in handles:
            if len([t for delta in handle for t in delta.token_ids]) != 1:
                raise RuntimeError("a prompt's request did not end with its one token")

    walls = []
    for _ in range(PREFILLS + 1):
        started = time.perf_counter()
        first_token()
        walls.append(time.perf_counter() - started)
    host = statistics.median(walls[1:])
    out = {
        "prompts": count,
        "prompt": length,
        "host_ms": round(1000 * host, 2),
        "host_us": host_phases(engine, 0, steps=1, work=first_token),
    }
    if device == "cuda":
        figures = kernel_figures(first_token, host, runs=1)
        out |= {k: figures[k] for k in ("gpu_ms_per_step", "kernels_per_step", "top_kernels")}
    if spy is not None:
        with py_spy(os.getpid(), spy, raw) as frames:
            for _ in range(SPIED):
                first_token()
        out["py_spy"] = frames
    return out


def host_phases(
    engine: Any, n: int, steps: int = STEPS, work: Callable[[], None] | None = None
) -> dict[str, float]:
    """`steps` runs of `work` (default: an engine step of the n sequences decoding), with
    each phase of the host's work timed where it is called: microseconds a run by phase
    (nested phases also count in their caller's)."""
    from flare.serve.engine.flashinfer_attention import FlashInferGraphPrefill

    spent: dict[str, float] = {}
    runner, graphs = engine.runner, engine.runner.graphs
    phases = [
        ("schedule", engine.scheduler, "schedule"),
        ("step input", runner, "step_input"),
        ("run step (its launch on a GPU)", runner, "run_step"),
        ("sampler launch", engine.sampler, "launch"),
        ("land", engine, "_land"),
        ("deliver", engine, "_deliver"),
    ]
    if graphs is not None:
        phases += [
            ("graph: stage", graphs, "_fill"),
            ("graph: replay", torch.cuda.CUDAGraph, "replay"),
        ]
    if getattr(runner, "prefills", None) is not None:  # a flare with prefill graphs
        phases += [
            ("prefill graph: stage", runner.prefills, "_fill"),
            ("prefill graph: FlashInfer plan", FlashInferGraphPrefill, "plan_pages"),
        ]
    waited = engine.counters.device_wait_seconds
    generated = engine.counters.generated_tokens
    with ExitStack() as stack:
        for name, owner, attribute in phases:
            stack.enter_context(_timed(spent, name, owner, attribute))
        started = time.perf_counter()
        for _ in range(steps):
            (work or engine.step)()
        whole = time.perf_counter() - started
    if n and engine.counters.generated_tokens - generated != n * steps:
        raise RuntimeError("a step timed by phase was not a decode of every sequence")
    spent["land: device wait"] = engine.counters.device_wait_seconds - waited
    spent["step"] = whole
    return {name: round(1e6 * seconds / steps, 1) for name, seconds in spent.items()}


@contextmanager
def _timed(spent: dict[str, float], name: str, owner: Any, attribute: str) -> Iterator[None]:
    """`owner.attribute` (an object's method, a class's, or a module's function) timed into
    spent[name] for the length of the block, then put back as it was."""
    before = vars(owner).get(attribute, _MISSING)
    original: Callable[..., Any] = getattr(owner, attribute)

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

    setattr(owner, attribute, timed)
    try:
        yield
    finally:
        if before is _MISSING:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, before)


_MISSING = object()


def kernel_figures(step: Any, host: float, runs: int = PROFILED) -> dict[str, Any]:
    """`runs` steps under torch.profiler: GPU time, kernels and host calls, per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            step()
        torch.cuda.synchronize()
    gpu_us = kernels = 0
    sequence: list[tuple[float, str, float]] = []
    calls = {"launches": 0, "graph_launches": 0, "copies": 0, "syncs": 0}
    by_name: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            gpu_us += event.time_range.elapsed_us()
            spans.append((event.time_range.start, event.time_range.end))
            kernels += not event.name.startswith(("Memcpy", "Memset"))
            sequence.append((event.time_range.start, event.name, event.time_range.elapsed_us()))
            by_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
            continue
        for kind, names in (
            ("launches", LAUNCHES),
            ("graph_launches", GRAPH_LAUNCHES),
            ("copies", COPIES),
            ("syncs", SYNCS),
        ):
            calls[kind] += event.name in names
    busy, seams, idle = gaps(spans)
    gpu_ms = busy / 1000 / runs
    return {
        "gpu_ms_per_step": round(gpu_ms, 3),
        "kernel_ms_sum_per_step": round(gpu_us / 1000 / runs, 3),
        "gpu_busy_share": round(gpu_ms / (1000 * host), 3),
        "gpu_seams_ms_per_step": round(seams / 1000 / runs, 3),
        "gpu_idle_ms_per_step": round(idle / 1000 / runs, 3),
        "kernels_per_step": round(kernels / runs, 1),
        **{f"{kind}_per_step": round(count / runs, 1) for kind, count in calls.items()},
        "top_kernels": top_kernels(by_name, runs),
        "last_step": last_step(sequence, runs),
    }


def gaps(spans: list[tuple[float, float]]) -> tuple[float, float, float]:
    """The device's busy time (microseconds: the union of its kernels' and copies' spans, as
    kernels launched as dependents start before the one ahead ends and overlap it), and its
    time between them in two sums: seams, gaps shorter than SEAM_US (one kernel ending, the
    next starting: inside a graph replay they are the GPU's own cost, launch overhead that a
    graph does not remove), and idle, the longer ones (the GPU waiting for the host)."""
    seams = idle = 0.0
    end = None
    ordered = sorted(spans)
    for start, stop in ordered:
        if end is not None and start > end:
            gap = start - end
            if gap < SEAM_US:
                seams += gap
            else:
                idle += gap
        end = stop if end is None else max(end, stop)
    busy = end - ordered[0][0] - seams - idle if ordered else 0.0
    return busy, seams, idle


def top_kernels(by_name: dict[str, list[float]], runs: int) -> list[dict[str, Any]]:
    """The TOP kernels by GPU time per step: name (cut), runs and microseconds per step."""
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP]
    return [
        {
            "name": name[:90],
            "runs_per_step": round(len(times) / runs, 1),
            "us_per_step": round(sum(times) / runs, 1),
            "us_each": round(statistics.mean(times), 2),
        }
        for name, times in ranked
    ]


def last_step(sequence: list[tuple[float, str, float]], runs: int) -> list[list[Any]]:
    """The last profiled step's device work in order, [name, microseconds] each: which
    kernels a step is made of, what fused and what did not."""
    ordered = sorted(sequence)
    return [[name[:120], round(us, 2)] for _, name, us in ordered[-(len(ordered) // runs) :]]


def table(reports: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table, one row per shape, path and width."""
    columns = (
        "host_ms_per_step",
        "gpu_ms_per_step",
        "gpu_busy_share",
        "gpu_seams_ms_per_step",
        "gpu_idle_ms_per_step",
        "launches_per_step",
        "graph_launches_per_step",
        "kernels_per_step",
        "copies_per_step",
        "syncs_per_step",
        "tokens_per_s",
    )
    lines = [
        "| shape | path | N | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for report in reports:
        for path, measured in report["paths"].items():
            for width, figures in measured["widths"].items():
                cells = [str(figures.get(c, "")) for c in columns]
                lines.append(
                    f"| {report['shape']} | {path} | {width} | " + " | ".join(cells) + " |"
                )
    return "\n".join(lines)


def measure(args: argparse.Namespace, name: str, env: dict[str, str], work: Path) -> dict:
    folder = work / name
    samples = args.out or work  # py-spy's raw samples: kept under --out, for a flame graph
    samples.mkdir(parents=True, exist_ok=True)
    make_checkpoint(folder, SHAPES[name], args.device)
    width = ("--max-concurrency", str(max(WIDTHS)))
    report: dict[str, Any] = {
        "shape": name,
        "build_phases": build(env, folder, name, args.target, *width),
        "paths": {},
    }
    for path, options in PATHS:
        if path not in args.paths.split(","):
            continue
        runtime = load(name, args.device, kv_cache_tokens=KV_CACHE_TOKENS, **options)
        assert isinstance(runtime, GenerateRuntime)
        report["paths"][path] = {
            "start": runtime.start_report.describe(),
            "widths": profile_path(runtime, args.device),
            "prefill": profile_prefill(
                runtime, args.device, args.py_spy, samples / f"prefill_{name}_{path}.raw"
            ),
            "short_prefill": profile_prefill(runtime, args.device, prompts=SHORT_PREFILL),
            "compilations_after_ready": runtime.compilations_since_ready().total,
        }
        runtime.stop()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", default="1b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--target", default=None, help="the build target (default: the device)")
    parser.add_argument("--paths", default=",".join(p for p, _ in PATHS), help="decode paths")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--py-spy", type=Path, default=None, help="profile the prefills with it")
    args = parser.parse_args()
    args.target = args.target or args.device
    with scratch_home("flare-gpu-step-profile-") as (work, env):
        reports = [measure(args, name, env, work) for name in args.shapes.split(",")]
    summary = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "target": args.target,
        "shapes": reports,
    }
    rows = table(reports)
    print(rows, file=sys.stderr)
    publish(summary, args.out, "gpu_step_profile.json")
    if args.out:
        (args.out / "gpu_step_profile.md").write_text(rows + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
