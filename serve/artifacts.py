"""What a package prepared for this runtime, and how its forward runs: the start's plan.

A package built for a device target carries tuning records (serve/tuning.py) and a compiled
forward (serve/compiled.py) for it. Compatibility was checked at admission (serve/compat.py):
artifacts made with another toolchain never get here unless the server compiles itself
(`--compile-on-start`). So at start a generating runtime either

- runs the package's compiled forward: its archive is unpacked once into a folder of the host
  cache named by the archive's digest (shared by every server of it), Inductor is pointed at
  it, and warm-up traces the step and loads the graph and its kernels: nothing is compiled.
  On CUDA the forward runs eagerly on the archive's kernels instead: every operation of a
  layer is one of flare's own kernels there (its products, norms, activation, KV store and
  attention), called directly, so Inductor's graphs add nothing a CUDA graph's replay does
  not, and leaving them out leaves Dynamo's and Inductor's imports out of the start (about
  3 s on the H200's host: docs/performance.md);
- compiles at start (`--compile-on-start`), into a folder of the host cache for this package
  and host, and says how long it took;
- or runs eagerly: a package built before targets existed, or for target none, is uncompiled.

`StartReport` is what the server prints when it is ready: start-to-ready with its parts and
the compilations the start made.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.filesize import decimal

from flare.serve.compilations import Compilations
from flare.serve.models.files import PackageFiles, WeightsRead
from flare.serve.tuning import Decisions
from flare.store.digest import Digest

if TYPE_CHECKING:
    from flare.serve.engine.cuda_graphs import GraphReport

COMPILE_MODES = ("package", "start", "off")
"""`package`: the package's compiled forward if it has one (else eager); `start`: compile at
start whatever the package holds; `off`: eager."""


@dataclass(frozen=True)
class RuntimeArtifacts:
    """The plan for one start: how the forward runs and from where."""

    forward: str
    """`package` (compiled, from the package), `start` (compiled now) or `eager`."""
    decisions: Decisions | None
    """The package's tuning decisions for this device, if it has them and they are used."""
    archive: bytes | None = None
    """The compiled forward's archive, checked against its digest (forward `package`)."""
    folder: Path | None = None
    """The Inductor cache folder the forward runs from (compiled forwards)."""
    why: str = ""
    """Why the forward is eager, when it is."""
    compiler: bool = False
    """Whether the forward runs Inductor's graphs (a compiled forward on a CPU), so the load
    needs Dynamo and Inductor; on CUDA a compiled forward is the archive's kernels alone."""


def runtime_artifacts(
    package: PackageFiles, device: str, compile_mode: str, root: Path | None
) -> RuntimeArtifacts:
    """The start's plan for `package` on `device` (`root`: the host cache's folder for
    compiled forwards; None: a temporary one, removed at exit)."""
    own = {a.kind: a for a in package.manifest.artifacts if a.target == device}
    tuning, compiled = own.get("tuning"), own.get("compiled")
    if compile_mode == "off":
        return RuntimeArtifacts("eager", None, why="compiling is off")
    decisions = _decisions(package, tuning.path) if tuning is not None else None
    graphs = device != "cuda"
    if compile_mode == "start":
        key = Digest.parse(package.manifest.inputs).hex[:32]
        folder = _root(root) / "start" / f"{key}-{device}"
        return RuntimeArtifacts("start", decisions, folder=folder, compiler=graphs)
    if compiled is None:
        why = f"the package has no compiled forward for {device}"
        return RuntimeArtifacts("eager", None, why=why)
    archive = package.artifact(compiled.path)
    folder = _root(root) / Digest.parse(compiled.digest).hex
    return RuntimeArtifacts("package", decisions, archive, folder, compiler=graphs)


def _decisions(package: PackageFiles, path: str) -> Decisions:
    return Decisions.from_records(package.json(path, list) or [])


def _root(root: Path | None) -> Path:
    if root is not None:
        return root
    scratch = Path(tempfile.mkdtemp(prefix="flare-compiled-"))
    atexit.register(shutil.rmtree, scratch, True)
    return scratch


@dataclass
class StartReport:
    """Start-to-ready and its parts, and what the start compiled."""

    forward: str
    why: str = ""
    """Why the forward is eager, or (compiled) why its precompiled graphs were not loaded."""
    compiler: bool = True
    """Whether a compiled forward runs Inductor's graphs (RuntimeArtifacts.compiler), not the
    kernels alone."""
    artifacts: float = 0.0
    """Seconds to unpack the compiled forward (0 when it already was) and point Inductor at it."""
    warm_up: float = 0.0
    """Seconds the first steps took: tracing and loading (or compiling) the forward."""
    compilations: Compilations = field(default_factory=Compilations)
    """What the start made (nothing compiled, for a package's matching compiled forward)."""
    graphs: GraphReport | None = None
    """The decode steps' CUDA graphs, once captured."""
    prefill_graphs: GraphReport | None = None
    """The prefill steps' CUDA graphs, once captured."""
    began: float | None = None
    """When the load began by the wall clock (time.time()), where an engine process loaded
    the runtime: it starts with the command, and may still be importing when the pull ends."""

    def describe(self) -> str:
        """How the forward runs and what its start made."""
        if self.forward == "eager":
            return f"forward uncompiled: {self.why}"
        made = self.compilations.describe()
        if self.forward == "package" and not self.compiler:
            return f"forward on the package's kernels: {made}"
        if self.forward == "package":
            text = f"forward compiled, from the package: {made}"
            return text + (f" (precompiled graphs not loaded: {self.why})" if self.why else "")
        took = self.artifacts + self.warm_up
        what = "compiled" if self.compiler else "kernels built"
        return f"forward {what} at start in {took:.1f} s: {made}"

    def timeline(
        self,
        pull: float,
        load: float,
        total: float,
        weights: WeightsRead | None,
        launched: float | None = None,
        pulled_at: float | None = None,
    ) -> str:
        """Start-to-ready with its parts, for the ready line: `load` is the runtime's whole
        load, of which the engine process's own start left after the pull (`began` less
        `pulled_at`, the pull's end by the wall clock), the artifacts, warm-up and graph
        capture are shown apart; `weights`, the weights' own read (PackageFiles.tensors: the
        payloads' bytes over the time they took, the copies into the model included), says
        how near the disk's speed the load came; `launched`, the seconds since the command
        began (its imports included), what a user waits."""
        captured = [report for report in (self.graphs, self.prefill_graphs) if report]
        engine = 0.0
        if self.began is not None and pulled_at is not None:
            engine = min(max(0.0, self.began - pulled_at), load)
        rest = load - engine - self.artifacts - self.warm_up - sum(g.seconds for g in captured)
        parts = f"pull {pull:.2f} s, "
        if engine >= 0.005:
            parts += f"engine start {engine:.2f} s, "
        parts += f"load {rest:.2f} s"
        if weights is not None and weights.seconds > 0:
            rate = decimal(int(weights.size / weights.seconds))
            parts += f" (weights {decimal(weights.size)} in {weights.seconds:.2f} s at {rate}/s)"
        if self.forward != "eager":
            parts += f", artifacts {self.artifacts:.2f} s, warm-up {self.warm_up:.2f} s"
        if self.graphs is not None:
            parts += f", CUDA graphs {self.graphs.seconds:.2f} s ({self.graphs.describe()})"
        if self.prefill_graphs is not None:
            prefill = self.prefill_graphs
            parts += f", prefill graphs {prefill.seconds:.2f} s ({prefill.describe()})"
        since = f" ({launched:.2f} s after the command began)" if launched is not None else ""
        return f"ready in {total:.2f} s{since}: {parts}; {self.describe()}"
