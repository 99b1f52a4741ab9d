"""The tune phase: what serve will run for the package's shapes, decided once and recorded.

The decisions (serve/tuning.py: attention backend and kernel variant for the head size, GQA
ratio, dtype and page size) are made by the runtime's own program on the build host's device,
kept in the kernel cache under the shapes and toolchain, and stored in the package as the
`tuning` artifact. They are inputs of what follows (compile, the digest): a later build with
the same shapes and toolchain takes them from the kernel cache, and `flare build --check`
takes the package's own, so a rebuild reproduces the package whatever timing would say now.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from flare.build.kernel_cache import KernelCache, cache_key
from flare.build.target import Preparation
from flare.build.worker import run_prepare
from flare.model_sizes import read_sizes

TUNING_PATH = "runtime/tuning.json"
TUNE_FORMAT = 1
"""Bumped when the records' meaning changes: older kernel-cache entries are then not taken."""


def attention_shapes(recipe: str, config: dict[str, Any]) -> dict[str, int]:
    """What attention decisions depend on: head size, query heads, KV heads."""
    sizes = read_sizes(recipe, config)
    return {
        "head_dim": sizes["head_dim"],
        "num_heads": sizes["num_attention_heads"],
        "num_kv_heads": sizes["num_key_value_heads"],
    }


def tuning_inputs(prepared: Preparation, shapes: dict[str, int]) -> dict[str, Any]:
    """Everything the records depend on: their kernel-cache key and the phase's inputs."""
    return {
        "format": TUNE_FORMAT,
        "target": prepared.target,
        "toolchain": {k: v for k, v in prepared.toolchain.items() if k != "forward_code"},
        "shapes": shapes,
        "decode_batch_sizes": prepared.plan()["decode_batch_sizes"],
    }


def tuning_records(
    inputs: dict[str, Any], cache: KernelCache, scratch: Path, retune: bool
) -> tuple[list[dict[str, Any]], bool]:
    """The records, and whether they were reused: the kernel cache's unless `retune`, else
    decided now by the runtime on this host and kept for the next build."""
    key = cache_key("tuning", inputs)
    kept = None if retune else cache.path("tuning", key, ".json")
    if kept is not None:
        return json.loads(kept.read_text()), True
    out = scratch / f"tuning-{key[:16]}.json"
    spec = {
        "target": inputs["target"],
        "shapes": inputs["shapes"],
        "decode_batch_sizes": inputs["decode_batch_sizes"],
    }
    try:
        run_prepare("tune", spec, out)
        records = json.loads(out.read_text())
        cache.keep("tuning", key, ".json", out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return records, False
