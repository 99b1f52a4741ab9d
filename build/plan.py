"""The shard phase's plan: which tensor slices go into which payload, for which ranks.

Replicated tensors go into payloads shared by every rank (one blob, not N copies); split
tensors go into per-rank payloads. A rank's payloads depend only on the checkpoint, the
recipe, the options and the rank, so ranks can be built apart and still agree bit for bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flare.build.checkpoint import SourceTensor
from flare.build.recipes.base import Expected
from flare.store.safetensors import DTYPE_SIZES, TensorSpec, layout_order

PAYLOAD_BYTES = 256 << 20
"""Target payload size: small enough to resume and hash in parallel, large enough to be few."""


@dataclass(frozen=True)
class Slice:
    """Part `index` of `parts` along `dim` (None when the tensor is whole)."""

    dim: int
    parts: int
    index: int


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor (or one rank's slice of it) and where its bytes come from."""

    source: SourceTensor
    file_digest: str
    slice: Slice | None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)
        if self.slice is not None:
            shape[self.slice.dim] //= self.slice.parts
        return tuple(shape)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.source.name, self.source.dtype, self.shape)

    def regions(self) -> tuple[int, int, int, int]:
        """The slice's bytes in the source file as (offset, rows, stride, row_length)."""
        src, itemsize = self.source, DTYPE_SIZES[self.source.dtype]
        if self.slice is None:
            return src.offset, 1, src.nbytes, src.nbytes
        dim = self.slice.dim
        inner = math.prod(src.shape[dim + 1 :]) * itemsize
        stride = src.shape[dim] * inner
        length = stride // self.slice.parts
        return src.offset + self.slice.index * length, math.prod(src.shape[:dim]), stride, length

    def describe(self) -> dict[str, Any]:
        """What identifies these bytes: the source file's digest, the place, the slice."""
        return {
            "name": self.source.name,
            "file": self.file_digest,
            "path": self.source.file,
            "offset": self.source.offset,
            "dtype": self.source.dtype,
            "shape": list(self.source.shape),
            "slice": None if self.slice is None else vars(self.slice),
        }


@dataclass(frozen=True)
class PlannedPayload:
    """The tensors of one payload blob, in write order, and the ranks that load it."""

    ranks: tuple[int, ...]
    tensors: tuple[PlannedTensor, ...]

    def describe(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "tensors": [t.describe() for t in self.tensors]}

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> PlannedPayload:
        """The payload a journal record describes (the inverse of describe)."""
        return cls(tuple(data["ranks"]), tuple(_tensor(t) for t in data["tensors"]))

    def manifest_entry(self, digest: str, size: int) -> dict[str, Any]:
        """How the manifest lists this payload once it is stored."""
        return {
            "digest": digest,
            "size": size,
            "ranks": list(self.ranks),
            "tensors": [
                {
                    "name": t.source.name,
                    "dtype": t.source.dtype,
                    "shape": list(t.shape),
                    "split": None if t.slice is None else vars(t.slice),
                }
                for t in self.tensors
            ],
        }


def _tensor(data: Mapping[str, Any]) -> PlannedTensor:
    shape = tuple(data["shape"])
    nbytes = DTYPE_SIZES[data["dtype"]] * math.prod(shape)
    source = SourceTensor(data["name"], data["path"], data["offset"], data["dtype"], shape, nbytes)
    cut = None if data["slice"] is None else Slice(**data["slice"])
    return PlannedTensor(source, data["file"], cut)


def natural_key(name: str) -> list[Any]:
    """Sort `layers.10` after `layers.9`: numbers compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_payloads(
    expected: Mapping[str, Expected],
    tensors: Mapping[str, SourceTensor],
    file_digests: Mapping[str, str],
    ranks: int,
    payload_bytes: int = PAYLOAD_BYTES,
) -> list[PlannedPayload]:
    """Shared payloads first, then each rank's, every group packed in layer order."""
    names = sorted((n for n in expected if n in tensors), key=natural_key)
    split = {n for n in names if ranks > 1 and expected[n].split_dim is not None}

    def planned(name: str, rank: int | None) -> PlannedTensor:
        cut = None if rank is None else Slice(expected[name].split_dim or 0, ranks, rank)
        return PlannedTensor(tensors[name], file_digests[tensors[name].file], cut)

    shared = [planned(n, None) for n in names if n not in split]
    payloads = _pack(tuple(range(ranks)), shared, payload_bytes)
    for rank in range(ranks):
        own = [planned(n, rank) for n in names if n in split]
        payloads += _pack((rank,), own, payload_bytes)
    return payloads


def _pack(
    ranks: tuple[int, ...], tensors: Iterable[PlannedTensor], limit: int
) -> list[PlannedPayload]:
    """Greedy packing in order; a tensor larger than the limit gets a payload of its own."""
    groups: list[list[PlannedTensor]] = []
    size = limit
    for tensor in tensors:
        nbytes = tensor.spec.nbytes
        if size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return [PlannedPayload(ranks, _in_write_order(group)) for group in groups]


def _in_write_order(group: list[PlannedTensor]) -> tuple[PlannedTensor, ...]:
    by_name = {t.source.name: t for t in group}
    return tuple(by_name[spec.name] for spec in layout_order(t.spec for t in group))
