"""Rounded runs against a float32 truth, step by step on the same tokens.

Random weights make logits nearly flat, so free-running greedy sequences of two bf16 runs part
at the first near tie that rounding flips, and "equal continuations" alone says little. The
lockstep compare feeds the truth's greedy tokens to every run and counts, at each position,
how far each rounded run's logits are from the truth's and whether its greedy choice differs:
a run is as exact as another when its figures match the other's (both only round differently
from float32). gpu_attention.py and gpu_correctness.py tally with it.
"""

from __future__ import annotations

from typing import Any

import torch


class Lockstep:
    """The tally of named rounded runs against the truth, fed one step's logits at a time."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.positions = 0
        self.worst = dict.fromkeys(names, 0.0)
        self.differ = dict.fromkeys(names, 0)

    def add(self, truth: torch.Tensor, rounded: dict[str, torch.Tensor]) -> list[int]:
        """One step: `truth` and each run's logits [rows, vocab] at the same positions;
        returns the truth's greedy tokens, the ones to feed every run next."""
        truth = truth.float()
        chosen = truth.argmax(-1)
        for name, logits in rounded.items():
            logits = logits.float().to(truth.device)
            self.worst[name] = max(self.worst[name], (logits - truth).abs().max().item())
            self.differ[name] += int((logits.argmax(-1) != chosen).sum())
        self.positions += truth.shape[0]
        return chosen.tolist()

    def report(self, suffix: str = "") -> dict[str, Any]:
        """Per run: its largest logit difference from the truth, and how often (count and
        percent of positions) its greedy choice differs from the truth's."""
        share = 100 / max(1, self.positions)
        return {
            "positions": self.positions,
            **{
                f"{name}{suffix}": {
                    "max_abs_logit_diff": round(self.worst[name], 4),
                    "greedy_differs": self.differ[name],
                    "greedy_differs_pct": round(share * self.differ[name], 2),
                }
                for name in self.names
            },
        }
