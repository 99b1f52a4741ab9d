"""Fused parameters filled from their parts: how a package of an older layout still loads.

A recipe-v2 llama package holds each layer's q, k, v as one `qkv_proj` (gate, up as one
`gate_up_proj`), the parameters the model computes with. A v1 package holds the parts; each
is copied into its rows of the fused parameter (a view copy, nothing concatenated), so one
model class serves both layouts. A package that gives a fused tensor and also one of its
parts, or only some of its parts, is refused; `check_layout` refuses a manifest whose fused
map says the rows are laid out otherwise than the model computes with.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from flare.errors import InvalidInputError
from flare.store.package import MALFORMED_HINT, FusedPart
from flare.store.safetensors import FormatError

Parts = dict[str, tuple[tuple[str, int], ...]]
"""Fused parameter name → (part name, this rank's rows of it), in row order."""


class FusedRows:
    """Where each part of a fused parameter goes: the parameter and its row range."""

    def __init__(self, module: nn.Module, parts: Parts) -> None:
        self.params = dict(module.named_parameters())
        self.places: dict[str, tuple[str, int, int]] = {}
        for fused, pieces in parts.items():
            start = 0
            for name, rows in pieces:
                self.places[name] = (fused, start, start + rows)
                start += rows
        self.parts = parts
        self.filled: dict[str, set[str]] = {fused: set() for fused in parts}
        self.whole: set[str] = set()

    def place(
        self, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, with each part copied into its rows instead of passed on. Once all
        of a parameter's parts are in, the parameter is passed on as itself (copying a
        tensor onto itself does nothing), so the loader's checks see it set."""
        for name, tensor in tensors:
            if name in self.places:
                yield from self._fill(name, tensor)
            else:
                if name in self.parts:
                    self.whole.add(name)
                    self._refuse_both(name)
                yield name, tensor
            del tensor  # held here, a GPU load's payload buffer would outlive its copy
        partial = [n for fused, done in self.filled.items() if done for n in self._lacking(fused)]
        if partial:
            raise InvalidInputError(f"the package lacks tensors: {', '.join(partial[:3])}")

    def _fill(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        fused, start, stop = self.places[name]
        param = self.params[fused]
        want = (stop - start, *param.shape[1:])
        if tuple(tensor.shape) != want:
            raise FormatError(
                f"tensor {name} is {list(tensor.shape)} in the payload, the package's "
                f"config.json makes it {list(want)}",
                MALFORMED_HINT,
            )
        self.filled[fused].add(name)
        self._refuse_both(fused)
        with torch.no_grad():
            param[start:stop].copy_(tensor)
        if not self._lacking(fused):
            yield fused, param

    def _lacking(self, fused: str) -> list[str]:
        return [name for name, _ in self.parts[fused] if name not in self.filled[fused]]

    def _refuse_both(self, fused: str) -> None:
        if fused in self.whole and self.filled[fused]:
            part = sorted(self.filled[fused])[0]
            raise FormatError(f"the package gives both {fused} and its part {part}", MALFORMED_HINT)


def check_layout(
    declared: Mapping[str, tuple[FusedPart, ...]] | None, parts: Parts, world: int, where: str
) -> None:
    """The manifest's fused map (whole rows) must be the model's own (a rank's rows, times
    the ranks): the same parts, in the same order, with the same rows."""
    for fused, pieces in (declared or {}).items():
        said = [(piece.name, piece.rows) for piece in pieces]
        ours = [(name, rows * world) for name, rows in parts.get(fused, ())]
        if said != ours:
            raise FormatError(
                f"{where} fuses {fused} from {said}; this runtime computes it from {ours}",
                MALFORMED_HINT,
            )
