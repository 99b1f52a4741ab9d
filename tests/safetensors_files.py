"""Safetensors files for the format tests: written by hand, read by flare's reader."""

from __future__ import annotations

import io
import json
import struct
from typing import Any

import pytest

from flare.errors import IntegrityError
from flare.store.safetensors import FormatError, Header, read_header

WHERE = "shard.safetensors"


def raw_file(header: bytes | dict[str, Any], data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file from a header given as bytes or a dict, optionally lying about its
    header length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def read(data: bytes) -> Header:
    """read_header over the whole of `data`."""
    return read_header(io.BytesIO(data), len(data), WHERE)


def refused(data: bytes, match: str) -> FormatError:
    """read_header must refuse the file with a FormatError naming it and the problem."""
    with pytest.raises(FormatError, match=match) as info:
        read(data)
    assert isinstance(info.value, IntegrityError) and WHERE in str(info.value)
    return info.value


def one_tensor(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> dict[str, Any]:
    """A header with one tensor `t`, its fields as given."""
    return {"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}
