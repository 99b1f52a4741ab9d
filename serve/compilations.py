"""Every compilation in this process, counted, so a server can say none happened after ready.

A compilation here is anything that turns code into machine code while the process runs:
Dynamo tracing a frame (the start of every torch.compile graph, and of every recompile a
failed guard causes), Inductor compiling a graph its cache did not hold, a C++ or Triton
kernel built, a CUDA graph recorded. Loading a graph Inductor's cache holds (what a package's
compiled forward is at start) is counted apart, as a load: it reads code, it makes none.

The figures are process-wide (Dynamo and Inductor are): a runtime takes a snapshot when it
is ready and reports what happened since.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections import Counter
from dataclasses import dataclass, fields

SHOWN = 3
"""Kernel names a description lists before it says there were more."""

_events: Counter[str] = Counter()
_built: list[str] = []
_lock = threading.Lock()
_watching: set[str] = set()
"""What `watch` counts already: `kernels`, `compiler`."""


@dataclass(frozen=True)
class Compilations:
    """Totals since the process started (or, subtracted, between two snapshots)."""

    traced: int = 0
    """Frames Dynamo traced (a graph's first call, or a recompile)."""
    compiled: int = 0
    """Graphs Inductor compiled because its cache did not hold them."""
    kernels: int = 0
    """C++ and Triton kernels built."""
    recorded: int = 0
    """CUDA graphs recorded."""
    loaded: int = 0
    """Graphs loaded from Inductor's cache or precompiled (not a compilation)."""
    built: tuple[str, ...] = ()
    """The kernels built, by name (a Triton kernel, a C++ source, a FlashInfer module)."""

    @property
    def total(self) -> int:
        """Everything that made code: all but the loads."""
        return self.traced + self.compiled + self.kernels + self.recorded

    def __sub__(self, other: Compilations) -> Compilations:
        counts = {f.name for f in fields(self)} - {"built"}
        return Compilations(
            **{name: getattr(self, name) - getattr(other, name) for name in counts},
            built=self.built[len(other.built) :],
        )

    def describe(self) -> str:
        """One phrase for the ready line: `2 traced, 0 compiled (1 loaded), 0 kernels built`."""
        text = f"{self.traced} traced, {self.compiled} compiled ({self.loaded} loaded)"
        text += f", {self.kernels} kernels built"
        if self.built:
            shown = ", ".join(self.built[:SHOWN])
            text += f" ({shown}{', …' if len(self.built) > SHOWN else ''})"
        return text + (f", {self.recorded} CUDA graphs recorded" if self.recorded else "")


def watch(compiler: bool = True) -> None:
    """Count from now on each Triton kernel built and, with `compiler`, Dynamo's compile
    triggers (idempotent). Call before the first compile; without it a process that never
    imports the compiler counts nothing, truly. A forward that never compiles (on CUDA,
    where it calls flare's kernels directly) watches kernels only: watching Dynamo imports
    it, a second or more of a start (its graphs, where Dynamo is imported later all the same,
    still show in Inductor's counters, which `snapshot` reads)."""
    with _lock:
        if "kernels" not in _watching:
            _watch_triton()
            _watching.add("kernels")
        if compiler and "compiler" not in _watching:
            _watch_dynamo()
            _watching.add("compiler")


def _watch_dynamo() -> None:
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    def started(args: object) -> None:
        trigger = getattr(args, "callback_trigger", None)
        if trigger is CallbackTrigger.CUDAGRAPH_RECORDING:
            note("recorded")
        elif trigger is not CallbackTrigger.TRITON_AUTOTUNING:
            note("traced")

    callback_handler.register_start_callback(started)


def _watch_triton() -> None:
    """Count each Triton kernel Triton compiles (not one it found in its cache), where Triton
    is installed. Inductor loads a cached graph's kernels without Triton's compiler, so what
    this counts is code made now."""
    if importlib.util.find_spec("triton") is None:
        return
    from triton import knobs

    before = knobs.compilation.listener

    def compiled(*args: object, **kwargs: object) -> None:
        if not kwargs.get("cache_hit", args[4] if len(args) > 4 else False):
            source = kwargs.get("src", args[0] if args else None)
            note_kernel(str(getattr(source, "name", "a Triton kernel")))
        if before is not None:
            before(*args, **kwargs)

    knobs.compilation.listener = compiled


def note(event: str) -> None:
    """Count one event (`traced`, `recorded`: from `watch`; `traced` and `compiled` for a
    graph compiled ahead of time, which neither Dynamo's callbacks nor Inductor's cache
    counters see; `loaded`: a precompiled graph)."""
    with _lock:
        _events[event] += 1


def note_kernel(name: str) -> None:
    """Count one kernel built, by name (from the compiler hooks)."""
    with _lock:
        _events["kernels"] += 1
        _built.append(name)


def snapshot() -> Compilations:
    """The totals now."""
    inductor: dict[str, int] = {}
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        inductor = dict(counters["inductor"])
    with _lock:
        events, built = dict(_events), tuple(_built)
    return Compilations(
        traced=events.get("traced", 0),
        compiled=inductor.get("fxgraph_cache_miss", 0)
        + inductor.get("fxgraph_cache_bypass", 0)
        + events.get("compiled", 0),
        kernels=events.get("kernels", 0),
        recorded=events.get("recorded", 0),
        loaded=inductor.get("fxgraph_cache_hit", 0) + events.get("loaded", 0),
        built=built,
    )
