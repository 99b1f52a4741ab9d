"""The shard phase's plan: which tensor slices go into which payload, for which ranks.

Replicated tensors go into payloads shared by every rank (one blob, not N copies); split
tensors go into per-rank payloads. A fused tensor (the recipe's layout: q, k, v as one
qkv_proj) is several checkpoint tensors' bytes one after another, never an array. A rank's
payloads depend only on the checkpoint, the recipe, the options and the rank, so ranks can be
built apart and still agree bit for bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flare.build.checkpoint import SourceTensor
from flare.build.recipes.base import Expected
from flare.store.safetensors import DTYPE_SIZES, FormatError, TensorSpec, layout_order

PAYLOAD_BYTES = 256 << 20
"""Target payload size: small enough to resume and hash in parallel, large enough to be few."""


@dataclass(frozen=True)
class Slice:
    """Part `index` of `parts` along `dim` (None when the tensor is whole)."""

    dim: int
    parts: int
    index: int


@dataclass(frozen=True)
class SourcePiece:
    """One checkpoint tensor (or one rank's slice of it) and where its bytes are."""

    source: SourceTensor
    file_digest: str
    slice: Slice | None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.source.shape)
        if self.slice is not None:
            shape[self.slice.dim] //= self.slice.parts
        return tuple(shape)

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
class PlannedTensor:
    """One payload tensor: one source piece, or several (a fused tensor) whose dim-0 runs
    follow each other, so the payload stays a file-to-file copy of checkpoint bytes. Every
    piece is cut the same way (rank R's tensor is each source's part R, in order)."""

    name: str
    pieces: tuple[SourcePiece, ...]

    @classmethod
    def of(cls, name: str, pieces: tuple[SourcePiece, ...]) -> PlannedTensor:
        """The tensor, once its pieces can be one: same dtype, same dims after the first,
        the same cut, and a cut on dim 0 only when there are several."""
        first = pieces[0]
        for piece in pieces[1:]:
            if (piece.source.dtype, piece.shape[1:], piece.slice) != (
                first.source.dtype,
                first.shape[1:],
                first.slice,
            ) or (piece.slice is not None and piece.slice.dim != 0):
                raise FormatError(
                    f"cannot fuse {name}: {first.source.name} is "
                    f"{first.source.dtype}{list(first.source.shape)} but {piece.source.name} is "
                    f"{piece.source.dtype}{list(piece.source.shape)}",
                    "the parts of a fused tensor must share dtype and all dims but the first",
                )
        return cls(name, pieces)

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.pieces[0].shape
        return (sum(p.shape[0] for p in self.pieces), *first[1:])

    @property
    def dtype(self) -> str:
        return self.pieces[0].source.dtype

    @property
    def slice(self) -> Slice | None:
        """The cut every piece shares: the manifest's `split` of this tensor."""
        return self.pieces[0].slice

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)

    def describe(self) -> dict[str, Any]:
        """What identifies the tensor's bytes: its name and each piece, in order."""
        return {"name": self.name, "pieces": [p.describe() for p in self.pieces]}


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
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "split": None if t.slice is None else vars(t.slice),
                }
                for t in self.tensors
            ],
        }


def _tensor(data: Mapping[str, Any]) -> PlannedTensor:
    return PlannedTensor(data["name"], tuple(_piece(p) for p in data["pieces"]))


def _piece(data: Mapping[str, Any]) -> SourcePiece:
    shape = tuple(data["shape"])
    nbytes = DTYPE_SIZES[data["dtype"]] * math.prod(shape)
    source = SourceTensor(data["name"], data["path"], data["offset"], data["dtype"], shape, nbytes)
    cut = None if data["slice"] is None else Slice(**data["slice"])
    return SourcePiece(source, data["file"], cut)


def natural_key(name: str) -> list[Any]:
    """Sort `layers.10` after `layers.9`: numbers compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def plan_payloads(
    expected: Mapping[str, Expected],
    tensors: Mapping[str, SourceTensor],
    file_digests: Mapping[str, str],
    ranks: int,
    payload_bytes: int = PAYLOAD_BYTES,
    fused: Mapping[str, tuple[str, ...]] | None = None,
) -> list[PlannedPayload]:
    """Shared payloads first, then each rank's, every group packed in layer order. `fused`
    names tensors made of several checkpoint tensors (the recipe's), which replace them."""
    sources = {n: (n,) for n in expected if n in tensors}
    for name, parts in (fused or {}).items():
        for part in parts:
            del sources[part]
        sources[name] = parts
    names = sorted(sources, key=natural_key)
    split = {n for n in names if ranks > 1 and expected[sources[n][0]].split_dim is not None}

    def piece(name: str, rank: int | None) -> SourcePiece:
        cut = None if rank is None else Slice(expected[name].split_dim or 0, ranks, rank)
        return SourcePiece(tensors[name], file_digests[tensors[name].file], cut)

    def planned(name: str, rank: int | None) -> PlannedTensor:
        return PlannedTensor.of(name, tuple(piece(part, rank) for part in sources[name]))

    shared = [planned(n, None) for n in names if n not in split]
    payloads = _pack(tuple(range(ranks)), shared, payload_bytes)
    for rank in range(ranks):
        own = [planned(n, rank) for n in names if n in split]
        payloads += _pack((rank,), own, payload_bytes)
    return payloads


def fused_layout(plan: Iterable[PlannedPayload]) -> dict[str, list[dict[str, Any]]]:
    """The manifest's `recipe.fused`: each fused tensor's checkpoint tensors in row order,
    with their whole dim 0 (a rank's part holds rows / ranks of each)."""
    return {
        tensor.name: [{"name": p.source.name, "rows": p.source.shape[0]} for p in tensor.pieces]
        for payload in plan
        for tensor in payload.tensors
        if len(tensor.pieces) > 1
    }


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
    by_name = {t.name: t for t in group}
    return tuple(by_name[spec.name] for spec in layout_order(t.spec for t in group))
