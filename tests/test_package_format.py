"""The package format: the index and its manifest, names and paths (safetensors headers:
test_safetensors_header.py). Every malformed input must be refused with a FlareError that
names the problem, never with another exception."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from blake3 import blake3
from safetensors import safe_open
from safetensors_files import WHERE, one_tensor, raw_file, read, refused

from flare.errors import FlareError, InvalidInputError
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
    FormatError,
    Header,
    TensorSpec,
    encode_header,
    layout_order,
)

INDEX = "package 1a2b3c4d"
DELETE = object()
"""A marker for `changed`: remove the field instead of setting it."""


# -- helpers ------------------------------------------------------------------------------------


def fake_digest(label: str) -> str:
    """A well-formed digest: the blake3 of the label's bytes."""
    return f"blake3:{blake3(label.encode()).hexdigest()}"


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


def fused_data() -> dict[str, Any]:
    """The manifest with its split MLP tensor a fused one (recipe v2): gate's rows, then up's."""
    data = changed(manifest_data(), ("payloads", 0, "tensors", 1, "name"), "layers.0.mlp.gu.weight")
    parts = [
        {"name": "layers.0.mlp.gate.weight", "rows": 32},
        {"name": "layers.0.mlp.up.weight", "rows": 32},
    ]
    recipe = {**data["recipe"], "version": 2, "fused": {"layers.0.mlp.gu.weight": parts}}
    return changed(data, ("recipe",), recipe)


def test_a_fused_map_is_read_with_its_parts_rows() -> None:
    manifest = decode_index(index_of(fused_data()), INDEX)
    assert manifest.recipe.fused is not None
    assert [p.rows for p in manifest.recipe.fused["layers.0.mlp.gu.weight"]] == [32, 32]
    assert decode_index(encode_index(manifest), INDEX) == manifest


FUSED = ("recipe", "fused", "layers.0.mlp.gu.weight")


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ((*FUSED, 0, "rows"), 30, "fused tensor layers.0.mlp.gu.weight has 64 rows, its parts 62"),
        ((*FUSED, 0, "rows"), 33, "fused tensor layers.0.mlp.gu.weight part layers.0.mlp.gate"),
        ((*FUSED, 1, "name"), "norm.weight", "norm.weight is both a fused tensor's part and "),
        ((*FUSED, 1, "name"), "layers.0.mlp.gate.weight", "gate.weight is both a fused tensor"),
        (("payloads", 0, "tensors", 1, "split", "dim"), 1, "gu.weight is not cut on dim 0"),
        (
            ("payloads", 0, "tensors", 1, "name"),
            "other",
            "fused tensor layers.0.mlp.gu.weight is in no",
        ),
        (FUSED, [{"name": "layers.0.mlp.up.weight", "rows": 64}], "fused.* lists 1 part, not 2"),
        ((*FUSED, 0, "rows"), 0, "manifest field recipe.fused.layers.0.mlp.gu.weight.0.rows"),
    ],
)
def test_a_fused_map_that_does_not_fit_the_payloads_is_refused(
    path: tuple[str | int, ...], value: Any, match: str
) -> None:
    refused_index(index_of(changed(fused_data(), path, value)), match)


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
