"""FlashInfer's kernel modules, built at compile time and shipped with the compiled forward.

FlashInfer builds a kernel module (nvcc, then ninja) the first time a shape needs it: 95 s on
16 cores for a new head size, which used to land on a server's first request. On CUDA, the
compile phase's warm-up runs the package's attention, so every module its shapes need is built
then, in a workspace of the compile's own (`build_into`); the modules are copied into the
Inductor cache folder before it is packed (`collect`), and at start FlashInfer is told to take
them as prebuilt ("AOT") modules (`use_modules`), which it loads without a compiler. A module it
would still build is counted as a compilation.

Checked on CUDA hosts only (this module does nothing where FlashInfer is not installed).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from flare.serve import compilations

FOLDER = "flashinfer"
"""In the compiled forward's folder: flashinfer/<module>/<module>.so."""
WORKSPACE = "flashinfer-workspace"


def available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def build_into(out: Path) -> None:
    """Have FlashInfer build its modules under `out` (before FlashInfer is imported)."""
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(out / WORKSPACE)


def collect(out: Path, folder: Path) -> list[str]:
    """Copy the modules built under `out` into `folder`/flashinfer; return their names."""
    workspace = out / WORKSPACE  # .cache/flashinfer/<version>/<archs>/cached_ops/<module>/
    built = sorted(p for p in workspace.rglob("*.so") if p.parent.parent.name == "cached_ops")
    for library in built:
        target = folder / FOLDER / library.parent.name / library.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library, target)
    return [library.parent.name for library in built]


def use_modules(folder: Path) -> None:
    """Load FlashInfer's modules from `folder`/flashinfer as prebuilt ones, and count every
    module it still builds."""
    if not available():
        return
    from flashinfer.jit import core
    from flashinfer.jit import env as jit_env

    jit_env.FLASHINFER_AOT_DIR = folder / FOLDER
    run = core.run_ninja

    def counted(*args: object, **kwargs: object) -> None:
        ninja_file = kwargs.get("ninja_file", args[1] if len(args) > 1 else None)
        compilations.note_kernel(f"FlashInfer {Path(str(ninja_file)).parent.name}")
        run(*args, **kwargs)

    if getattr(run, "__name__", "") != "counted":
        core.run_ninja = counted
