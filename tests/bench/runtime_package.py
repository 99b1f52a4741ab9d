"""A package built by the CLI and loaded in this process as `flare serve` loads it, for the
in-process GPU scripts (gpu_correctness.py, gpu_step_profile.py), which need the runtime's
engine and runner at hand rather than its HTTP API.

The scripts run in a flare home of their own (FLARE_HOME under their work folder; a
FLARE_KERNEL_CACHE set outside is kept, so several scripts in one device call share what tune
and compile made for the same shapes). Each script runs every step path, `PATHS`: the
CUDA-graph/eager choice is `load_runtime`'s `cuda_graphs` and `prefill_graphs` keywords.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpu_package import flare

from flare.serve.runtime import Runtime, load_runtime

PATHS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("cuda_graphs", {"cuda_graphs": True, "prefill_graphs": False}),
    ("prefill_graphs", {"cuda_graphs": True, "prefill_graphs": True}),
    ("eager", {"cuda_graphs": False}),
)
"""The step paths to run, by name, each with its `load_runtime` keywords: decode steps from
CUDA graphs (prefills kernel by kernel), prefill steps too (serve's default), or neither.
"eager" is decode without CUDA graphs: its forward is still the package's compiled one where
the package has one (the runtime's `start_report` says which); on a CPU the paths run the
same steps."""


@contextmanager
def exact_float32() -> Iterator[None]:
    """Float32 matrix products without TF32 inside the block (references that are the truth),
    the process's settings restored after: torch's matmul precision is part of Inductor's cache
    keys, so a runtime loaded with it changed misses the package's compiled graphs and
    compiles them again (gpu_correctness.py's first path did, 2026-12-03)."""
    import torch

    backends = (torch.backends.cuda.matmul, torch.backends.cudnn)
    name = "fp32_precision" if hasattr(backends[0], "fp32_precision") else "allow_tf32"
    saved = [getattr(backend, name) for backend in backends]
    for backend in backends:
        backend.allow_tf32 = False
    try:
        yield
    finally:
        for backend, value in zip(backends, saved, strict=True):
            setattr(backend, name, value)


@contextmanager
def scratch_home(prefix: str) -> Iterator[tuple[Path, dict[str, str]]]:
    """A work folder that is this process's flare home, with a signing key, removed after (a
    1B checkpoint and its package take GBs of the device's disk): the folder, and the
    environment for the CLI (this process's, which the in-process pull reads)."""
    kept = {k: v for k, v in os.environ.items() if k == "FLARE_KERNEL_CACHE"}
    for key in [k for k in os.environ if k.startswith("FLARE_")]:
        del os.environ[key]
    os.environ.update(kept)
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        work = Path(folder)
        os.environ |= {"FLARE_HOME": str(work / "home"), "XDG_CONFIG_HOME": str(work / "xdg")}
        env = dict(os.environ)
        flare(env, "key", "generate", "--publisher", "lab")
        yield work, env


def build(
    env: dict[str, str], source: Path, name: str, target: str, *options: str
) -> dict[str, float]:
    """`flare build SOURCE --name NAME --target TARGET [OPTIONS]`; its phases' seconds."""
    command = ("build", str(source), "--name", name, "--target", target, "--json", *options)
    built = json.loads(flare(env, *command))
    return {p["name"]: round(p["seconds"], 2) for p in built["phases"]}


def load(name: str, device: str, **options: Any) -> Runtime:
    """Pull `name` into the host cache and load it as `flare serve` does (serve/launch.py's
    load_package_app), with `options` for load_runtime on top."""
    from flare.config import load_config
    from flare.serve.launch import pull_into_cache

    _, cache, report = pull_into_cache(name, None, device, None, None)
    plan = report.plan
    options = {
        "memory_reserve": load_config()["memory.reserve"],
        "quarantine": cache.quarantine_if_corrupt,
        "compile_root": cache.root / "compiled",
        **options,
    }
    return load_runtime(plan.manifest, cache.files(plan.manifest), plan.device, **options)
