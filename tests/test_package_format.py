"""The package format: safetensors headers, the index and its manifest, names and paths.

Files written by flare must be read by the reference `safetensors` library and the other way
round; every malformed input must be refused with a FlareError that names the problem, never
with another exception, a crash or an out-of-bounds read.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import struct
from typing import Any

import pytest
import safetensors.torch
import torch
from blake3 import blake3
from safetensors import safe_open

from flare.errors import FlareError, IntegrityError, InvalidInputError
from flare.store.package import (
    FORMAT_VERSION,
    MANIFEST_KEY,
    RUNTIME_ABI,
    Manifest,
    check_name,
    check_payload,
    check_relative_path,
    decode_index,
    encode_index,
    referenced_blobs,
)
from flare.store.safetensors import (
    MAX_HEADER,
    FormatError,
    Header,
    TensorSpec,
    encode_header,
    layout_order,
    read_header,
)

WHERE = "shard.safetensors"
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
DELETE = object()
"""A marker for `changed`: remove the field instead of setting it."""


# -- helpers ------------------------------------------------------------------------------------


def fake_digest(label: str) -> str:
    """A well-formed digest: the blake3 of the label's bytes."""
    return f"blake3:{blake3(label.encode()).hexdigest()}"


def raw_file(header: bytes | dict[str, Any], data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file from a header given as bytes or a dict, optionally lying about its
    header length."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def read(data: bytes) -> Header:
    """read_header over the whole of `data`."""
    return read_header(io.BytesIO(data), len(data), WHERE)


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


def refused(data: bytes, match: str) -> FormatError:
    """read_header must refuse the file with a FormatError naming it and the problem."""
    with pytest.raises(FormatError, match=match) as info:
        read(data)
    assert isinstance(info.value, IntegrityError) and WHERE in str(info.value)
    return info.value


def manifest_data() -> dict[str, Any]:
    """A valid two-rank manifest in its JSON form."""
    payload = {
        "digest": fake_digest("payload-0"),
        "size": 4096,
        "ranks": [0],
        "tensors": [
            {"name": "embed.weight", "dtype": "BF16", "shape": [64, 16]},
            {
                "name": "layers.0.mlp.up.weight",
                "dtype": "BF16",
                "shape": [32, 16],
                "split": {"dim": 0, "parts": 2, "index": 0},
            },
        ],
    }
    shared = {
        "digest": fake_digest("payload-shared"),
        "size": 128,
        "ranks": [0, 1],
        "tensors": [{"name": "norm.weight", "dtype": "F32", "shape": [16]}],
    }
    return {
        "format": FORMAT_VERSION,
        "name": "tiny-llama",
        "model": {
            "id": "org/tiny-llama",
            "revision": "0123abcd",
            "files": [{"path": "model.safetensors", "digest": fake_digest("src"), "size": 9000}],
        },
        "recipe": {"name": "llama", "version": 1, "architecture": "LlamaForCausalLM"},
        "options": {"dtype": "bf16", "tp": 2},
        "ranks": 2,
        "toolchain": {"runtime_abi": RUNTIME_ABI, "torch": "2.5.1", "gpu_archs": ["sm_90"]},
        "payloads": [payload, shared],
        "artifacts": [
            {
                "kind": "tokenizer",
                "path": "tokenizer/tokenizer.json",
                "digest": fake_digest("tok"),
                "size": 2048,
            }
        ],
        "inputs": fake_digest("inputs"),
    }


def changed(data: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """A copy of `data` with the field at `path` set to `value` (or removed, for DELETE)."""
    result = copy.deepcopy(data)
    parent = result
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return result


def make_manifest(**fields: Any) -> Manifest:
    """A valid Manifest, with top-level fields replaced by `fields`."""
    return Manifest.model_validate_json(json.dumps({**manifest_data(), **fields}))


def index_of(manifest: dict[str, Any] | str) -> bytes:
    """An index file whose manifest is this JSON value or raw text (valid or not)."""
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    return encode_header([], {MANIFEST_KEY: text})


def refused_index(data: bytes, match: str) -> FormatError:
    """decode_index must refuse the index with a FormatError naming it and the problem."""
    with pytest.raises(FormatError, match=match) as info:
        decode_index(data, INDEX)
    assert INDEX in str(info.value)
    return info.value


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


def one_tensor(dtype: Any = "F32", shape: Any = (2,), offsets: Any = (0, 8)) -> dict[str, Any]:
    """A header with one tensor `t`, its fields as given."""
    return {"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


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


# -- the index and its manifest ------------------------------------------------------------------


def test_index_round_trips_to_an_equal_manifest() -> None:
    manifest = make_manifest()
    data = encode_index(manifest)
    decoded = decode_index(data, INDEX)
    assert decoded == manifest
    assert encode_index(decoded) == data


def test_index_is_canonical_and_readable_by_safetensors(tmp_path) -> None:
    data = encode_index(make_manifest())
    assert data == encode_index(make_manifest())
    path = tmp_path / "index.safetensors"
    path.write_bytes(data)
    with safe_open(path, "pt") as handle:
        assert list(handle.keys()) == []
        text = handle.metadata()[MANIFEST_KEY]
    assert json.loads(text) == make_manifest().model_dump(mode="json", exclude_unset=True)
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_manifest_lists_each_blob_once_and_sums_sizes() -> None:
    manifest = make_manifest()
    assert len(manifest.blobs()) == 3
    assert manifest.total_size() == 4096 + 128 + 2048


def test_index_holding_tensors_is_refused() -> None:
    text = json.dumps(manifest_data())
    data = encode_header([TensorSpec("x", "U8", (1,))], {MANIFEST_KEY: text}) + b"\0"
    refused_index(data, "not a flare package index")


@pytest.mark.parametrize(
    "metadata",
    [{}, {"other": "{}"}, {MANIFEST_KEY: json.dumps(manifest_data()), "extra": "x"}],
    ids=["none", "other-key", "extra-key"],
)
def test_index_without_exactly_the_manifest_key_is_refused(metadata: dict[str, str]) -> None:
    refused_index(encode_header([], metadata), "not a flare package index")


@pytest.mark.parametrize(
    "text",
    ["", "{", "{'format': 1}", "[" * 100_000, '{"format":' + "1" * 5000 + "}"],
    ids=["empty", "open-brace", "single-quotes", "deeply-nested", "huge-int"],
)
def test_manifest_that_is_not_json_is_refused(text: str) -> None:
    refused_index(index_of(text), "the manifest is not JSON")


@pytest.mark.parametrize("manifest", [[], "x", 1, None, {}, {"format": "1"}, {"format": 1.0}])
def test_manifest_without_a_format_version_is_refused(manifest: Any) -> None:
    refused_index(index_of(json.dumps(manifest)), "no format version")


def test_newer_format_version_asks_to_upgrade_flare() -> None:
    error = refused_index(index_of({**manifest_data(), "format": FORMAT_VERSION + 1}), "format")
    assert "upgrade flare" in str(error)


@pytest.mark.parametrize("version", [0, -1])
def test_older_or_negative_format_version_is_refused(version: int) -> None:
    refused_index(index_of({**manifest_data(), "format": version}), "unknown package format")


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("surprise",), 1, "surprise"),
        (("model", "licence"), "mit", "model.licence"),
        (("payloads", 0, "tensors", 0, "offset"), 0, "payloads.0.tensors.0.offset"),
        (("toolchain", "rocm"), "6.0", "toolchain.rocm"),
    ],
)
def test_unknown_fields_are_refused(path: tuple[str | int, ...], value: Any, match: str) -> None:
    refused_index(index_of(changed(manifest_data(), path, value)), f"manifest field {match}")


@pytest.mark.parametrize(
    "path", [("name",), ("model",), ("model", "files", 0, "digest"), ("payloads", 0, "ranks")]
)
def test_missing_fields_are_refused(path: tuple[str | int, ...]) -> None:
    field = ".".join(str(part) for part in path)
    refused_index(index_of(changed(manifest_data(), path, DELETE)), f"manifest field {field}")


BAD_DIGESTS = [
    pytest.param("blake3:zz", id="short"),
    pytest.param("blake3:" + "g" * 64, id="not-hex"),
    pytest.param("blake3:" + "a" * 63, id="63-digits"),
    pytest.param("blake3:blake3:" + "a" * 64, id="double-prefix"),
    pytest.param("sha256:" + "a" * 64, id="sha256"),
    pytest.param("a" * 64, id="no-prefix"),
    pytest.param("", id="empty"),
    pytest.param("blake3:" + "A" * 64, id="upper-case"),
    pytest.param("blake3:" + "a" * 64 + " ", id="trailing-space"),
    pytest.param("blake3:" + "a" * 64 + "\n", id="trailing-newline"),
]


@pytest.mark.parametrize("digest", BAD_DIGESTS)
@pytest.mark.parametrize(
    "path", [("inputs",), ("payloads", 1, "digest"), ("artifacts", 0, "digest")]
)
def test_bad_digest_strings_are_refused(digest: str, path: tuple[str | int, ...]) -> None:
    field = ".".join(str(part) for part in path)
    refused_index(index_of(changed(manifest_data(), path, digest)), f"manifest field {field}")


UNSAFE_PATHS = ["../x", "/etc/passwd", "a//b", "a\\b", "./a", "", "a/../b", "a/.", "a/", "a\x00b"]


@pytest.mark.parametrize("path", UNSAFE_PATHS)
@pytest.mark.parametrize("field", [("artifacts", 0, "path"), ("model", "files", 0, "path")])
def test_paths_that_could_escape_are_refused(path: str, field: tuple[str | int, ...]) -> None:
    error = refused_index(index_of(changed(manifest_data(), field, path)), "unsafe path")
    assert ".".join(str(part) for part in field) in str(error)


@pytest.mark.parametrize("path", UNSAFE_PATHS)
def test_check_relative_path_refuses_unsafe_paths(path: str) -> None:
    with pytest.raises(ValueError, match="unsafe path"):
        check_relative_path(path)


@pytest.mark.parametrize("path", ["a", "tokenizer/tokenizer.json", "a.b/c..d/.hidden", "x-y_z"])
def test_check_relative_path_accepts_plain_relative_paths(path: str) -> None:
    assert check_relative_path(path) == path


@pytest.mark.parametrize("ranks", [[2], [0, 2], [7]])
def test_payload_naming_a_rank_beyond_the_package_is_refused(ranks: list[int]) -> None:
    data = index_of(changed(manifest_data(), ("payloads", 1, "ranks"), ranks))
    refused_index(data, f"payload {fake_digest('payload-shared')} names a rank >= 2")


@pytest.mark.parametrize("ranks", [[0, 0], [1, 0, 1]])
def test_payload_naming_a_rank_twice_is_refused(ranks: list[int]) -> None:
    data = index_of(changed(manifest_data(), ("payloads", 1, "ranks"), ranks))
    refused_index(data, f"payload {fake_digest('payload-shared')} names a rank twice")


@pytest.mark.parametrize("index", [2, 3])
def test_split_part_beyond_its_parts_is_refused(index: int) -> None:
    path = ("payloads", 0, "tensors", 1, "split", "index")
    data = index_of(changed(manifest_data(), path, index))
    refused_index(data, f"manifest field payloads.0.tensors.1.split: .*index {index} is not one of")


# -- one meaning for every reader: no repeated keys, no NaN --------------------------------------


def repeated_key(text: str, key: str, value: str) -> str:
    """JSON text whose top-level object holds `key` a second time, with `value` last."""
    assert text.endswith("}")
    return f"{text[:-1]},{json.dumps(key)}:{value}}}"


def test_a_manifest_repeating_a_key_is_refused() -> None:
    """A first-key and a last-key reader would load two different packages from one signed
    index: the reader refuses it rather than pick one."""
    text = repeated_key(json.dumps(manifest_data()), "name", '"other"')
    refused_index(index_of(text), "the manifest is not strict JSON: key 'name' appears twice")


def test_a_manifest_repeating_a_key_deep_inside_is_refused() -> None:
    data = manifest_data()
    tensor = json.dumps(data["payloads"][0]["tensors"][0])
    text = json.dumps(data).replace(tensor, repeated_key(tensor, "dtype", '"F32"'), 1)
    refused_index(index_of(text), "key 'dtype' appears twice")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_a_manifest_are_refused(constant: str) -> None:
    text = json.dumps(changed(manifest_data(), ("options", "x"), 0)).replace(
        '"x": 0', f'"x": {constant}'
    )
    assert constant in text
    refused_index(index_of(text), f"the manifest is not strict JSON: {constant} is not a number")


def test_a_safetensors_header_repeating_a_key_is_refused() -> None:
    """The index's own header: two `flare.manifest` values, one per kind of reader."""
    manifest = json.dumps(manifest_data())
    metadata = repeated_key(json.dumps({MANIFEST_KEY: manifest}), MANIFEST_KEY, '"{}"')
    refused(raw_file(f'{{"__metadata__":{metadata}}}'.encode()), "flare.manifest' appears twice")


def test_a_payload_header_repeating_a_tensor_is_refused() -> None:
    header = repeated_key(json.dumps(one_tensor()), "t", json.dumps(one_tensor()["t"]))
    refused(raw_file(header.encode(), b"\0" * 8), "key 't' appears twice")


@pytest.mark.parametrize(
    "path",
    [
        ("payloads", 0, "size"),
        ("artifacts", 0, "size"),
        ("model", "files", 0, "size"),
        ("payloads", 0, "ranks", 0),
        ("payloads", 0, "tensors", 0, "shape", 0),
        ("payloads", 0, "tensors", 1, "split", "index"),
    ],
)
def test_negative_counts_are_refused(path: tuple[str | int, ...]) -> None:
    field = ".".join(str(part) for part in path)
    data = index_of(changed(manifest_data(), path, -1))
    refused_index(data, f"manifest field {field}: Input should be greater than or equal to 0")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("ranks",), 0),
        (("ranks",), "2"),
        (("ranks",), True),
        (("payloads", 0, "size"), 1.5),
        (("payloads", 0, "ranks"), []),
        (("payloads", 0, "tensors"), []),
        (("payloads", 0, "tensors", 0, "dtype"), "F33"),
        (("payloads", 0, "tensors", 0, "name"), ""),
        (("payloads", 0, "tensors", 1, "split", "parts"), 1),
        (("recipe", "version"), 0),
        (("toolchain", "runtime_abi"), 0),
        (("model", "id"), ""),
        (("options",), []),
    ],
)
def test_values_of_the_wrong_type_or_range_are_refused(
    path: tuple[str | int, ...], value: Any
) -> None:
    field = ".".join(str(part) for part in path)
    refused_index(index_of(changed(manifest_data(), path, value)), f"manifest field {field}")


def test_flipped_bits_in_an_index_raise_flare_errors_or_decode() -> None:
    """The "never a crash" property: every single-bit flip anywhere in a valid index either is
    refused with a FlareError or (in padding or a harmless spot) still decodes."""
    data = encode_index(make_manifest())
    outcomes = {"refused": 0, "decoded": 0}
    for position, bit in itertools.product(range(len(data)), range(8)):
        flipped = bytearray(data)
        flipped[position] ^= 1 << bit
        try:
            assert isinstance(decode_index(bytes(flipped), INDEX), Manifest)
            outcomes["decoded"] += 1
        except FlareError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > outcomes["decoded"]


def test_every_truncation_of_an_index_is_refused() -> None:
    data = encode_index(make_manifest())
    for cut in range(len(data)):
        with pytest.raises(FormatError):
            decode_index(data[:cut], INDEX)


# -- check_payload --------------------------------------------------------------------------------


def payload_header(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Header:
    """The parsed header of a payload file holding tensors of these dtypes and shapes."""
    specs = layout_order(TensorSpec(name, *spec) for name, spec in tensors.items())
    return read(encode_header(specs, {}) + b"\0" * sum(s.nbytes for s in specs))


MANIFEST_TENSORS = {
    "embed.weight": ("BF16", (64, 16)),
    "layers.0.mlp.up.weight": ("BF16", (32, 16)),
}


def test_payload_matching_its_manifest_entry_is_accepted() -> None:
    check_payload(payload_header(MANIFEST_TENSORS), make_manifest().payloads[0], WHERE)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"embed.weight": ("BF16", (64, 16))}, r"missing \['layers.0.mlp.up.weight'\]"),
        ({**MANIFEST_TENSORS, "lm_head.weight": ("BF16", (4,))}, r"extra \['lm_head.weight'\]"),
        ({**MANIFEST_TENSORS, "embed.weight": ("F16", (64, 16))}, "tensor embed.weight is F16"),
        ({**MANIFEST_TENSORS, "embed.weight": ("BF16", (16, 64))}, r"is BF16\[16, 64\]"),
        ({**MANIFEST_TENSORS, "embed.weight": ("BF16", (64, 16, 1))}, "embed.weight is BF16"),
    ],
    ids=["missing", "extra", "dtype", "shape", "rank"],
)
def test_payload_differing_from_its_manifest_entry_is_refused(
    tensors: dict[str, tuple[str, tuple[int, ...]]], match: str
) -> None:
    with pytest.raises(FormatError, match=match) as info:
        check_payload(payload_header(tensors), make_manifest().payloads[0], WHERE)
    assert WHERE in str(info.value)


def test_payload_mismatch_message_says_what_the_manifest_expects() -> None:
    header = payload_header({**MANIFEST_TENSORS, "embed.weight": ("F32", (64, 16))})
    with pytest.raises(FormatError, match=r"the manifest says BF16\[64, 16\]"):
        check_payload(header, make_manifest().payloads[0], WHERE)


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "qwen3.0_6b", "a", "7b", "x" * 128])
def test_check_name_accepts_lowercase_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name", ["Tiny-Llama", "tiny llama", "", "../x", "x" * 129, "-x", ".x", "a/b", "tiny\n"]
)
def test_check_name_refuses_bad_names(name: str) -> None:
    with pytest.raises(InvalidInputError, match="bad package name") as info:
        check_name(name)
    assert "lowercase" in str(info.value)


def test_referenced_blobs_are_the_manifests_blobs() -> None:
    data = manifest_data()
    expected = {d.hex for d in make_manifest().blobs()}
    assert referenced_blobs(index_of(data), "index") == expected


def test_referenced_blobs_of_a_malformed_index_fall_back_to_the_validating_reader() -> None:
    bad = changed(manifest_data(), ("payloads", 0, "digest"), "blake3:" + "Z" * 64)
    with pytest.raises(FormatError, match=r"payloads\.0\.digest"):
        referenced_blobs(index_of(bad), "index")
    newer = changed(manifest_data(), ("format",), FORMAT_VERSION + 1)
    with pytest.raises(FormatError, match="upgrade flare"):
        referenced_blobs(index_of(newer), "index")
