"""What a CUDA-graph decode step's page table costs the host, by context length.

Each decode step the host writes every sequence's KV pages, one after another, into the pinned
buffer FlashInfer reads (serve/engine/cuda_graphs.py: `page_table`, then the numpy write),
from the sequences' block tables, which are Python lists: work a page, so it grows with the
contexts. Beside it, what the same flat table costs from per-sequence int32 arrays joined by
numpy (the baseline a table kept as arrays, grown a block at a time, would pay each step).

    python tests/bench/bench_page_table.py [--sequences 64] [--pages 20,64,256]

Block size 16: 20, 64 and 256 pages a sequence are contexts of about 320, 1K and 4K tokens.
Nothing asserts on time: the script prints microseconds a step, median of 5 runs of 200.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import numpy as np

from flare.serve.engine.flashinfer_attention import page_table

BLOCK = 16
RUNS = 5
CALLS = 200


def as_staged(tables: list[list[int]], contexts: list[int], staged: np.ndarray) -> None:
    """What a step does now: the page table from the lists, then its indices into the pinned
    buffer's numpy view."""
    _, indices, _ = page_table(contexts, tables, BLOCK)
    staged[: len(indices)] = indices


def as_arrays(arrays: list[np.ndarray], pages: list[int], staged: np.ndarray) -> None:
    """The baseline: each sequence's pages already an int32 array, joined into the buffer."""
    np.concatenate([a[:n] for a, n in zip(arrays, pages, strict=True)], out=staged[: sum(pages)])


def microseconds(action: object) -> float:
    times = timeit.repeat(action, number=CALLS, repeat=RUNS)  # type: ignore[arg-type]
    return 1e6 * statistics.median(times) / CALLS


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--pages", default="20,64,256")
    args = parser.parse_args()
    print("| pages a sequence | context | lists, as now (µs a step) | int32 arrays (µs) | ratio |")
    print("|---|---|---|---|---|")
    for per in map(int, args.pages.split(",")):
        tables = [list(range(i * 10_000, i * 10_000 + per)) for i in range(args.sequences)]
        contexts = [per * BLOCK - 3] * args.sequences
        arrays = [np.asarray(t, dtype=np.int32) for t in tables]
        pages = [per] * args.sequences
        staged = np.zeros(args.sequences * per, dtype=np.int32)
        now = microseconds(lambda: as_staged(tables, contexts, staged))  # noqa: B023
        base = microseconds(lambda: as_arrays(arrays, pages, staged))  # noqa: B023
        print(f"| {per} | {per * BLOCK - 3} | {now:.1f} | {base:.1f} | {now / base:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
