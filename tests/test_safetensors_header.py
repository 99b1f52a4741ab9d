"""Safetensors headers: files written by flare read by the reference `safetensors` library and
the other way round; every malformed header refused with a FormatError that names the
problem, never with another exception, a crash or an out-of-bounds read."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import struct
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from safetensors_files import WHERE, one_tensor, raw_file, read, refused

from flare.errors import FlareError
from flare.store.safetensors import (
    MAX_HEADER,
    FormatError,
    TensorSpec,
    encode_header,
    layout_order,
    read_header,
)

INDEX = "package 1a2b3c4d"
DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def sample_tensors() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes, including a 0-d and an empty one."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.randn(7, generator=gen),
        "positions": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "scale": torch.tensor(0.125, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(3, dtype=torch.uint8),
    }


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The little-endian bytes of a tensor, as safetensors stores them."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    """The TensorSpec that describes a torch tensor."""
    return TensorSpec(name, DTYPES[tensor.dtype], tuple(tensor.shape))


def write_with_flare(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors file written the way flare writes payloads."""
    ordered = layout_order(spec_of(name, t) for name, t in tensors.items())
    body = b"".join(tensor_bytes(tensors[spec.name]) for spec in ordered)
    return encode_header(ordered, metadata) + body


# -- round trips with the reference implementation -----------------------------------------------


def test_file_written_by_flare_loads_in_safetensors_with_identical_tensors(tmp_path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "payload.safetensors"
    path.write_bytes(write_with_flare(tensors, {"format": "pt", "rank": "0"}))

    loaded = safetensors.torch.load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    with safe_open(path, "pt") as handle:
        assert handle.metadata() == {"format": "pt", "rank": "0"}


def test_file_written_by_flare_reads_back_through_read_header() -> None:
    tensors = sample_tensors()
    data = write_with_flare(tensors, {"k": "v"})
    header = read(data)
    assert header.metadata == {"k": "v"}
    for name, tensor in tensors.items():
        entry = header.tensors[name]
        start, end = header.data_offset + entry.start, header.data_offset + entry.end
        assert data[start:end] == tensor_bytes(tensor), name
        assert entry.start % entry.itemsize == 0, f"{name} is not aligned"


def test_file_written_by_safetensors_is_read_with_its_offsets_and_shapes() -> None:
    tensors = sample_tensors()
    data = safetensors.torch.save(tensors, metadata={"source": "reference"})
    header = read(data)

    (length,) = struct.unpack("<Q", data[:8])
    reference = json.loads(data[8 : 8 + length])
    assert header.data_offset == 8 + length
    assert header.metadata == {"source": "reference"}
    assert header.tensors.keys() == tensors.keys()
    for name, tensor in tensors.items():
        entry = header.tensors[name]
        assert entry.dtype == DTYPES[tensor.dtype] and entry.shape == tuple(tensor.shape), name
        assert [entry.start, entry.end] == reference[name]["data_offsets"], name
        start = header.data_offset + entry.start
        assert data[start : header.data_offset + entry.end] == tensor_bytes(tensor), name


def test_encode_header_is_the_same_bytes_for_any_input_order() -> None:
    specs = [spec_of(name, t) for name, t in sample_tensors().items()][:5]
    metadata = {"b": "2", "a": "1"}
    encodings = {
        encode_header(layout_order(order), dict(reversed(metadata.items())))
        for order in itertools.permutations(specs)
    }
    assert encodings == {encode_header(layout_order(specs), metadata)}


@pytest.mark.parametrize("name", ["abcdefgh"[:n] for n in range(1, 9)])
def test_header_length_is_padded_to_a_multiple_of_8(name: str) -> None:
    encoded = encode_header([TensorSpec(name, "F32", (2,))], {})
    (length,) = struct.unpack("<Q", encoded[:8])
    assert length == len(encoded) - 8 and length % 8 == 0
    text = encoded[8:]
    assert text.rstrip(b" ") == text.rstrip() and json.loads(text)[name]["data_offsets"] == [0, 8]


def test_layout_order_puts_the_widest_dtype_first_then_names() -> None:
    specs = [TensorSpec("b", "U8", (3,)), TensorSpec("z", "I64", (1,)), TensorSpec("a", "U8", ())]
    specs += [TensorSpec("m", "BF16", (1,)), TensorSpec("c", "F32", (1,))]
    assert [s.name for s in layout_order(specs)] == ["z", "c", "m", "a", "b"]


# -- header validation ---------------------------------------------------------------------------


def two_tensors(first: tuple[int, int], second: tuple[int, int]) -> dict[str, Any]:
    """A header with two 4-byte F32 tensors `a` and `b` at the given offsets."""
    return {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": list(first)},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": list(second)},
    }


@pytest.mark.parametrize("data", [b"", b"\x08", b"\x08\x00\x00\x00\x00\x00\x00"])
def test_file_shorter_than_8_bytes_is_refused(data: bytes) -> None:
    refused(data, "truncated: no safetensors header")


def test_header_length_larger_than_the_file_is_refused() -> None:
    refused(raw_file(b"{}", length=4096), "claims a 4096-byte header in a 16-byte file")


class ReadSpy(io.BytesIO):
    """A file that records how many bytes each read asks for."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.requests: list[int] = []

    def read(self, size: int | None = -1) -> bytes:
        self.requests.append(-1 if size is None else size)
        return super().read(size)


@pytest.mark.parametrize("length", [MAX_HEADER + 1, 1 << 40, (1 << 64) - 1])
@pytest.mark.parametrize("claimed_size", [16, 1 << 50])
def test_huge_header_length_is_refused_before_reading_it(length: int, claimed_size: int) -> None:
    handle = ReadSpy(raw_file(b"{}", length=length))
    with pytest.raises(FormatError, match=f"claims a {length}-byte header"):
        read_header(handle, claimed_size, WHERE)
    assert handle.requests == [8]


def test_header_cut_short_by_the_handle_is_refused() -> None:
    data = raw_file(b'{"__metadata__":{"a":"b"}}')
    with pytest.raises(FormatError, match="truncated inside its header"):
        read_header(io.BytesIO(data[:20]), len(data), WHERE)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(b"{not json", id="syntax"),
        pytest.param(b'{"a":1', id="unterminated"),
        pytest.param(b'{"\xff\xfe":1}', id="bad-utf8"),
        pytest.param(b"\xef\xbb\xbf{}", id="utf8-bom"),
        pytest.param('{"__metadata__":{"a":"b"}}  '.encode("utf-16-le"), id="utf16"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply-nested"),
        pytest.param(b'{"t":{"dtype":"F32","shape":[' + b"9" * 5000 + b"]}}", id="huge-int"),
    ],
)
def test_header_that_is_not_json_is_refused(text: bytes) -> None:
    refused(raw_file(text), "header that is not JSON")


@pytest.mark.parametrize("text", [b"[]", b'"header"', b"42", b"null", b"true"])
def test_header_that_is_not_an_object_is_refused(text: bytes) -> None:
    refused(raw_file(text), "not a JSON object")


@pytest.mark.parametrize("dtype", ["F33", "f32", "", None, 4, ["F32"], {"F32": 1}])
def test_unknown_dtype_is_refused(dtype: Any) -> None:
    refused(raw_file(one_tensor(dtype=dtype), b"\0" * 8), "tensor t has unknown dtype")


@pytest.mark.parametrize("shape", [[-1], [True], [2.0], ["2"], [None], [[2]]])
def test_bad_shape_entries_are_refused(shape: list[Any]) -> None:
    refused(raw_file(one_tensor(shape=shape), b"\0" * 8), "tensor t has a bad shape")


@pytest.mark.parametrize("shape", ["2", 2, None, {"0": 2}])
def test_shape_that_is_not_a_list_is_refused(shape: Any) -> None:
    header = {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}
    refused(raw_file(header, b"\0" * 8), "tensor t has a bad shape")


@pytest.mark.parametrize("offsets", [[0], [0, 8, 8], [-8, 0], [0.0, 8], [False, 8], "0-8"])
def test_malformed_data_offsets_are_refused(offsets: Any) -> None:
    header = {"t": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}
    refused(raw_file(header, b"\0" * 8), "tensor t has bad data_offsets")


@pytest.mark.parametrize(
    ("dtype", "shape", "offsets"),
    [("F32", [2], [0, 4]), ("BF16", [2, 2], [0, 16]), ("I64", [], [0, 4]), ("F32", [0], [0, 4])],
)
def test_data_offsets_that_disagree_with_dtype_and_shape_are_refused(
    dtype: str, shape: list[int], offsets: list[int]
) -> None:
    data = b"\0" * offsets[1]
    refused(raw_file(one_tensor(dtype, shape, offsets), data), f"tensor t is {dtype}")


def test_offsets_that_end_before_they_start_are_refused() -> None:
    refused(raw_file(one_tensor("U8", [0], [8, 0]), b"\0" * 8), "tensor t is U8")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"dtype": "F32", "shape": [2]}, "needs exactly"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "extra": 1}, "needs exactly"),
        (["F32", [2], [0, 8]], "needs exactly"),
        ("F32", "needs exactly"),
    ],
)
def test_tensor_entry_with_wrong_fields_is_refused(spec: Any, match: str) -> None:
    refused(raw_file({"t": spec}, b"\0" * 8), f"tensor t {match}")


def test_overlapping_tensors_are_refused() -> None:
    refused(raw_file(two_tensors((0, 4), (2, 6)), b"\0" * 6), "tensor b overlaps another")


def test_tensors_sharing_bytes_are_refused() -> None:
    refused(raw_file(two_tensors((0, 4), (0, 4)), b"\0" * 4), "overlaps another")


def test_gap_between_tensors_is_refused() -> None:
    refused(raw_file(two_tensors((0, 4), (8, 12)), b"\0" * 12), "tensor b leaves a gap")


def test_gap_before_the_first_tensor_is_refused() -> None:
    refused(raw_file(one_tensor(offsets=(4, 12)), b"\0" * 12), "tensor t leaves a gap")


@pytest.mark.parametrize(("size", "covered"), [(9, 8), (16, 8), (7, 8), (0, 8)])
def test_data_section_longer_or_shorter_than_the_tensors_is_refused(
    size: int, covered: int
) -> None:
    data = raw_file(one_tensor(), b"\0" * size)
    refused(data, f"holds {size} data bytes but its tensors cover {covered}")


def test_every_truncation_of_a_valid_file_is_refused() -> None:
    data = write_with_flare(sample_tensors(), {"k": "v"})
    for cut in range(len(data)):
        with pytest.raises(FormatError):
            read(data[:cut])


@pytest.mark.parametrize(
    "metadata",
    [{"a": 1}, {"a": None}, {"a": ["b"]}, {"a": {"b": "c"}}, [], ["a"], "a", 0, False, True],
)
def test_metadata_that_is_not_strings_is_refused(metadata: Any) -> None:
    refused(raw_file({"__metadata__": metadata}), "__metadata__ must map strings to strings")


def test_null_or_empty_metadata_means_none() -> None:
    assert read(raw_file({"__metadata__": None})).metadata == {}
    assert read(raw_file({"__metadata__": {}})).metadata == {}


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_bad_tensor_name_is_refused(name: str) -> None:
    refused(raw_file({name: one_tensor()["t"]}, b"\0" * 8), "bad tensor name")


def test_zero_tensors_and_empty_tensors_are_accepted() -> None:
    assert read(raw_file({})).tensors == {}
    header = read(raw_file(one_tensor("F16", [0, 4], [0, 0])))
    assert header.tensors["t"].shape == (0, 4) and header.tensors["t"].nbytes == 0


def test_flipped_bits_in_a_payload_never_escape_as_other_errors() -> None:
    data = write_with_flare({"a": torch.ones(2), "b": torch.arange(3)}, {"k": "v"})
    for position, bit in itertools.product(range(len(data)), range(8)):
        flipped = bytearray(data)
        flipped[position] ^= 1 << bit
        with contextlib.suppress(FlareError):
            read(bytes(flipped))
