"""The compile phase: the package's compiled forward, made once per shapes and toolchain.

The runtime's own program (serve/prepare.py) compiles the forward of the package's model
shapes with the tuned decisions, in a fresh process and Inductor cache, and packs that cache
deterministically (serve/inductor_archive.py). The archive holds code only: the weights are
the compiled graph's inputs, so packages of one checkpoint for several targets share every
weight blob, and packages of the same shapes share one compiled forward (the kernel cache
keeps it, keyed by what it depends on: model shapes, recipe, target, toolchain, records, batch
plan, flare's forward code).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from flare.build.kernel_cache import KernelCache, cache_key
from flare.build.target import Preparation

COMPILED_PATH = "runtime/forward-{target}.tar"
FORWARD_FORMAT = 3
"""Bumped when what compile produces changes meaning: older kernel-cache entries are not taken
(3: a CUDA forward's archive holds its kernels, no Inductor graph)."""
NOT_SHAPES = (
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
"""config.json keys that never change the compiled graph (names, token ids, the stored dtype)."""


def compile_inputs(
    recipe: dict[str, Any],
    config: dict[str, Any],
    prepared: Preparation,
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """Everything the compiled forward depends on: its kernel-cache key and phase inputs."""
    return {
        "format": FORWARD_FORMAT,
        "recipe": {"name": recipe["name"], "version": recipe["version"]},
        "config": {k: v for k, v in config.items() if k not in NOT_SHAPES},
        "target": prepared.target,
        "toolchain": prepared.toolchain,
        "records": records,
        "plan": prepared.plan(),
    }


def compiled_forward(
    inputs: dict[str, Any], cache: KernelCache, scratch: Path
) -> tuple[Path, dict[str, Any], bool]:
    """The archive, what it covers, and whether it was reused: the kernel cache's, else
    compiled now and kept. A compiled archive lies under `scratch` until the caller stored it."""
    from flare.build.worker import run_prepare

    key = cache_key("compiled", inputs)
    archive, result = cache.path("compiled", key, ".tar"), cache.path("compiled", key, ".json")
    if archive is not None and result is not None:
        return archive, json.loads(result.read_text()), True
    out = scratch / f"compile-{key[:16]}"
    shutil.rmtree(out, ignore_errors=True)
    run_prepare("compile", inputs, out)
    made = json.loads((out / "result.json").read_text())
    cache.keep("compiled", key, ".tar", out / "forward.tar")
    cache.keep("compiled", key, ".json", out / "result.json")
    return out / "forward.tar", made, False
