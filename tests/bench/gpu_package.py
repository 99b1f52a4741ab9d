"""A runtime package on a GPU host, end to end through the CLI: build for `--target cuda`, pull
and serve, then a mixed load; prints what each part cost and how many compilations happened
after the server said it was ready (the runtime-package promise: zero).

    python tests/bench/gpu_package.py [--layers 16] [--hidden 2048] [--out DIR]

The checkpoint has Llama-3.2-1B's layer shapes (hidden 2048, 16 layers, 32 heads of 64, 8 KV
heads, intermediate 8192) with the seeded test tokenizer's small vocabulary, random normal
weights (std 0.02) made on the GPU. Nothing asserts on time: the script prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import scratch
from stream_load import completion_body

HERE = Path(__file__).resolve().parent
WIDTHS = (1, 2, 3, 4, 8, 13, 16, 32)
"""Concurrent requests of the mixed load: every batch size up to the package's plan."""


def make_checkpoint(folder: Path, hidden: int, layers: int) -> Path:
    """A Llama of the given width and depth, in the Hugging Face layout, weights drawn on CUDA."""
    import torch
    from safetensors.torch import save_file

    from flare.build.tiny import llama_config, write_tokenizer

    vocab = write_tokenizer(folder)
    vocab += -vocab % 8
    config = llama_config(vocab, hidden, layers, hidden // 64, max(1, hidden // 256))
    config.update(intermediate_size=4 * hidden, max_position_embeddings=8192)
    generator = torch.Generator("cuda").manual_seed(0)
    kv = config["num_key_value_heads"] * 64
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    shapes["model.norm.weight"] = (hidden,)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (4 * hidden, hidden),
            p + "mlp.up_proj.weight": (4 * hidden, hidden),
            p + "mlp.down_proj.weight": (hidden, 4 * hidden),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            drawn = torch.randn(shape, generator=generator, device="cuda", dtype=torch.float32)
            tensors[name] = (drawn * 0.02).to(torch.bfloat16).cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def publish(report: Any, out: Path | None, name: str) -> None:
    """A GPU script's report: printed as JSON, and written to `out/name` when asked (the
    device call's $OUT, whose files come back)."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


def require(*modules: str) -> None:
    """Raise, saying how to install them, when references a script compares against are not
    installed (transformers, sentence-transformers: the test extra has them)."""
    import importlib.util

    from flare.extras import install_hint

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"{', '.join(missing)} not installed: {install_hint('test')}")


def flare(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "flare", *args], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"flare {' '.join(args)} exit {done.returncode}: {done.stderr[-3000:]}")
    return done.stdout


def start_server(
    env: dict[str, str], name: str, *options: str, under: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str, str, float]:
    """`flare serve` (run by `under`, a profiler's command, if given) until its ready line:
    the process, base URL, the line, seconds to it."""
    started = time.perf_counter()
    server = subprocess.Popen(
        [*under, sys.executable, "-m", "flare", "serve", name, "--port", "0", *options],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(server.stderr), daemon=True).start()
    for line in server.stdout:
        print(line, end="", flush=True)
        found = re.search(r"at (http://\S+/v1)", line)
        if found:
            return server, found.group(1), line.strip(), time.perf_counter() - started
    server.wait()
    raise RuntimeError(f"serve ended before ready: {''.join(err)[-3000:]}")


def stream(client: Any, url: str, name: str, prompt: str, tokens: int, cancel_after: int = 0):
    """Stream one completion; returns (tokens generated: the server's usage count, or the events
    read where the client leaves after `cancel_after` of them; seconds after the first event)."""
    events, first, usage = 0, None, None
    body = completion_body(name, prompt, tokens)
    with client.stream("POST", f"{url}/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            events += 1
            first = first or time.perf_counter()
            usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
            if cancel_after and events >= cancel_after:
                break
    got = usage["completion_tokens"] if usage else events
    return got, (time.perf_counter() - first) if first else 0.0


def mixed_load(url: str, name: str, widths: tuple[int, ...] = WIDTHS) -> dict[str, Any]:
    """Batches of concurrent requests, prompt lengths 4..1500 words, some cancelled; then a
    batch-1 decode; then the server's compilation counters."""
    import httpx

    rng = random.Random(0)
    out: dict[str, Any] = {}
    with httpx.Client() as client:
        for width in widths:
            prompts = [" ".join(["word"] * rng.randint(4, 1500)) for _ in range(width)]
            results: list[tuple[int, float]] = [(0, 0.0)] * width

            def one(i: int, prompt: str) -> None:
                cancel = 5 if i % 5 == 4 else 0
                results[i] = stream(client, url, name, prompt, 48, cancel)  # noqa: B023

            started = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            out[f"c{width}_tokens_per_s"] = round(sum(r[0] for r in results) / wall, 1)
        got, seconds = stream(client, url, name, "the quick brown fox", 256)
        out["batch1_decode_tokens_per_s"] = round((got - 1) / seconds, 1)
        metrics = client.get(f"{url.removesuffix('/v1')}/metrics").text
    counted = re.findall(r"^flare_compilations_total(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    out["compilations_total_after_load"] = counted
    out["metrics_compile_lines"] = [m for m in metrics.splitlines() if "compil" in m][:20]
    return out


def serve_and_load(env: dict[str, str], name: str, widths: tuple[int, ...], *options: str):
    """Serve `name` until ready, put a load on it, stop it: the ready line and the figures."""
    server, url, line, seconds = start_server(env, name, "--device", "cuda", *options)
    report: dict[str, Any] = {"ready_line": line, "serve_to_ready_s": round(seconds, 1)}
    try:
        report |= mixed_load(url, name, widths)
    finally:
        server.send_signal(signal.SIGTERM)
        report["serve_exit"] = server.wait(timeout=120)
    return report


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with scratch(None, "flare-gpu-") as work:  # a 1B checkpoint and two packages
        report = measure(args, work)
    publish(report, args.out, "gpu_package.json")
    return 0


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Build the checkpoint compiled and eager in `work` and serve each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(work / "home"), "XDG_CONFIG_HOME": str(work / "xdg")}
    report: dict[str, Any] = {"hidden": args.hidden, "layers": args.layers}
    t = time.perf_counter()
    source = make_checkpoint(work / "ckpt", args.hidden, args.layers)
    report["checkpoint_s"] = round(time.perf_counter() - t, 1)
    report["checkpoint_bytes"] = (source / "model.safetensors").stat().st_size
    flare(env, "key", "generate", "--publisher", "lab")
    t = time.perf_counter()
    built = json.loads(
        flare(env, "build", str(source), "--name", "l1b", "--target", "cuda", "--json")
    )
    report["build_s"] = round(time.perf_counter() - t, 1)
    report["phases"] = {p["name"]: [p["status"], round(p["seconds"], 2)] for p in built["phases"]}
    manifest = json.loads(flare(env, "registry", "show", "l1b", "--json"))
    report["toolchain"] = manifest.get("toolchain") or manifest.get("manifest", {}).get("toolchain")
    report["compiled"] = serve_and_load(env, "l1b", WIDTHS)
    report["compile_on_start"] = serve_and_load(env, "l1b", (16,), "--compile-on-start")
    flare(env, "build", str(source), "--name", "l1b-eager", "--target", "none", "--json")
    report["eager"] = serve_and_load(env, "l1b-eager", (16,))
    return report


if __name__ == "__main__":
    sys.exit(main())
