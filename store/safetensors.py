"""The safetensors container, read with every field validated and written deterministically.

Layout: 8 bytes little-endian header length N, N bytes of JSON header (padded with spaces to
a multiple of 8), then the tensor bytes. The header maps tensor names to dtype, shape and
[start, end) offsets into the data section, plus an optional `__metadata__` of strings.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from flare.errors import IntegrityError

MAX_HEADER = 100 << 20
MANIFEST_KEY = "flare.manifest"
"""The one metadata key of a package index (store/package.py): here, so that telling an index
from another blob by its header needs no pydantic."""
"""Largest header accepted: safetensors' own limit, so a lying length cannot exhaust memory."""

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype, shape and byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Header:
    """A validated safetensors header."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_offset: int
    """Where the data section starts in the file."""


class FormatError(IntegrityError):
    """A safetensors file that does not follow the format."""


def expected_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """The byte length of a tensor of this dtype and shape."""
    return DTYPE_SIZES[dtype] * math.prod(shape)


def read_header(handle: BinaryIO, file_size: int, where: str) -> Header:
    """Read and validate the header of a safetensors file of `file_size` bytes."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise FormatError(f"{where} is truncated: no safetensors header", "rebuild or re-fetch it")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER, file_size - 8):
        raise FormatError(
            f"{where} claims a {length}-byte header in a {file_size}-byte file",
            "the file is truncated or not safetensors",
        )
    raw = handle.read(length)
    if len(raw) < length:
        raise FormatError(f"{where} is truncated inside its header", "rebuild or re-fetch it")
    try:
        parsed = strict_json(raw.decode("utf-8"))  # the format says UTF-8; json would guess
    except StrictJsonError as exc:
        raise FormatError(f"{where} has a header that is not strict JSON: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a huge number, deep nesting
        raise FormatError(f"{where} has a header that is not JSON: {exc}") from exc
    return parse_header(parsed, 8 + length, file_size, where)


class StrictJsonError(ValueError):
    """JSON that Python reads but other readers may read differently, or refuse: a key twice
    in one object (first or last value?), NaN or Infinity (not JSON numbers)."""


def strict_json(text: str) -> Any:
    """Parse JSON that has one meaning for every reader, so that a signed header or manifest
    cannot say one thing to flare and another to a reader that keeps the first of two keys."""
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_not_a_number)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    found = dict(pairs)
    if len(found) != len(pairs):
        counts = Counter(key for key, _ in pairs)
        twice = next(key for key, count in counts.items() if count > 1)
        raise StrictJsonError(f"key {twice!r} appears twice")
    return found


def _not_a_number(constant: str) -> object:
    raise StrictJsonError(f"{constant} is not a number")


def parse_header(parsed: object, data_offset: int, file_size: int, where: str) -> Header:
    """Validate a decoded header against the size of the file it came from."""
    if not isinstance(parsed, dict):
        raise FormatError(f"{where}: the header is not a JSON object")
    metadata = parsed.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{where}: __metadata__ must map strings to strings")
    tensors = {name: _entry(name, spec, where) for name, spec in parsed.items()}
    _check_layout(tensors.values(), file_size - data_offset, where)
    return Header(tensors=tensors, metadata=metadata, data_offset=data_offset)


def _entry(name: object, spec: object, where: str) -> TensorEntry:
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FormatError(f"{where}: bad tensor name {name!r}")
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise FormatError(f"{where}: tensor {name} needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise FormatError(f"{where}: tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise FormatError(f"{where}: tensor {name} has a bad shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise FormatError(f"{where}: tensor {name} has bad data_offsets {offsets!r}")
    entry = TensorEntry(name, dtype, tuple(shape), offsets[0], offsets[1])
    if entry.end < entry.start or entry.nbytes != expected_nbytes(dtype, shape):
        raise FormatError(
            f"{where}: tensor {name} is {dtype}{list(shape)} "
            f"but spans {entry.end - entry.start} bytes"
        )
    return entry


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(entries: Iterable[TensorEntry], data_size: int, where: str) -> None:
    """Tensors must tile the data section exactly: no overlap, no hole, nothing past the end."""
    position = 0
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start != position:
            what = "overlaps another" if entry.start < position else "leaves a gap before it"
            raise FormatError(f"{where}: tensor {entry.name} {what}")
        position = entry.end
    if position != data_size:
        raise FormatError(
            f"{where} holds {data_size} data bytes but its tensors cover {position}",
            "the file is truncated or padded",
        )


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name, dtype and shape (its bytes come separately, in order)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return expected_nbytes(self.dtype, self.shape)


def layout_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """Write order: widest dtype first (keeps every tensor aligned), then by name."""
    return sorted(specs, key=lambda s: (-DTYPE_SIZES[s.dtype], s.name))


def encode_header(ordered: Iterable[TensorSpec], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length and the JSON header for tensors written in the given order.

    Canonical: sorted keys, no whitespace, padded with spaces to a multiple of 8, so the same
    tensors and metadata always give the same bytes.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in ordered:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
