"""Running the runtime's own preparation program (serve/prepare.py) for tune and compile.

build does not import serve: what tune decides and what compile produces must come from the
code that serves the package, in a process of its own (fresh compiler caches, the Inductor
cache folder set before the compiler loads, a fixed hash seed), so build runs it as a program
and reads what it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flare.errors import FlareError


class PrepareError(FlareError):
    """Tune or compile failed on this host (a missing compiler, an unsupported shape)."""

    exit_code = 1


def run_prepare(action: str, spec: dict[str, Any], out: Path) -> None:
    """Run `python -m flare.serve.prepare ACTION SPEC OUT`; raise its one-line error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out.parent / f"{out.name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "flare.serve.prepare", action, str(spec_path), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise PrepareError(
            f"{action} for --target {spec['target']} failed: {lines[-1]}",
            "build with --target none to skip it (the package then serves uncompiled)",
        )
