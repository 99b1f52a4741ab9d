"""The kernels around a decode graph's forward (serve/engine/graph_step.py): the step's inputs
taken from the staged rows, and each row's greedy pick, exactly `row_max`'s.

They run on CUDA, or on a CPU through Triton's interpreter where Triton is installed and
TRITON_INTERPRET=1 is set (`TRITON_INTERPRET=1 pytest tests/test_graph_step.py`).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, DTYPE, needs_kernel

from flare.serve.engine.graph_step import pick_rows, pick_scratch, take_inputs
from flare.serve.engine.sampler import row_max

pytestmark = needs_kernel


def _picked(logits: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, ...]:
    rows = len(logits)
    tokens = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    maxima = torch.zeros(rows, dtype=logits.dtype, device=DEVICE)
    packed = torch.zeros((rows, 2), dtype=torch.float64, device=DEVICE)
    pick_rows(logits, tokens, maxima, packed, scratch)
    return tokens, maxima, packed


def _hard_rows(vocab: int, seed: int) -> torch.Tensor:
    """Rows with many ties at the top, equal maxima in different parts, NaN, ±inf, all -inf
    and all equal."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(-4, 4, (8, vocab), generator=generator).float()
    rows[1, vocab // 2] = 9.0
    rows[1, vocab - 1] = 9.0
    rows[2, vocab - 2] = float("nan")
    rows[2, 3] = float("inf")
    rows[3] = float("-inf")
    rows[4, vocab - 1] = float("nan")
    rows[4, vocab - 3] = float("nan")
    rows[5, :] = 2.5
    rows[6, 0] = float("-inf")
    rows[7, vocab - 1] = 5.0
    return rows.to(DTYPE).to(DEVICE)


@pytest.mark.parametrize("vocab", [128 * 1002, 4099, 300])
def test_the_greedy_pick_is_row_max_with_ties_to_the_first_and_nan_greatest(vocab: int) -> None:
    """Many parts (a 128K vocabulary), a part cut short (a prime), one part: the token and
    the maximum `row_max` gives, and both as float64 side by side; the same scratch serves a
    second launch (its counters set back), which sees its own logits."""
    scratch = pick_scratch(8, vocab, torch.device(DEVICE))
    for seed in (vocab, vocab + 1):
        logits = _hard_rows(vocab, seed)
        tokens, maxima, packed = _picked(logits, scratch)
        values, indices = row_max(logits.float().cpu())
        assert tokens.tolist() == indices.tolist()
        assert torch.equal(maxima.float().cpu().isnan(), values.isnan())
        assert torch.equal(maxima.float().cpu().nan_to_num(), values.nan_to_num())
        assert packed[:, 0].tolist() == indices.double().tolist()
        assert torch.equal(packed[:, 1].cpu().nan_to_num(), values.double().nan_to_num())
        assert int(scratch[:, -1].abs().sum()) == 0


def test_a_pick_of_fewer_rows_leaves_the_rows_after_them() -> None:
    """A graph of 2 rows writes rows 0 and 1 of buffers made for more."""
    logits = _hard_rows(4099, 3)
    scratch = pick_scratch(8, 4099, torch.device(DEVICE))
    tokens = torch.full((8,), -7, dtype=torch.int64, device=DEVICE)
    maxima = torch.zeros(8, dtype=DTYPE, device=DEVICE)
    packed = torch.full((8, 2), -7.0, dtype=torch.float64, device=DEVICE)
    pick_rows(logits[:2], tokens[:2], maxima[:2], packed[:2], scratch)
    assert tokens.tolist()[2:] == [-7] * 6 and packed[2:].eq(-7).all()
    assert tokens.tolist()[:2] == row_max(logits[:2].float().cpu())[1].tolist()


def test_a_steps_inputs_are_the_staged_ones_or_the_pending_tokens_where_they_come_from() -> None:
    """Row r: its position and slot as staged; its token staged (source -1) or read from the
    row of the step before's tokens its source names; rows past the step's are not touched."""
    width, rows = 16, 5
    staged = torch.zeros((4, width), dtype=torch.int32)
    staged[0, :rows] = torch.tensor([11, 12, 13, 14, 15])
    staged[1, :rows] = torch.tensor([0, 7, 300, 2**20, 5])
    staged[2, :rows] = torch.tensor([16, 2**30, 9, 8, 33])
    staged[3, :rows] = torch.tensor([-1, 3, -1, 0, 4])
    tokens = torch.tensor([100, 101, 102, 2**40, 104, 105], dtype=torch.int64)
    out = [torch.full((8,), -9, dtype=torch.int64, device=DEVICE) for _ in range(3)]
    ids, positions, slots = out
    take_inputs(staged.to(DEVICE), tokens.to(DEVICE), ids[:rows], positions[:rows], slots[:rows])
    assert ids.tolist() == [11, 2**40, 13, 100, 104, -9, -9, -9]
    assert positions.tolist() == [0, 7, 300, 2**20, 5, -9, -9, -9]
    assert slots.tolist() == [16, 2**30, 9, 8, 33, -9, -9, -9]
