"""The package index: a safetensors file with no tensors whose metadata holds the manifest.

The manifest is canonical JSON (sorted keys, no whitespace, no timestamps, host names or
absolute paths), so the same build inputs always give the same index bytes and therefore the
same package digest. Everything read is validated before it is used.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from flare import __version__
from flare.errors import InvalidInputError
from flare.store.digest import Digest
from flare.store.names import check_name
from flare.store.safetensors import (
    DTYPE_SIZES,
    MANIFEST_KEY,
    FormatError,
    Header,
    StrictJsonError,
    encode_header,
    expected_nbytes,
    read_header,
    strict_json,
)

FORMAT_VERSION = 1
RUNTIME_ABI = 1
"""Bumped whenever the runtime's reading of payloads or artifacts changes incompatibly."""


def versions() -> dict[str, str | int]:
    """This flare's version, the package format it reads and writes and the runtime ABI it
    runs: what decides whether a package works here (`flare --version`, a server's /version
    and its flare_build_info metric say the same)."""
    return {"version": __version__, "package_format": FORMAT_VERSION, "runtime_abi": RUNTIME_ABI}


def version_line() -> str:
    """`flare --version`'s line."""
    return "flare {version} (package format {package_format}, runtime ABI {runtime_abi})".format(
        **versions()
    )


def check_relative_path(path: str) -> str:
    """A file name inside a package: relative, POSIX, and unable to escape its folder."""
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise ValueError(f"unsafe path {path!r}: must be relative, without '..' or empty parts")
    return path


_DIGEST_TEXT = re.compile(r"blake3:([0-9a-f]{64})")
"""A digest as a manifest writes it: one spelling only, lowercase, nothing around it."""


def _digest(value: str) -> str:
    if not _DIGEST_TEXT.fullmatch(value):
        raise ValueError(f"not a digest (blake3:<64 lowercase hex>): {value!r}")
    return value


def _name(value: str) -> str:
    try:
        return check_name(value)
    except InvalidInputError as exc:
        raise ValueError(str(exc)) from None


def _dtype(value: str) -> str:
    if value not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {value!r}")
    return value


DigestText = Annotated[str, AfterValidator(_digest)]
SafePath = Annotated[str, AfterValidator(check_relative_path)]
Count = Annotated[int, Field(ge=0)]


class Strict(BaseModel):
    """Every manifest object: unknown fields refused, immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class SourceFile(Strict):
    path: SafePath
    digest: DigestText
    size: Count


class Model(Strict):
    id: str = Field(min_length=1, max_length=256)
    revision: str | None
    files: tuple[SourceFile, ...]


class FusedPart(Strict):
    """One checkpoint tensor inside a fused payload tensor: its name and its whole dim 0."""

    name: str = Field(min_length=1)
    rows: Annotated[int, Field(ge=1)]


class Recipe(Strict):
    name: str
    version: Annotated[int, Field(ge=1)]
    architecture: str
    fused: dict[str, tuple[FusedPart, ...]] | None = None
    """Payload tensor → the checkpoint tensors it concatenates on dim 0, in order (llama v2's
    qkv_proj, gate_up_proj); rank R's part of it is each checkpoint tensor's part R in turn."""

    @model_validator(mode="after")
    def _fused_have_parts(self) -> Recipe:
        for name, parts in (self.fused or {}).items():
            if len(parts) < 2:
                raise ValueError(f"fused tensor {name} lists {len(parts)} part, not 2 or more")
        return self


class Toolchain(Strict):
    """What the package's compiled artifacts need of a host (flare/toolchain.py reads it);
    only the runtime ABI for a package that prepared nothing (target none)."""

    runtime_abi: Annotated[int, Field(ge=1)]
    torch: str | None = None
    cuda: str | None = None
    gpu_archs: tuple[str, ...] = ()
    flashinfer: str | None = None
    python: str | None = None
    triton: str | None = None
    cpu_isa: str | None = None
    """torch's CPU capability level on the build host: DEFAULT, AVX2, AVX512, ..."""
    cpu_features: tuple[str, ...] = ()
    """The x86 features the build host had that C++ kernels may use (toolchain.CPU_FEATURES)."""
    forward_code: str | None = None
    """Digest of flare's code the compiled forward was traced from (toolchain.FORWARD_SOURCES)."""


class Split(Strict):
    """How a tensor was cut for tensor parallelism: part `index` of `parts` along `dim`."""

    dim: Count
    parts: Annotated[int, Field(ge=2)]
    index: Count

    @model_validator(mode="after")
    def _index_is_a_part(self) -> Split:
        if self.index >= self.parts:
            raise ValueError(f"index {self.index} is not one of the {self.parts} parts (< parts)")
        return self


class PayloadTensor(Strict):
    name: str = Field(min_length=1)
    dtype: Annotated[str, AfterValidator(_dtype)]
    shape: tuple[Count, ...]
    split: Split | None = None


class Payload(Strict):
    """A blob that is itself a safetensors file, used by the listed ranks."""

    digest: DigestText
    size: Count
    ranks: tuple[Count, ...] = Field(min_length=1)
    tensors: tuple[PayloadTensor, ...] = Field(min_length=1)


class Artifact(Strict):
    """Another file of the package: tokenizer, chat template, config, tuning records, ...
    Those tune and compile prepared name the target they are for and what they cover."""

    kind: str
    path: SafePath
    digest: DigestText
    size: Count
    target: str | None = None
    shapes: dict[str, Any] | None = None


class Manifest(Strict):
    format: int
    name: Annotated[str, AfterValidator(_name)]
    model: Model
    recipe: Recipe
    options: dict[str, Any]
    ranks: Annotated[int, Field(ge=1)]
    toolchain: Toolchain
    payloads: tuple[Payload, ...]
    artifacts: tuple[Artifact, ...]
    inputs: DigestText
    """The digest of the build inputs: source file digests, recipe, options, format."""

    def blobs(self, ranks: Collection[int] | None = None) -> list[Digest]:
        """Every blob the package needs besides its index, each once; with `ranks`, those
        that a host serving these ranks reads (their payloads, the shared ones, artifacts)."""
        payloads = [p for p in self.payloads if ranks is None or set(p.ranks) & set(ranks)]
        digests = [p.digest for p in payloads] + [a.digest for a in self.artifacts]
        return [Digest.parse(d) for d in sorted(set(digests))]

    def total_size(self) -> int:
        return sum(p.size for p in self.payloads) + sum(a.size for a in self.artifacts)

    def payload_part(self, number: int) -> str:
        """How errors name the payload at this position: "payload 2 of 5"."""
        return f"payload {number + 1} of {len(self.payloads)}"

    def parts(self) -> list[Part]:
        """Every payload and artifact, named as errors name them, with the blob and size the
        manifest gives it (a blob named twice is two parts)."""
        payloads = [
            Part(self.payload_part(i), Digest.parse(p.digest), p.size)
            for i, p in enumerate(self.payloads)
        ]
        artifacts = [
            Part(f"artifact {a.path}", Digest.parse(a.digest), a.size) for a in self.artifacts
        ]
        return payloads + artifacts


@dataclass(frozen=True)
class Part:
    """One payload or artifact of a package: its name in errors, its blob, its claimed size."""

    name: str
    digest: Digest
    size: int


def canonical_json(data: Any) -> str:
    """Sorted keys, no insignificant whitespace: one text for one value."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def encode_index(manifest: Manifest) -> bytes:
    """The index file's bytes: a safetensors header with the manifest and no tensors.
    Fields the manifest does not set are left out, so a field added to the format later never
    changes the bytes of a package read back (keyless verification encodes it again)."""
    text = canonical_json(manifest.model_dump(mode="json", exclude_unset=True))
    return encode_header([], {MANIFEST_KEY: text})


def decode_index(data: bytes, where: str) -> Manifest:
    """Read and validate an index; refuse formats this flare does not know."""
    header = read_header(io.BytesIO(data), len(data), where)
    if header.tensors or set(header.metadata) != {MANIFEST_KEY}:
        raise FormatError(f"{where} is not a flare package index", "check the digest")
    text = header.metadata[MANIFEST_KEY]
    try:
        raw = strict_json(text)
    except StrictJsonError as exc:  # one signed index, one meaning: see strict_json
        raise FormatError(f"{where}: the manifest is not strict JSON: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # bad JSON, a huge number, deep nesting
        raise FormatError(f"{where}: the manifest is not JSON: {exc}") from exc
    _check_format(raw, where)
    try:
        manifest = Manifest.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(str(part) for part in first["loc"])
        raise FormatError(f"{where}: manifest field {location}: {first['msg']}") from exc
    _check_payload_ranks(manifest, where)
    _check_fused(manifest, where)
    return manifest


def referenced_blobs(data: bytes, where: str) -> set[str]:
    """The hex digest of every blob an index names, read without building the manifest model.

    gc marks every blob of every root; validating 100,000s of digests through pydantic costs
    far more than the sweep itself. Anything unexpected (another format, a malformed entry)
    falls back to the full, validating reader, which says what is wrong.
    """
    header = read_header(io.BytesIO(data), len(data), where)
    try:
        raw = strict_json(header.metadata[MANIFEST_KEY])
        if raw["format"] == FORMAT_VERSION:
            entries = raw["payloads"] + raw["artifacts"]
            return {_DIGEST_TEXT.fullmatch(entry["digest"])[1] for entry in entries}  # type: ignore[index]
    except (KeyError, TypeError, ValueError, RecursionError):
        pass
    return {digest.hex for digest in decode_index(data, where).blobs()}


def _check_format(raw: object, where: str) -> None:
    version = raw.get("format") if isinstance(raw, dict) else None
    if not isinstance(version, int):
        raise FormatError(f"{where}: the manifest has no format version")
    if version > FORMAT_VERSION:
        raise FormatError(
            f"{where} uses package format {version}; this flare reads format {FORMAT_VERSION}",
            "upgrade flare",
        )
    if version != FORMAT_VERSION:
        raise FormatError(f"{where} uses unknown package format {version}")


def _check_payload_ranks(manifest: Manifest, where: str) -> None:
    for payload in manifest.payloads:
        if any(rank >= manifest.ranks for rank in payload.ranks):
            raise FormatError(f"{where}: payload {payload.digest} names a rank >= {manifest.ranks}")
        if len(set(payload.ranks)) != len(payload.ranks):
            raise FormatError(f"{where}: payload {payload.digest} names a rank twice")


def _check_fused(manifest: Manifest, where: str) -> None:
    """Each fused tensor is in the payloads, its parts are not, and its rows are the parts'
    (each part split like the whole): a reader can find every part's rows from the map."""
    fused = manifest.recipe.fused or {}
    listed = [t for p in manifest.payloads for t in p.tensors]
    names = {t.name for t in listed}
    parts = [part.name for whole in fused.values() for part in whole]
    for name, whole in fused.items():
        held = [t for t in listed if t.name == name]
        if not held:
            raise FormatError(f"{where}: fused tensor {name} is in no payload", MALFORMED_HINT)
        for tensor in held:
            _check_fused_rows(name, whole, tensor, where)
    doubled = sorted({n for n in parts if parts.count(n) > 1 or n in names or n in fused})
    if doubled:
        raise FormatError(
            f"{where}: tensor {doubled[0]} is both a fused tensor's part and listed elsewhere",
            MALFORMED_HINT,
        )


def _check_fused_rows(
    name: str, parts: tuple[FusedPart, ...], tensor: PayloadTensor, where: str
) -> None:
    split = tensor.split
    cut = 1 if split is None else split.parts
    uneven = [part.name for part in parts if part.rows % cut]
    if (split is not None and split.dim != 0) or uneven or not tensor.shape:
        problem = f"part {uneven[0]} does not split in {cut}" if uneven else "is not cut on dim 0"
        raise FormatError(f"{where}: fused tensor {name} {problem}", MALFORMED_HINT)
    rows = sum(part.rows for part in parts)
    if tensor.shape[0] * cut != rows:
        raise FormatError(
            f"{where}: fused tensor {name} has {tensor.shape[0] * cut} rows, its parts {rows}",
            MALFORMED_HINT,
        )


MALFORMED_HINT = "the package is malformed: ask its publisher to rebuild it"


def check_size(part: Part, actual: int, where: str) -> None:
    """A part's blob must be as long as the manifest says: pull sizes disk and memory by it."""
    if actual != part.size:
        raise FormatError(
            f"{where}: {part.name} (blob {part.digest}) holds {actual} bytes, "
            f"the manifest says {part.size}",
            MALFORMED_HINT,
        )


def check_sizes(manifest: Manifest, sizes: Mapping[Digest, int], where: str) -> None:
    """Every part's claimed size against its blob's real one, and each payload's listed
    tensors against the bytes it holds: checked from sizes alone, before anything is copied.
    A part whose blob `sizes` leaves out (another rank's payload, which this host does not
    fetch) is not checked."""
    for part in manifest.parts():
        if part.digest in sizes:
            check_size(part, sizes[part.digest], where)
    for number, payload in enumerate(manifest.payloads):
        listed = sum(expected_nbytes(t.dtype, t.shape) for t in payload.tensors)
        if listed > payload.size:
            raise FormatError(
                f"{where}: the tensors the manifest lists for {manifest.payload_part(number)} "
                f"take {listed} bytes, the payload holds {payload.size}",
                MALFORMED_HINT,
            )


def check_payload(header: Header, payload: Payload, where: str) -> None:
    """A payload's safetensors header must hold exactly the tensors the manifest lists, each
    with the listed dtype and shape, at the byte range the listed order gives it."""
    listed = {t.name: t for t in payload.tensors}
    if set(header.tensors) != set(listed):
        missing = sorted(set(listed) - set(header.tensors))[:3]
        extra = sorted(set(header.tensors) - set(listed))[:3]
        raise FormatError(
            f"{where} does not match its manifest (missing {missing}, extra {extra})",
            MALFORMED_HINT,
        )
    start = 0
    for want in payload.tensors:
        entry = header.tensors[want.name]
        if entry.dtype != want.dtype or entry.shape != want.shape:
            raise FormatError(
                f"{where}: tensor {want.name} is {entry.dtype}{list(entry.shape)}, "
                f"the manifest says {want.dtype}{list(want.shape)}",
                MALFORMED_HINT,
            )
        if (entry.start, entry.end) != (start, start + entry.nbytes):
            raise FormatError(
                f"{where}: tensor {want.name} lies at bytes [{entry.start}, {entry.end}) of the "
                f"data, the manifest's order puts it at [{start}, {start + entry.nbytes})",
                MALFORMED_HINT,
            )
        start = entry.end
