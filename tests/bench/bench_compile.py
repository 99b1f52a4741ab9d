"""Runtime packages on the CPU: what tune and compile cost, what they save at start and per token.

1. build: a fresh FLARE_HOME builds the seeded tiny Llama with `--target cpu` (tune and compile
   times from the phase table), then a package of other weights with the same shapes (reused).
2. start: `flare serve` to its ready line for the compiled package, the same package with
   `--compile-on-start` (a fresh host cache: a real compile), and a `--target none` package
   (eager). Baseline: the eager start; ratios are against it.
3. decode: greedy tokens/s of two runtimes in this process, compiled (the package's forward)
   and eager (the same package, compiling off), at batch 1 and 8, in alternating rounds, on
   the tiny Llama and on a Llama of about 100M parameters (--big).
4. reproduce (--reproduce N): the tiny Llama built N times, each in a fresh FLARE_HOME (no
   kernel cache, journal or registry shared): the package digests must all be equal.
5. ways (--ways): the two ways of shipping compiled code on this torch, for the tiny shape,
   each step in a fresh process: torch.compile cold; its Mega-Cache artifacts alone loaded
   into an empty Inductor cache; the whole Inductor cache folder; AOTInductor (weights kept
   out of the .so, `package_constants_in_so: False`) compile, then load cold and with its ISA
   probes cached.

    python tests/bench/bench_compile.py [--tokens 64] [--big] [--reproduce 3] [--ways] [--json]

Nothing asserts on time: the script prints its figures and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import flare_env, log, scratch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
BATCH = 8
ROUNDS = 5


def flare(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "flare", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"flare {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def build(env: dict[str, str], source: Path, name: str, *options: str) -> dict[str, Any]:
    out = flare(env, "build", str(source), "--name", name, "--json", *options)
    report = json.loads(out)
    return {p["name"]: (p["status"], round(p["seconds"], 2)) for p in report["phases"]}


def ready_line(env: dict[str, str], *args: str) -> tuple[float, str]:
    """Seconds from `flare serve` to its ready line (as the user waits), and the line."""
    started = time.perf_counter()
    server = subprocess.Popen(
        [sys.executable, "-m", "flare", "serve", *args, "--port", "0", "--device", "cpu"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    line = server.stdout.readline()
    seconds = time.perf_counter() - started
    server.terminate()
    server.communicate(timeout=60)
    if "http://" not in line:
        raise RuntimeError(f"flare serve {' '.join(args)} did not start")
    return seconds, line.split("(", 1)[1].rstrip(")\n")


def decode_rates(manifest: Any, files: dict, root: Path, tokens: int) -> dict[str, Any]:
    """Greedy decode tokens/s at batch 1 and BATCH, compiled (the package's forward) and eager
    (compiling off), in rounds that alternate which goes first; medians and paired ratios."""
    from flare.serve.runtime import SamplingParams, load_runtime

    runtimes = {
        mode: load_runtime(manifest, files, compile_mode=mode, compile_root=root)
        for mode in ("package", "off")
    }
    rates: dict[str, dict[str, list[float]]] = {"package": {}, "off": {}}
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for runtime in runtimes.values():
        runtime.start()
    try:
        for round_ in range(ROUNDS):
            order = list(runtimes) if round_ % 2 == 0 else list(reversed(runtimes))
            for mode in order:
                for batch in (1, BATCH):
                    started = time.perf_counter()
                    handles = [runtimes[mode].submit([5 + i, 6, 7], params) for i in range(batch)]
                    made = sum(len(d.token_ids) for h in handles for d in h)
                    rate = made / (time.perf_counter() - started)
                    rates[mode].setdefault(f"batch {batch}", []).append(rate)
    finally:
        for runtime in runtimes.values():
            runtime.stop()
    compiled, eager = rates["package"], rates["off"]
    paired = {k: [c / e for c, e in zip(compiled[k], eager[k], strict=True)] for k in compiled}
    return {
        "compiled tok/s": {k: round(statistics.median(v), 1) for k, v in compiled.items()},
        "eager tok/s": {k: round(statistics.median(v), 1) for k, v in eager.items()},
        "compiled / eager (paired)": {k: round(statistics.median(v), 2) for k, v in paired.items()},
    }


def decode(home: Path, env: dict[str, str], name: str, tokens: int) -> dict[str, Any]:
    from flare.registry.refs import read_manifest
    from flare.store.blobs import BlobStore
    from flare.store.digest import Digest

    digest = json.loads(flare(env, "registry", "show", name, "--json"))["digest"]
    store = BlobStore(home / "registry")
    manifest = read_manifest(store, Digest.parse(digest))
    (home / "blobs").mkdir(exist_ok=True)
    files = {str(d): store.get(d, home / "blobs")[0] for d in manifest.blobs()}
    return decode_rates(manifest, files, home / "compiled", tokens)


def bench_package(work: Path, source: Path, tokens: int, other: Path | None) -> dict:
    home = work / "home"
    env = flare_env(home, work / "xdg")
    flare(env, "key", "generate", "--publisher", "bench")
    result: dict[str, Any] = {}
    result["build --target cpu"] = build(env, source, "bench", "--target", "cpu")
    if other is not None:
        result["second package, same shapes"] = build(env, other, "other", "--target", "cpu")
    build(env, source, "eager", "--target", "none")
    eager_s, eager_line = ready_line(env, "eager")
    starts = {"eager (target none)": (eager_s, eager_line)}
    starts["compiled, from the package"] = ready_line(env, "bench")
    starts["--compile-on-start"] = ready_line(env, "bench", "--compile-on-start")
    result["start to ready (s)"] = {k: round(v[0], 2) for k, v in starts.items()}
    result["start / eager"] = {k: round(v[0] / eager_s, 2) for k, v in starts.items()}
    result["ready lines"] = {k: v[1] for k, v in starts.items()}
    result["decode"] = decode(home, env, "bench", tokens)
    return result


# -- the two ways, each step in a fresh process ------------------------------------------------

CHILD = """
import sys, time, json, os
t0 = time.perf_counter()
import torch
sys.path.insert(0, {bench!r})
from bench_compile import child
print(json.dumps(child({step!r}, {work!r}, t0)))
"""


def run_child(step: str, work: Path, cache: Path) -> dict[str, float]:
    env_cache = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONHASHSEED": "0"}
    code = CHILD.format(bench=str(HERE), step=step, work=str(work))
    import os

    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env_cache}, capture_output=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{step} failed: {done.stderr.decode()[-2000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _tiny_step() -> tuple[Any, Any, Any]:
    """The tiny Llama's model, a runner on the operator attention, and a batch."""
    from flare.build.tiny import llama_config
    from flare.serve.engine.attention import TorchPagedAttention
    from flare.serve.engine.block_manager import BlockManager
    from flare.serve.engine.runner import ModelRunner
    from flare.serve.engine.sequence import SamplingParams, Sequence
    from flare.serve.models import empty_model

    config = llama_config(264, 64, 2, 8, 4)
    model = empty_model("llama", 1, config, torch_device(), dtype())
    attention = TorchPagedAttention(model.attention_spec, 16 * 16, dtype(), torch_device())
    runner = ModelRunner(model, attention, 16, torch_device())
    blocks = BlockManager(16, 16)
    greedy = SamplingParams(temperature=0)
    seqs = [Sequence([1, 2, 3, 4, 5], greedy, 4), Sequence([6, 7, 8], greedy, 4)]
    for seq in seqs:
        blocks.allocate(seq)
    return model, runner, seqs


def torch_device() -> Any:
    import torch

    return torch.device("cpu")


def dtype() -> Any:
    import torch

    return torch.float32


def child(step: str, work: str, started: float) -> dict[str, float]:
    """One step of the ways comparison, in this fresh process."""
    import torch

    from flare.serve.compiled import CompiledForward, settings
    from flare.serve.engine.attention_op import bound_attention

    settings()
    model, runner, seqs = _tiny_step()
    mega = Path(work) / "mega.bin"
    figures = {"import and set up": time.perf_counter() - started}
    if step in ("compile", "mega", "folder"):
        if step == "mega":
            t = time.perf_counter()
            torch.compiler.load_cache_artifacts(mega.read_bytes())
            figures["load Mega-Cache"] = time.perf_counter() - t
        runner.forward = CompiledForward(model)
        t = time.perf_counter()
        runner.run(seqs, prefill=True)
        figures["first call"] = time.perf_counter() - t
        if step == "compile":
            mega.write_bytes(torch.compiler.save_cache_artifacts()[0])
            figures["Mega-Cache bytes"] = mega.stat().st_size
        return figures
    ids, positions, meta = runner.prepare(seqs, True)
    runner.attention.plan(meta)
    last = meta.query_start_loc[1:] - 1
    package = Path(work) / "tiny.pt2"
    if step == "aoti-compile":
        from flare.serve.engine.attention_op import OperatorAttention

        class Step(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, ids: Any, positions: Any, last: Any) -> Any:
                hidden = self.model.forward(ids, positions, OperatorAttention())
                return self.model.compute_logits(hidden[last]).float()

        tokens, rows = torch.export.Dim("tokens", min=1), torch.export.Dim("rows", min=1)
        t = time.perf_counter()
        with torch.inference_mode():
            exported = torch.export.export(
                Step(), (ids, positions, last), dynamic_shapes=({0: tokens}, {0: tokens}, {0: rows})
            )
        torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(package),
            inductor_configs={"aot_inductor.package_constants_in_so": False},
        )
        figures["compile"] = time.perf_counter() - t
        figures[".pt2 bytes"] = package.stat().st_size
        return figures
    t = time.perf_counter()
    loaded = torch._inductor.aoti_load_package(str(package))
    figures["load"] = time.perf_counter() - t
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    loaded.load_constants(weights, check_full_update=True, user_managed=True)
    t = time.perf_counter()
    with torch.inference_mode(), bound_attention(runner.attention):
        loaded(ids, positions, last)
    figures["first call"] = time.perf_counter() - t
    return figures


def bench_ways(work: Path) -> dict[str, dict[str, float]]:
    """torch.compile's caches and AOTInductor for the tiny shape, each in fresh processes."""
    import shutil

    ways: dict[str, dict[str, float]] = {}
    first = work / "inductor-first"
    ways["torch.compile, cold"] = run_child("compile", work, first)
    ways["Mega-Cache alone, empty Inductor cache"] = run_child("mega", work, work / "empty")
    shutil.copytree(first, work / "folder-copy")
    ways["Inductor cache folder, elsewhere"] = run_child("folder", work, work / "folder-copy")
    ways["AOTInductor compile"] = run_child("aoti-compile", work, work / "aoti-a")
    ways["AOTInductor load, cold"] = run_child("aoti-load", work, work / "aoti-b")
    ways["AOTInductor load, probes cached"] = run_child("aoti-load", work, work / "aoti-b")
    return {k: {f: round(v, 2) for f, v in figures.items()} for k, figures in ways.items()}


def reproduce(work: Path, source: Path, builds: int) -> dict[str, Any]:
    """The same checkpoint built `builds` times with --target cpu, each in a fresh FLARE_HOME
    (fresh staging, kernel cache, registry): the package digests and compiled blobs."""
    digests, compiled = [], []
    for number in range(builds):
        home = work / f"home-{number}"
        env = flare_env(home, work / f"xdg-{number}")
        out = flare(env, "build", str(source), "--name", "same", "--target", "cpu", "--json")
        digest = json.loads(out)["digest"]
        show = json.loads(flare(env, "registry", "show", "same", "--json"))["manifest"]
        digests.append(digest)
        compiled.append(next(a["digest"] for a in show["artifacts"] if a["kind"] == "compiled"))
    return {
        "package digests": digests,
        "compiled blobs": compiled,
        "identical": len(set(digests)) == 1 and len(set(compiled)) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--big", action="store_true", help="also a ~100M-parameter Llama")
    parser.add_argument("--ways", action="store_true", help="also torch.compile vs AOTI")
    parser.add_argument(
        "--reproduce", type=int, default=0, metavar="N", help="also N builds in fresh homes"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from flare.build.tiny import make_tiny_llama

    results: dict[str, Any] = {}
    with scratch(None, "bench-compile-") as work:
        log("tiny Llama: build, start, decode")
        tiny, other = make_tiny_llama(work / "tiny"), make_tiny_llama(work / "other", seed=1)
        results["tiny"] = bench_package(work / "tiny-run", tiny, args.tokens, other)
        log(json.dumps(results["tiny"]))
        if args.big:
            log("~100M-parameter Llama: build, start, decode")
            big = make_tiny_llama(work / "big", hidden=1024, layers=8)  # 12 * 1024^2 * 8
            results["~100M"] = bench_package(work / "big-run", big, args.tokens, None)
            log(json.dumps(results["~100M"]))
        if args.reproduce:
            log(f"{args.reproduce} builds of the tiny Llama in fresh homes")
            results["reproduce"] = reproduce(work / "reproduce", tiny, args.reproduce)
            log(json.dumps(results["reproduce"]))
        if args.ways:
            log("the two ways, tiny shape")
            (work / "ways").mkdir()
            results["ways"] = bench_ways(work / "ways")
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for section, figures in results.items():
        print(f"== {section}")
        for key, value in figures.items():
            print(f"{key}: {json.dumps(value)}")


if __name__ == "__main__":
    main()
