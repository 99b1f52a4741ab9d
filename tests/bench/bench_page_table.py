"""What a CUDA-graph decode step's page table costs the host, by context length.

Each decode step the host writes every sequence's KV pages, one after another, into the pinned
buffer FlashInfer reads (serve/engine/cuda_graphs.py: `DecodeGraphs._fill`). Made from the
block tables' Python lists (`flashinfer_attention.page_table`, then a numpy write: the graph
path before, the eager path's planner still) that is work a page, which grows with the
contexts; joined from each sequence's `BlockTable` int32 array (`page_counts`, then
`join_pages`: the graph path now) it is work a sequence.

    python tests/bench/bench_page_table.py [--sequences 64] [--pages 20,64,256]

Block size 16: 20, 64 and 256 pages a sequence are contexts of about 320, 1K and 4K tokens.
Nothing asserts on time: the script prints microseconds a step, median of 5 runs of 200.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable

import numpy as np

from flare.serve.engine.flashinfer_attention import page_counts, page_table
from flare.serve.engine.sequence import BlockTable, join_pages

BLOCK = 16
RUNS = 5
CALLS = 200


def from_lists(tables: list[list[int]], contexts: list[int], out: np.ndarray) -> None:
    _, indices, _ = page_table(contexts, tables, BLOCK)
    out[: len(indices)] = indices


def from_block_tables(tables: list[BlockTable], contexts: list[int], out: np.ndarray) -> None:
    pages, _ = page_counts(contexts, BLOCK)
    join_pages(tables, pages, out[: sum(pages)])


def microseconds(action: Callable[[], None]) -> float:
    return 1e6 * statistics.median(timeit.repeat(action, number=CALLS, repeat=RUNS)) / CALLS


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--pages", default="20,64,256")
    args = parser.parse_args()
    print("| pages a sequence | context | lists (µs a step) | block tables (µs a step) | ratio |")
    print("|---|---|---|---|---|")
    for per in map(int, args.pages.split(",")):
        lists = [list(range(i * 10_000, i * 10_000 + per)) for i in range(args.sequences)]
        tables = [BlockTable(ids) for ids in lists]
        contexts = [per * BLOCK - 3] * args.sequences
        out = np.zeros(args.sequences * per, dtype=np.int32)
        from_lists(lists, contexts, out)
        want = out.copy()
        from_block_tables(tables, contexts, out)
        assert np.array_equal(out, want), "the two ways disagree"
        before = microseconds(lambda: from_lists(lists, contexts, out))  # noqa: B023
        now = microseconds(lambda: from_block_tables(tables, contexts, out))  # noqa: B023
        print(f"| {per} | {per * BLOCK - 3} | {before:.1f} | {now:.1f} | {before / now:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
