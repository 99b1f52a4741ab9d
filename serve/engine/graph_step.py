"""The two small kernels around a decode graph's forward: the step's inputs taken from the
staged buffer, and each row's greedy pick taken from the logits.

Written in torch ops, a replayed step began with six kernels (two copies, a clamp, a gather,
a compare and a `where`) and ended with eight (`row_max`'s two passes and its index
arithmetic, then copies of the tokens and maxima into their buffers): a microsecond or two
each, for almost no work, in a 1B decode step of about 1 ms at batch 1. These two Triton
kernels do the same in one launch each, as dependents of the kernel ahead
(dependent_launch.py); on an H200 the 1B shape's batch-1 decode over HTTP went from 968 to
997-1,001 tok/s with them (docs/performance.md).

- `take_inputs`: one program a row: its position and KV slot, and its token, read where the
  step before sampled it (`tokens[source]`) or as the host staged it (source -1);
- `pick_rows`: `row_max` (each row's maximum, NaN the greatest, and the first index holding
  it) in one kernel: each program finds its part's maximum, and the last of a row's programs
  to arrive (a counter it takes, then sets back to 0 for the next launch) reduces the parts
  in order and writes the row's token, its maximum, and both as float64 side by side for the
  one copy to the host.
"""

from __future__ import annotations

import torch

from flare.serve.engine.dependent_launch import chained

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch ships without Triton
    triton = None

PART = 2048
"""Logits a program of `pick_rows` reads: 63 parts for a 128K vocabulary, a row's programs
spread over the GPU at batch 1, their partial results one load for the last."""
MOST_PARTS = 1024
"""Parts a row may have (a 2M vocabulary): the last program reads them in one block."""


def take_inputs(
    staged: torch.Tensor,
    tokens: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """For each row r < len(ids): positions[r], slots[r] = staged[1, r], staged[2, r]; ids[r]
    = tokens[staged[3, r]] where that source is ≥ 0, else staged[0, r].

    staged: int32 [4, width ≥ rows] (a row-major view of the pinned buffer's device twin);
    tokens, ids, positions, slots: int64."""
    rows = len(ids)
    dependent = chained(ids.device)
    _take_inputs_kernel[(rows,)](
        staged, tokens, ids, positions, slots, staged.stride(0),
        DEPENDENT=dependent, num_warps=1, launch_pdl=dependent,
    )  # fmt: skip


def pick_rows(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    maxima: torch.Tensor,
    packed: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """Each row's maximum of `logits` [rows, vocab] (rows contiguous) into maxima [rows]
    (its dtype), the first index holding it into tokens [rows] (int64), and both into packed
    [rows, 2] (float64: index, maximum; rows contiguous): what `sampler.row_max` gives.

    scratch: int32 [rows, 2 * parts + 1] from `pick_scratch`, zero, and zero again after."""
    rows, vocab = logits.shape
    block, parts = _parts(vocab)
    dependent = chained(logits.device)
    _pick_rows_kernel[(rows, parts)](
        logits, tokens, maxima, packed, scratch, vocab,
        logits.stride(0), packed.stride(0), scratch.stride(0),
        BLOCK=block, PARTS=parts, PARTS_BLOCK=triton.next_power_of_2(parts),
        DEPENDENT=dependent, num_warps=4, launch_pdl=dependent,
    )  # fmt: skip


def pick_scratch(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """The room `pick_rows` needs for `rows` rows: each part's maximum (as float32 bits) and
    its index, and the row's counter, all zero."""
    _, parts = _parts(vocab)
    return torch.zeros((rows, 2 * parts + 1), dtype=torch.int32, device=device)


def build_kernels(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Launch both kernels once as a decode graph does, so Triton compiles them now, into its
    cache folder (which a package's compile phase packs), not at a start."""
    staged = torch.zeros((4, 16), dtype=torch.int32, device=device)
    step = [torch.zeros(16, dtype=torch.int64, device=device) for _ in range(4)]
    take_inputs(staged, *step)
    logits = torch.zeros((16, vocab), dtype=dtype, device=device)
    packed = torch.zeros((16, 2), dtype=torch.float64, device=device)
    maxima = torch.zeros(16, dtype=dtype, device=device)
    pick_rows(logits, step[0], maxima, packed, pick_scratch(16, vocab, device))


def _parts(vocab: int) -> tuple[int, int]:
    """A part's width and how many parts a row has."""
    block = min(PART, triton.next_power_of_2(vocab))
    parts = triton.cdiv(vocab, block)
    if parts > MOST_PARTS:
        raise ValueError(f"a vocabulary of {vocab} is wider than {MOST_PARTS * PART} logits")
    return block, parts


if triton is not None:

    @triton.jit(do_not_specialize=["width"])
    def _take_inputs_kernel(
        staged_ptr, tokens_ptr, ids_ptr, positions_ptr, slots_ptr, width,
        DEPENDENT: tl.constexpr,
    ):  # fmt: skip
        """Program r: row r's inputs from column r of the staged rows (ids, positions, slots,
        sources), `width` apart."""
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0)
        given = tl.load(staged_ptr + row).to(tl.int64)
        position = tl.load(staged_ptr + width + row).to(tl.int64)
        slot = tl.load(staged_ptr + 2 * width + row).to(tl.int64)
        source = tl.load(staged_ptr + 3 * width + row)
        pending = tl.load(tokens_ptr + tl.maximum(source, 0))
        tl.store(ids_ptr + row, tl.where(source >= 0, pending, given))
        tl.store(positions_ptr + row, position)
        tl.store(slots_ptr + row, slot)

    @triton.jit
    def _first_greatest(values, indices, there):
        """The greatest of `values` where `there` (NaN above all) and the least index among
        the places holding it: ties go to the first, as torch's max does."""
        nan = (values != values) & there
        first_nan = tl.min(tl.where(nan, indices, 2147483647), axis=0)
        top = tl.max(tl.where(there & ~nan, values, float("-inf")), axis=0)
        first_top = tl.min(tl.where(there & (values == top), indices, 2147483647), axis=0)
        return tl.where(first_nan < 2147483647, first_nan, first_top)

    @triton.jit(do_not_specialize=["vocab", "logits_stride", "packed_stride", "scratch_stride"])
    def _pick_rows_kernel(
        logits_ptr, tokens_ptr, maxima_ptr, packed_ptr, scratch_ptr, vocab,
        logits_stride, packed_stride, scratch_stride,
        BLOCK: tl.constexpr, PARTS: tl.constexpr, PARTS_BLOCK: tl.constexpr,
        DEPENDENT: tl.constexpr,
    ):  # fmt: skip
        """Program (row, part): the part's greatest logit and its index into the row's
        scratch; the row's last program to take its counter reduces the parts in order and
        writes the row's results."""
        if DEPENDENT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        logits = logits_ptr + row * logits_stride
        at = part * BLOCK + tl.arange(0, BLOCK)
        there = at < vocab
        values = tl.load(logits + at, mask=there, other=float("-inf")).to(tl.float32)
        index = _first_greatest(values, at, there)
        scratch = scratch_ptr + row * scratch_stride
        best = tl.load(logits + index).to(tl.float32)
        tl.store(scratch + part, best.to(tl.int32, bitcast=True))
        tl.store(scratch + PARTS + part, index)
        tl.debug_barrier()
        arrived = tl.atomic_add(scratch + 2 * PARTS, 1, sem="acq_rel")
        if arrived == PARTS - 1:
            each = tl.arange(0, PARTS_BLOCK)
            known = each < PARTS
            bits = tl.load(scratch + each, mask=known, other=0, cache_modifier=".cg")
            where = tl.load(scratch + PARTS + each, mask=known, other=0, cache_modifier=".cg")
            winner = _first_greatest(bits.to(tl.float32, bitcast=True), where, known)
            top = tl.load(logits + winner)
            tl.store(tokens_ptr + row, winner.to(tl.int64))
            tl.store(maxima_ptr + row, top)
            tl.store(packed_ptr + row * packed_stride, winner.to(tl.float64))
            tl.store(packed_ptr + row * packed_stride + 1, top.to(tl.float64))
            tl.atomic_xchg(scratch + 2 * PARTS, 0)
