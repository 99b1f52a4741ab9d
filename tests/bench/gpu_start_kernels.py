"""What a server's start builds: each Triton kernel `flare serve` compiles before its ready
line, with its specialization, against those the build compiled.

    python tests/bench/gpu_start_kernels.py [--shape 1b] [--layers 2] [--out DIR]

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

With --py-spy BIN, the serve runs under py-spy (every process, idle samples included, 100 a
second) until its ready line: its raw samples go to DIR/start_spy.txt, and the report gives
each process's frames with the most samples (seconds on the stack): where start-to-ready
goes, the API process's imports and the engine's trace, loads and captures apart.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_package import flare, start_server
from gpu_serving import MAX_STREAMS, SHAPES, make_checkpoint

SPY_RATE = 100
"""py-spy's samples a second on the start."""

LISTENER = """
import json, os
try:
    from triton import knobs
except Exception:
    knobs = None
if knobs is not None and os.environ.get("KERNEL_LOG"):
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


def spied_seconds(raw: Path, count: int = 40) -> dict[str, list[list]]:
    """py-spy's raw samples of a process tree as seconds per frame (line numbers kept: a
    module's imports are told apart by them), per process, the most first."""
    per: dict[str, dict[str, int]] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = stack.split(";")
        processes = [frame for frame in frames if frame.startswith("process ")]
        if not samples.isdigit() or not processes:
            continue
        counts = per.setdefault(processes[-1][:100], {})
        for frame in {frame for frame in frames if not frame.startswith("process ")}:
            counts[frame] = counts.get(frame, 0) + int(samples)
    return {
        process: [[frame[:160], round(n / SPY_RATE, 2)] for frame, n in sorted(
            counts.items(), key=lambda item: -item[1])[:count]]
        for process, counts in per.items()
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--py-spy", type=Path, default=None, help="profile the start with it")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flare-start-kernels-"))
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
    report: dict = {"shape": args.shape, "layers": args.layers}
    report["build_s"] = round(time.perf_counter() - started, 1)
    raw = (args.out or work) / "start_spy.txt"
    spy = (str(args.py_spy), "record", "--subprocesses", "--idle", "-r", str(SPY_RATE))
    under = (*spy, "-f", "raw", "-o", str(raw), "--") if args.py_spy else ()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    server, _, ready, seconds = start_server(
        env | {"KERNEL_LOG": str(work / "serve.jsonl")}, "s", "--device", args.device, under=under
    )
    stop(server, under)
    built, at_build = kernels(work / "serve.jsonl"), kernels(work / "build.jsonl")
    report |= {"ready_line": ready, "ready_s": round(seconds, 2), "built_at_start": built}
    names = {entry["name"] for entry in built}
    report["same_kernels_at_build"] = [entry for entry in at_build if entry["name"] in names]
    report["kernels_at_build"] = len(at_build)
    if args.py_spy:
        report["start_profile"] = spied_seconds(raw) if raw.exists() else "py-spy wrote nothing"
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        (args.out / "gpu_start_kernels.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
