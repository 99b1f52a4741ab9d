"""What a server's start builds: each Triton kernel `flare serve` compiles before its ready
line, with its specialization, against those the build compiled.

    python tests/bench/gpu_start_kernels.py [--shape 1b] [--layers 2] [--starts N]
        [--py-spy BIN] [--against PARENT] [--out DIR]

A package carries the kernels its forward launches (the compile phase's Triton cache, packed);
a start that builds one launched it otherwise than any launch at build: another constant, or
an argument Triton specializes (a pointer 16-byte aligned, an integer divisible by 16 or equal
to 1) that differs. The script builds gpu_serving.py's checkpoint of the shape, cut to
`--layers` layers (a build of minutes, the same products), with `--max-concurrency 64` as
gpu_serving.py does, then serves it; both run with a Triton compile listener (installed by a
sitecustomize module on their PYTHONPATH) that logs every kernel Triton compiles rather than
finds in its cache: its name, constants, specialized arguments, signature, and the metadata
Triton keys its cache with (the key's hash, the options, the cache-invalidating environment),
with the cache folder it looked in. It reports the ready line, and each kernel the start
built beside the build's launches of the same kernel: where the two agree on everything but
the hash, the difference is in what Triton hashes besides them.

With --py-spy BIN, the package is served a second time under py-spy (every process, idle
samples included, 100 a second) until its ready line: its trace (Chrome's trace format,
timestamped) goes to DIR/start_spy.json, and the report gives each process's timeline: when
each step of the start began and ended, in seconds from the command's launch, and its seconds
on the stack (the API process's imports and pull, the engine's preparation, weights, trace
and graph capture apart). The first start runs with the kernel listener, which imports
Triton as each process starts (0.3-0.4 s a process on the H200's host); the others
(`--starts N`, `again` in the report) run bare: theirs are the figures.

With --against PARENT (a folder whose `flare` is another tree of this project, such as a git
worktree of an older commit linked as PARENT/flare), each of the --starts bare starts is
followed by one of the same package served by that flare (on PYTHONPATH first), and the report
gives both series and their medians: a change's effect on the start, measured in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import scratch
from gpu_package import flare, start_server
from gpu_serving import MAX_STREAMS, SHAPES, make_checkpoint

SPY_RATE = 100
"""py-spy's samples a second on the start."""

LISTENER = """
import json, os
knobs = None
if os.environ.get("KERNEL_LOG"):  # Triton's import only where asked: 0.3-0.4 s a process
    try:
        from triton import knobs
    except Exception:
        pass
if knobs is not None:
    previous = knobs.compilation.listener

    def listen(*args, **kwargs):
        given = dict(zip(("src", "metadata", "metadata_group", "times", "cache_hit"), args))
        given.update(kwargs)
        if not given.get("cache_hit"):
            src = given.get("src")
            metadata = given.get("metadata") or {}
            entry = {
                "name": getattr(src, "name", "?"),
                "constants": repr(getattr(src, "constants", None)),
                "attrs": repr(getattr(src, "attrs", None)),
                "signature": repr(getattr(src, "signature", None)),
                "metadata": {str(k): repr(v)[:200] for k, v in metadata.items()},
                "cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                "pid": os.getpid(),
            }
            with open(os.environ["KERNEL_LOG"], "a") as log:
                log.write(json.dumps(entry) + "\\n")
        if previous is not None:
            previous(*args, **kwargs)

    knobs.compilation.listener = listen
"""


def kernels(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def stop(server: subprocess.Popen[str], under: tuple[str, ...]) -> None:
    """SIGTERM to the server: to its child `flare serve` where a profiler runs it (which then
    writes its samples as its child exits)."""
    if under:
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        for child in children:
            os.kill(int(child), signal.SIGTERM)
    else:
        server.terminate()
    server.wait(timeout=120)


MARKS = (
    "serve_command", "pull_into_cache", "load_package_app", "start_engine", "run_server",
    "engine_main", "make_context", "_import_dynamo", "_import_inductor", "_ConnectionBase.recv",
    "load_runtime",
    "load_model", "make_attention", "FlashInferPagedAttention.__init__", "_start_forward",
    "unpack", "warm_up", "DecodeGraphs.capture", "PrefillGraphs.capture", "WeightsLoading._load",
    "_find_and_load",
    "DecodeGraphs._step", "PrefillGraphs._step", "recording", "held_bytes", "release_unused",
    "synchronize", "WeightsLoading.wait",
)  # fmt: skip
"""The frames whose spans the timeline gives: the start's steps, and imports; within the
graphs' capture, each graph's step (run once, then captured), the capture's own begin and
end (`recording`: the driver instantiates the graph at its end), the memory the graphs hold
counted (`held_bytes`), the caching allocator emptied after them (`release_unused`), the waits
for the device, and the wait for the weights' read, after the captures."""


def spy_timeline(trace: Path) -> dict[str, dict[str, list[float]]]:
    """py-spy's Chrome trace of a process tree as each process's timeline: for each frame
    of MARKS, [first begin, last end, seconds on the stack] (seconds from the trace's start,
    outermost spans of each thread only), by begin."""
    names: dict[int, str] = {}
    spans: dict[int, dict[str, list[float]]] = {}
    depth: dict[tuple[int, int, str], int] = {}
    opened: dict[tuple[int, int, str], float] = {}
    for event in json.loads(trace.read_text()):
        pid, name, at = event["pid"], event["name"], event["ts"] / 1e6
        if name.startswith("process "):  # a stack's roots: the process and its parents
            if name.startswith(f"process {pid}:"):
                names[pid] = name[:100]
            continue
        if name not in MARKS:
            continue
        key = (pid, event["tid"], name)
        if event["ph"] == "B":
            depth[key] = depth.get(key, 0) + 1
            if depth[key] == 1:
                opened[key] = at
            continue
        depth[key] = depth.get(key, 1) - 1
        if depth[key] == 0 and key in opened:
            span = spans.setdefault(pid, {}).setdefault(name, [opened[key], at, 0.0])
            span[0], span[1] = min(span[0], opened[key]), max(span[1], at)
            span[2] += at - opened.pop(key)
    return {
        names.get(pid, str(pid)): {
            name: [round(value, 2) for value in span]
            for name, span in sorted(found.items(), key=lambda item: item[1][0])
        }
        for pid, found in spans.items()
    }


def gpu_processes(api: int) -> dict[str, Any] | str:
    """The processes holding a CUDA context on a GPU, by NVML (nvidia-smi's count), with the
    GPU memory each uses: a server's should be one, its engine's (its admission reads the
    free memory through NVML, so its API process makes none). NVML may give the host's pids
    in a container, so the count is the figure; `api` says whether the API process's pid is
    among those listed."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # no NVML here: a CPU run
        return f"not read: {type(exc).__name__}"
    found = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        found.extend(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    return {
        "count": len(found),
        "used_mb": [round((p.usedGpuMemory or 0) / 1e6, 1) for p in found],
        "api_listed": any(p.pid == api for p in found),
    }


def bytecode() -> dict[str, str]:
    """Whether torch's, the standard library's and flare's modules load from bytecode, as on a
    host that installed them: a start that compiles them from source (PYTHONDONTWRITEBYTECODE
    or -B, no __pycache__ folders) takes seconds longer, a cost of the host, not of the start."""
    import inspect

    import torch

    import flare.serve.runtime

    return {
        module.__name__: "cached"
        if Path(importlib.util.cache_from_source(module.__file__)).exists()
        else "compiled from source at every start"
        for module in (torch, inspect, flare.serve.runtime)
    }


def against(env: dict[str, str], parent: Path, device: str, starts: int) -> dict[str, Any]:
    """`starts` starts of this flare and of the one under `parent`, in turn: each series'
    seconds from the command to the ready line, and their medians, and the ready lines
    (whose parts say where each start's time went)."""
    other = env | {"PYTHONPATH": os.pathsep.join((str(parent), env["PYTHONPATH"]))}
    series: dict[str, list[float]] = {"this": [], "against": []}
    lines: dict[str, list[str]] = {"this": [], "against": []}
    for _ in range(starts):
        for name, run_env in (("this", env), ("against", other)):
            server, _, ready, seconds = start_server(run_env, "s", "--device", device)
            stop(server, ())
            series[name].append(round(seconds, 2))
            lines[name].append(ready)
    medians = {name: statistics.median(values) for name, values in series.items()}
    ratio = round(medians["this"] / medians["against"], 3)
    return {
        "parent": str(parent), "ready_s": series, "median_s": medians, "ratio": ratio,
        "ready_lines": lines,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--starts", type=int, default=1, help="bare starts, each timed")
    parser.add_argument("--py-spy", type=Path, default=None, help="profile the start with it")
    parser.add_argument("--against", type=Path, default=None, help="another flare's parent")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with scratch(None, "flare-start-kernels-") as work:  # an 8B package is 16 GB of the disk
        report = measure(args, work)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        (args.out / "gpu_start_kernels.json").write_text(text)
    return 0


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Build the shape in `work`, start it bare, again, against another tree and under py-spy."""
    shape = SHAPES[args.shape] | {"layers": args.layers}
    make_checkpoint(work / "ckpt", shape, args.device)
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(LISTENER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(work / "home"), "XDG_CONFIG_HOME": str(work / "xdg")}
    env["PYTHONPATH"] = os.pathsep.join((str(work / "site"), env.get("PYTHONPATH", "")))
    flare(env, "key", "generate", "--publisher", "lab")
    started = time.perf_counter()
    build_env = env | {"KERNEL_LOG": str(work / "build.jsonl")}
    command = ("build", str(work / "ckpt"), "--name", "s", "--target", args.device)
    flare(build_env, *command, "--max-concurrency", str(MAX_STREAMS), "--json")
    report: dict = {"shape": args.shape, "layers": args.layers, "bytecode": bytecode()}
    report["build_s"] = round(time.perf_counter() - started, 1)
    server, _, ready, seconds = start_server(
        env | {"KERNEL_LOG": str(work / "serve.jsonl")}, "s", "--device", args.device
    )
    report["gpu_processes"] = gpu_processes(server.pid)
    stop(server, ())
    built, at_build = kernels(work / "serve.jsonl"), kernels(work / "build.jsonl")
    report |= {"ready_line": ready, "ready_s": round(seconds, 2), "built_at_start": built}
    for _ in range(args.starts - 1):  # the spread of a bare start
        server, _, again, seconds = start_server(env, "s", "--device", args.device)
        stop(server, ())
        report.setdefault("again", []).append({"ready_line": again, "ready_s": round(seconds, 2)})
    if args.against:
        report["against"] = against(env, args.against, args.device, args.starts)
    names = {entry["name"] for entry in built}
    report["same_kernels_at_build"] = [entry for entry in at_build if entry["name"] in names]
    report["kernels_at_build"] = len(at_build)
    if args.py_spy:
        trace = (args.out or work) / "start_spy.json"
        spy = (str(args.py_spy), "record", "--subprocesses", "--idle", "-r", str(SPY_RATE))
        under = (*spy, "-f", "chrometrace", "-o", str(trace), "--")
        server, _, spied, seconds = start_server(env, "s", "--device", args.device, under=under)
        stop(server, under)
        report |= {"spied_ready_line": spied, "spied_ready_s": round(seconds, 2)}
        report["start_timeline"] = spy_timeline(trace) if trace.exists() else "no trace"
    return report


if __name__ == "__main__":
    sys.exit(main())
