"""A serving process's heap, frozen once it is loaded.

Python's cyclic garbage collector now and then runs a full collection, which walks every
tracked object of the process. A loaded server holds hundreds of thousands of them (torch,
the model's modules, the tokenizer, the compiled forward), all alive until it exits, and a
full collection of them stops the engine's step loop, or the API's event loop, for every
stream at once: about 100 ms on a tiny model on this repository's 2-core CPU
(`python tests/bench/bench_gc_pause.py`, docs/performance.md). `gc.freeze` moves them out of
the collector's sight, as vLLM's engine does after it loads; what requests allocate is
collected as before.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect what loading left behind, then freeze every object alive now: call once a
    long-lived process has loaded what it serves, before the first request."""
    gc.collect()
    gc.freeze()
