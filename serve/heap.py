"""A serving process's heap, frozen once it is loaded.

Python's cyclic garbage collector now and then runs a full collection, which walks every
tracked object of the process. A loaded server holds hundreds of thousands of them (torch,
the model's modules, the tokenizer, the compiled forward), all alive until it exits, and a
full collection of them stops the engine's step loop, or the API's event loop, for every
stream at once: about 100 ms on a tiny model on this repository's 2-core CPU
(`python tests/bench/bench_gc_pause.py`, docs/performance.md). `gc.freeze` moves them out of
the collector's sight, as vLLM's engine does after it loads; what requests allocate is
collected as before.

Imports are the other side of it: they allocate hundreds of thousands of objects and free
almost none, so the collections they set off find nothing. Torch's, Dynamo's and Inductor's
imports took 3.7-4.0 s with the collector on and 2.5-3.0 s without it on this repository's CPU
(docs/performance.md), and the engine process's imports are its start's path to ready, so
its whole start runs without the collector: what it imported before the package came is
frozen then, and the rest is collected once, as the heap is frozen after the load.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> None:
    """Collect what loading left behind, then freeze every object alive now: call once a
    long-lived process has loaded what it serves, before the first request."""
    gc.collect()
    gc.freeze()


@contextmanager
def uncollected(freeze: bool = False) -> Iterator[None]:
    """Run the block with the cycle collector off: one that makes what lives (imports, a
    load), so collections would find nothing. It is on again after, as it was. `freeze`: the
    block's objects then frozen, for a block of imports alone; a load is frozen once whole
    (`freeze_heap`), as a freeze in its middle would keep whatever cycle is alive then, such as
    one holding a buffer of the weights' read, from ever being collected."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
