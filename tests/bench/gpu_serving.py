"""flare serving against transformers on one GPU, by shape: decode rate, streams, first token.

    python tests/bench/gpu_serving.py [--shapes 1b,8b] [--out DIR] [--skip-compiled]
    python tests/bench/gpu_serving.py --device cpu --shapes tiny     # the script's own check

For each shape, in one run: a random-weight bf16 Llama checkpoint in the Hugging Face layout
(real vocabulary size; a word-level tokenizer whose every id is the word `w<id>`, so a prompt of
N words is N tokens and every sampled id decodes), then

- transformers on the same device: `generate` with its static cache at batch 1 and 16, and the
  same with the forward compiled (`torch.compile`, mode reduce-overhead), greedy;
- flare: the checkpoint built with `--target DEVICE`, served by `flare serve`, streamed over
  HTTP with temperature 0 and `ignore_eos`: batch-1 decode, 16 and 64 concurrent streams (from
  client processes, tokens counted from the server's usage figures: tests/bench/stream_load.py;
  each width run twice, new prompts each time, the second run's rate reported, the first's
  kept beside it: a width's first load may pay for what the server meets for the first time), the
  first token of an 8K-token prompt (and what tokenizing that prompt costs on this host,
  `tokenize_8k_ms`: by `encode`, and the server's way), greedy continuations beside
  transformers', and the compilations counted after ready (`/metrics`);
- then the same package loaded in this process (unless --skip-in-process), its engine stepped
  as tests/bench/gpu_step_profile.py does: host and GPU time per decode step at 1, 16 and 64
  sequences, so that the HTTP figures of the same run can be set against the engine's own
  (a step bound by its GPU work, or by its host loop);
- with --py-spy BIN, py-spy on the engine process during the second 64-stream load: its raw
  samples under --out, and the frames holding the most samples in the report (a thread
  waiting for the GIL is sampled where it waits);
- the bandwidth roofline: weight bytes ÷ 4.8 TB/s per token (an H200's HBM3e, the issue's
  figure), and beside it the card's own where its name is known (an H100 SXM's 3.35 TB/s).

Nothing asserts on time: the script prints one JSON report (and writes it under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tests' helpers

from common import scratch, timed
from gpu_package import flare, publish, require, start_server
from helpers import spawned_children
from stream_load import one_stream, streams

HBM_BYTES_PER_S = 4.8e12
CARD_BYTES_PER_S = {
    "H200": 4.8e12,
    "H100 80GB HBM3": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
}
"""Peak memory bandwidth by a part of the card's name, from NVIDIA's data sheets: a run on an
H100 is set against its own roofline as well as the issue's H200 one."""
FIELDS = ("hidden", "layers", "heads", "kv_heads", "inter", "vocab", "tied")
SHAPES = {
    "tiny": dict(zip(FIELDS, (256, 2, 4, 2, 768, 1024, False), strict=True)),
    "1b": dict(zip(FIELDS, (2048, 16, 32, 8, 8192, 128256, True), strict=True)),
    "8b": dict(zip(FIELDS, (4096, 32, 32, 8, 14336, 128256, False), strict=True)),
}
"""Llama-3.2-1B's and Llama-3.1-8B's shapes, and a tiny one to check the script on a CPU.
Llama-3.2-1B ties its logits to its embeddings (2.47 GB of weights, every byte read a token,
as the issue's roofline counts); an untied 1B would hold 0.53 GB more that a token does not
read (the embeddings are looked up a row at a time)."""
SHARD_BYTES = 4 << 30
DECODE_TOKENS = 128
STREAM_TOKENS = 256
MAX_STREAMS = 64
"""The most concurrent streams measured; the package is built for that many (a CUDA graph each)."""
LONG_PROMPT = 8192
PARITY_PROMPTS = 8
PARITY_TOKENS = 32


def write_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer of `vocab` words `w0`..: one id per word, every id decodable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w0"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def make_checkpoint(folder: Path, shape: dict[str, int], device: str) -> int:
    """The checkpoint of `shape`, weights drawn on `device` (std 0.02, norms at one), in shards
    of at most SHARD_BYTES; returns its weight bytes."""
    import torch
    from safetensors.torch import save_file

    from flare.build.tiny import llama_specs

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, shape["vocab"])
    h, layers, head_dim = shape["hidden"], shape["layers"], shape["hidden"] // shape["heads"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": shape["inter"],
        "num_hidden_layers": layers,
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": head_dim,
        "vocab_size": shape["vocab"],
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": shape["tied"],
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 0,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = {spec.name: spec.shape for spec in llama_specs(config)}
    generator = torch.Generator(device).manual_seed(0)
    shards: list[dict[str, Any]] = [{}]
    size = total = 0
    for name, dims in shapes.items():
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            drawn = torch.randn(dims, generator=generator, device=device, dtype=torch.float32)
            tensor = (drawn * 0.02).to(torch.bfloat16).cpu()
        nbytes = tensor.numel() * 2
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size, total = size + nbytes, total + nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def prompt_of(words: int, seed: int) -> str:
    """A prompt of exactly `words` tokens (ids 2.. drawn from a seed; never w0, the EOS)."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(2, 1000)}" for _ in range(words))


# -- transformers ---------------------------------------------------------------------------


def transformers_figures(folder: Path, device: str, compiled: bool) -> dict[str, Any]:
    """Decode tok/s of `generate` with a static cache at batch 1 and 16 (and compiled), and
    greedy continuations of the parity prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out: dict[str, Any] = {
        "static_batch1_tok_s": decode_rate(model, tokenizer, device, 1),
        "static_batch16_tok_s": decode_rate(model, tokenizer, device, 16),
    }
    out["greedy"] = [
        greedy(model, tokenizer, device, prompt_of(16, seed)) for seed in range(PARITY_PROMPTS)
    ]
    if compiled:  # a baseline that fails is reported, and flare's figures are still taken
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        try:
            out["compiled_batch1_tok_s"] = decode_rate(model, tokenizer, device, 1)
            out["compiled_batch16_tok_s"] = decode_rate(model, tokenizer, device, 16)
        except Exception as exc:  # transformers 5.17's static cache under CUDA graph trees
            out["compiled_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def decode_rate(model: Any, tokenizer: Any, device: str, batch: int) -> float:
    """Tokens/s of the decode alone: (time of N+1 new tokens - time of 1) over N, the better of
    two runs after a warm-up."""
    import torch

    ids = tokenizer([prompt_of(32, i) for i in range(batch)], return_tensors="pt").to(device)

    def run(new: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(
            **ids,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    run(DECODE_TOKENS + 1)
    best = min(run(DECODE_TOKENS + 1) - run(1) for _ in range(2))
    return round(batch * DECODE_TOKENS / best, 1)


def greedy(model: Any, tokenizer: Any, device: str, prompt: str) -> str:
    ids = tokenizer(prompt, return_tensors="pt").to(device)
    made = model.generate(
        **ids,
        max_new_tokens=PARITY_TOKENS,
        min_new_tokens=PARITY_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return tokenizer.decode(made[0, ids["input_ids"].shape[1] :])


# -- flare ------------------------------------------------------------------------------------


def flare_figures(
    env: dict[str, str],
    name: str,
    device: str,
    spy: Path | None,
    out_dir: Path | None,
    *options: str,
) -> dict[str, Any]:
    """The figures of `flare serve NAME --device DEVICE OPTIONS...` over HTTP."""
    import httpx

    server, url, ready, _ = start_server(env, name, "--device", device, *options)
    out: dict[str, Any] = {"ready_line": ready}
    try:
        one_stream(url, name, prompt_of(32, 0), 8)  # a warm-up request
        out["batch1_tok_s"] = round(
            one_stream(url, name, prompt_of(32, 1), DECODE_TOKENS).decode_tok_s, 1
        )
        firsts = [one_stream(url, name, prompt_of(LONG_PROMPT, 50 + i), 1) for i in range(3)]
        out["first_token_8k_s"] = round(statistics.median(s.first - s.started for s in firsts), 4)
        with httpx.Client() as client:
            out["greedy"] = [
                completion(client, url, name, prompt_of(16, seed)) for seed in range(PARITY_PROMPTS)
            ]
        for width in (16, MAX_STREAMS):  # each width twice: its first time, then again
            for run, seed in (("first", 100), ("again", 200)):
                prompts = [prompt_of(32, seed + i) for i in range(width)]
                before = engine_counters(url)
                profiled = spy and out_dir and width == MAX_STREAMS and run == "again"
                raw = out_dir / f"engine_{name}_{width}.raw" if profiled else None
                with engine_profile(server.pid, spy, raw) as frames:
                    load = streams(url, name, prompts, STREAM_TOKENS, pid=server.pid)
                out[f"streams{width}_{run}"] = load.report() | engine_loop(before, url)
                if frames:
                    out[f"streams{width}_engine_profile"] = frames
            out[f"streams{width}_tok_s"] = out[f"streams{width}_again"]["tok_s"]
        out["compilations_after_ready"] = engine_counters(url)["compilations"]
    finally:
        server.send_signal(signal.SIGTERM)
        out["serve_exit"] = server.wait(timeout=120)
    return out


def engine_counters(url: str) -> dict[str, float]:
    """The server's engine counters from /metrics (`flare_X_total` as X)."""
    import httpx

    text = httpx.get(f"{url.removesuffix('/v1')}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^flare_(\w+)_total (\S+)$", text, re.M)}


def engine_loop(before: dict[str, float], url: str) -> dict[str, float]:
    """The engine's step loop over a load, from its counters before and now: steps, and per
    step the host loop's own work and the wait for the device's tokens (milliseconds)."""
    after = engine_counters(url)
    steps = after["steps"] - before["steps"]
    waiting = after["device_wait_seconds"] - before["device_wait_seconds"]
    in_steps = after["step_seconds"] - before["step_seconds"]
    return {
        "engine_steps": steps,
        "engine_host_ms_per_step": round(1000 * (in_steps - waiting) / max(steps, 1), 3),
        "engine_wait_ms_per_step": round(1000 * waiting / max(steps, 1), 3),
    }


@contextmanager
def engine_profile(server_pid: int, spy: Path | None, raw: Path | None) -> Iterator[dict[str, Any]]:
    """py-spy on the server's engine process for the length of the block (see `py_spy`)."""
    engines = spawned_children(server_pid)
    with py_spy(engines[0] if engines else None, spy, raw) as found:
        yield found


@contextmanager
def py_spy(pid: int | None, spy: Path | None, raw: Path | None) -> Iterator[dict[str, Any]]:
    """py-spy on process `pid` (this one too) for the length of the block, where `raw` says
    where its samples go (and `spy` is given); once the block ends, the yielded dict holds
    the frames with the most samples (or why there are none)."""
    found: dict[str, Any] = {}
    if spy is None or raw is None or pid is None:
        yield found
        return
    command = [str(spy), "record", "-p", str(pid), "-r", "500", "-f", "raw", "-o", str(raw)]
    spying = subprocess.Popen([*command, "--nonblocking"], stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attached before the work starts
    try:
        yield found
    finally:
        spying.send_signal(signal.SIGINT)
        _, err = spying.communicate(timeout=120)
        found |= top_frames(raw) if raw.exists() else {"error": err.strip()[-300:]}


def top_frames(raw: Path, count: int = 30) -> dict[str, Any]:
    """py-spy's raw samples summed by frame (line numbers dropped): each frame's share of
    the samples with it anywhere on the stack, and with it on top."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
        total += int(samples)
        own[frames[-1]] = own.get(frames[-1], 0) + int(samples)
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + int(samples)

    def ranked(counts: dict[str, int]) -> list[list[Any]]:
        top = sorted(counts.items(), key=lambda item: -item[1])[:count]
        return [[frame[:160], round(n / max(total, 1), 4)] for frame, n in top]

    return {"samples": total, "inclusive": ranked(inclusive), "own": ranked(own)}


def tokenize_ms(checkpoint: Path, prompt: str) -> dict[str, float]:
    """What tokenizing the first-token case's prompt costs on this host (the API process does
    it before the engine sees the request), the median of five: by `encode`, and the server's
    way (serve/prompts.py: token_ids)."""
    from tokenizers import Tokenizer

    from flare.serve.prompts import token_ids

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    ways = {
        "encode": lambda: tokenizer.encode(prompt),
        "server": lambda: token_ids(tokenizer, prompt, True),
    }
    return {
        f"{name}_ms": round(1000 * statistics.median(timed(way) for _ in range(5)), 2)
        for name, way in ways.items()
    }


def in_process_figures(env: dict[str, str], name: str, device: str) -> dict[str, Any]:
    """The built package loaded in this process, from the served home, and profiled per
    decode width (gpu_step_profile.py's figures, less each step's kernel list)."""
    from gpu_step_profile import KV_CACHE_TOKENS, profile_path
    from runtime_package import load

    os.environ.update({k: v for k, v in env.items() if k.startswith(("FLARE_", "XDG_"))})
    runtime = load(name, device, kv_cache_tokens=KV_CACHE_TOKENS)
    try:
        widths = profile_path(runtime, device)
    finally:
        runtime.stop()
    for figures in widths.values():
        figures.pop("last_step", None)
    return {"start": runtime.start_report.describe(), "widths": widths}


def completion(client: Any, url: str, name: str, prompt: str) -> str:
    body = {
        "model": name,
        "prompt": prompt,
        "max_tokens": PARITY_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = client.post(f"{url}/completions", json=body, timeout=300)
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


# -- report -----------------------------------------------------------------------------------


def same_words(ours: str, theirs: str) -> int:
    """How many leading tokens two continuations share."""
    count = 0
    for a, b in zip(ours.split(), theirs.split(), strict=False):
        if a != b:
            break
        count += 1
    return count


def measure(shape_name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shape = SHAPES[shape_name]
    folder = work / shape_name
    started = time.perf_counter()
    weight_bytes = make_checkpoint(folder / "ckpt", shape, args.device)
    report: dict[str, Any] = {
        "shape": shape_name,
        "weight_bytes": weight_bytes,
        "roofline_batch1_tok_s": round(HBM_BYTES_PER_S / weight_bytes, 1),
        "checkpoint_s": round(time.perf_counter() - started, 1),
    }
    print(f"{shape_name}: checkpoint in {report['checkpoint_s']} s", file=sys.stderr)
    report["transformers"] = transformers_figures(
        folder / "ckpt", args.device, not args.skip_compiled
    )
    print(f"{shape_name}: transformers {report['transformers']}", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
    env |= {"FLARE_HOME": str(folder / "home"), "XDG_CONFIG_HOME": str(folder / "xdg")}
    if args.kernel_cache:  # tune records and compiled forwards of an earlier run, reused
        env["FLARE_KERNEL_CACHE"] = str(args.kernel_cache)
    env["NCCL_NVLS_ENABLE"] = "0"
    flare(env, "key", "generate", "--publisher", "lab")
    started = time.perf_counter()
    built = json.loads(
        flare(
            env,
            "build",
            str(folder / "ckpt"),
            "--name",
            shape_name,
            "--target",
            args.device,
            "--max-concurrency",
            str(MAX_STREAMS),
            "--json",
        )
    )
    report["build_s"] = round(time.perf_counter() - started, 1)
    print(f"{shape_name}: built in {report['build_s']} s", file=sys.stderr)
    report["phases"] = {p["name"]: round(p["seconds"], 2) for p in built["phases"]}
    report["flare"] = flare_figures(env, shape_name, args.device, args.py_spy, args.out)
    report["flare"]["tokenize_8k_ms"] = tokenize_ms(folder / "ckpt", prompt_of(LONG_PROMPT, 50))
    http = {k: v for k, v in report["flare"].items() if k != "greedy"}
    print(f"{shape_name}: flare over HTTP {http}", file=sys.stderr)
    if args.without_prefill_graphs:  # the same server with prefills kernel by kernel, beside it
        report["flare_no_prefill_graphs"] = flare_figures(
            env, shape_name, args.device, None, None, "--no-prefill-graphs"
        )
        without = report["flare_no_prefill_graphs"]
        print(f"{shape_name}: --no-prefill-graphs {without}", file=sys.stderr)
    if not args.skip_in_process:
        report["in_process"] = in_process_figures(env, shape_name, args.device)
        print(f"{shape_name}: in process {report['in_process']}", file=sys.stderr)
    theirs = report["transformers"].pop("greedy")
    for served, suffix in (("flare", ""), ("flare_no_prefill_graphs", "_no_prefill_graphs")):
        if served in report:
            pairs = zip(report[served].pop("greedy"), theirs, strict=True)
            shared = [same_words(ours, reference) for ours, reference in pairs]
            equal = sum(n == PARITY_TOKENS for n in shared) / len(shared)
            report[f"greedy_equal_share{suffix}"] = equal
            report[f"greedy_shared_tokens{suffix}"] = shared
    flare_rate = report["flare"]["batch1_tok_s"]
    report["flare_batch1_of_roofline"] = round(flare_rate / report["roofline_batch1_tok_s"], 3)
    card = card_bytes_per_s(args.device)
    if card:
        report["card_roofline_batch1_tok_s"] = round(card / weight_bytes, 1)
        report["flare_batch1_of_card_roofline"] = round(flare_rate * weight_bytes / card, 3)
    return report


def card_bytes_per_s(device: str) -> float | None:
    """The card's peak memory bandwidth, where its name is in CARD_BYTES_PER_S."""
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name(torch.device(device))
    return next((rate for part, rate in CARD_BYTES_PER_S.items() if part in name), None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--skip-compiled", action="store_true")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--py-spy", type=Path, default=None, help="profile the engine with it")
    parser.add_argument("--kernel-cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--without-prefill-graphs",
        action="store_true",
        help="serve again with --no-prefill-graphs",
    )
    args = parser.parse_args()
    require("transformers")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with scratch(None, "flare-gpu-serving-") as work:  # checkpoints and packages: GBs of disk
        reports = [measure(name, args, work) for name in args.shapes.split(",")]
    publish(reports, args.out, "gpu_serving.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
