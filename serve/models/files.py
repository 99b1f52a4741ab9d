"""A package's files as the runtime reads them: artifacts by path, weights by tensor name.

Nothing is trusted because it lies in the host cache: every blob is checked against the
manifest as it is read. A payload's safetensors header is compared with the manifest's entry
before any tensor is made from it. On the CPU the payload is memory-mapped, the tensors are
views of that map, and the map is hashed (BLAKE3 on all threads) while they are copied into
the model, so a load that returns serves exactly the bytes that were hashed and signed, at
little more than the cost of reading them. On a GPU the payload is read in large chunks
through pinned buffers into one device buffer, hashed as it passes (staging.py), and its
tensors are views of that buffer, made only once its digest matched. Artifacts are small:
each is read once, hashed, and kept. A blob that does not hash to its digest is handed to
`quarantine` (the host cache moves it aside, so the next pull fetches it again); a manifest
that disagrees with its own blobs is refused (exit 6)."""

from __future__ import annotations

import io
import json
import mmap
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from flare.errors import IntegrityError, InvalidInputError, NotFoundError, from_os_error
from flare.serve.background import in_background
from flare.serve.models.staging import Staging
from flare.store.digest import Digest
from flare.store.hashing import hash_bytes, hash_open_file
from flare.store.package import (
    MALFORMED_HINT,
    Manifest,
    Part,
    Payload,
    check_payload,
    check_size,
)
from flare.store.safetensors import FormatError, Header, TensorEntry, read_header

Quarantine = Callable[[Digest], str | None]
"""Moves a corrupt blob out of the host cache; returns where it went (None: it was intact)."""

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
    "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
    "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
}  # fmt: skip


@dataclass(frozen=True)
class WeightsRead:
    """What loading a rank's weights took: the payload bytes read, and the seconds from the
    first read to the last tensor copied into the model (the ready line's load rate)."""

    size: int
    seconds: float


def staging_for(device: torch.device) -> Staging | None:
    """How weights reach `device`, the one way per kind of device: a CPU takes the tensors
    straight from the payloads' memory maps (no copy before the model's own); a GPU reads
    each payload through pinned staging buffers into one device buffer (staging.py)."""
    return Staging(device) if device.type == "cuda" else None


class PackageFiles:
    """`files` maps each blob's digest text to a local file; `quarantine`, where the files
    are a host cache's blobs, moves a corrupt one aside."""

    def __init__(
        self,
        manifest: Manifest,
        files: Mapping[str, Path],
        quarantine: Quarantine | None = None,
    ) -> None:
        self.manifest = manifest
        self.files = files
        self.quarantine = quarantine
        self._parts = manifest.parts()
        self._artifacts: dict[str, bytes] | None = None
        self.weights_read: WeightsRead | None = None
        """Set once `tensors` has read every weight of a rank."""

    def artifact(self, path: str) -> bytes | None:
        """An artifact's checked bytes, or None if the package has none at that path. The
        first call reads and checks every artifact, before anything is built from one."""
        if self._artifacts is None:
            self._artifacts = self._read_artifacts()
        return self._artifacts.get(path)

    def text(self, path: str) -> str | None:
        """An artifact that must be UTF-8 text (a template, a tokenizer's JSON), or None."""
        data = self.artifact(path)
        if data is None:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.malformed(path, f"is not UTF-8 text (byte {exc.start})") from None

    def json(self, path: str, shape: type = dict) -> Any:
        """An artifact that must be JSON of this shape (dict: an object, list: a list)."""
        text = self.text(path)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:  # bad JSON, a huge number, deep nesting
            raise self.malformed(path, f"is not JSON ({exc})") from None
        if not isinstance(value, shape):
            raise self.malformed(path, f"is not a JSON {'object' if shape is dict else 'list'}")
        return value

    def require_json(self, path: str) -> dict[str, Any]:
        data = self.json(path)
        if data is None:
            raise NotFoundError(f"package {self.manifest.name} has no {path}", "rebuild it")
        return data

    def malformed(self, path: str, problem: str) -> FormatError:
        """The error for an artifact whose content the runtime cannot use (exit 6)."""
        return FormatError(
            f"artifact {path} of package {self.manifest.name} {problem}", MALFORMED_HINT
        )

    def tensors(
        self, rank: int = 0, staging: Staging | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight rank `rank` reads, by its Hugging Face name (a split tensor's part
        under the whole tensor's name), from the shared payloads and the rank's own, never
        another rank's; `staging_for(device)` says how. A payload's header is checked against
        the manifest before any of its tensors is made.

        Without `staging` (a CPU), the tensors are views of the payload's memory map, and the
        map is hashed on other threads while the caller copies them into the model: the hash
        must match before the next payload (or the end) is reached, so a load that returns
        has hashed every byte it copied. With `staging` (a GPU), the payload is read in large
        chunks onto its device, hashed as it is read, and its tensors are views of that one
        device buffer, made only once its digest matched. When the last weight is read,
        `weights_read` says how many bytes that took and how long, the caller's copies in."""
        started, read = time.perf_counter(), 0
        payloads = self.manifest.payloads
        for payload, part in zip(payloads, self._parts[: len(payloads)], strict=True):
            if rank not in payload.ranks:
                continue
            where = f"{part.name} of package {self.manifest.name}"
            _check_parts(payload, rank, self.manifest.ranks, where)
            if staging is None:
                yield from self._mapped(payload, part, where)
            else:
                yield from self._staged(payload, part, where, staging)
            read += part.size
        if staging is not None:
            staging.synchronize()
        self.weights_read = WeightsRead(read, time.perf_counter() - started)

    def _mapped(
        self, payload: Payload, part: Part, where: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A payload's tensors as views of its memory map, hashed while the caller reads."""
        mapped = _map(self._local(part))
        view = memoryview(mapped if mapped is not None else b"")
        hashed = in_background("payload-hash", hash_bytes, view)  # BLAKE3 lets go of the GIL
        try:
            check_size(part, len(view), where)
            header = read_header(_reader(mapped), len(view), where)
            check_payload(header, payload, where)
        except FormatError:  # a damaged blob, rather than a lying manifest, if it hashes wrong
            self._check_digest(hashed.result(), part)
            raise
        for entry in header.tensors.values():
            yield entry.name, _tensor(view, header, entry)
        self._check_digest(hashed.result(), part)

    def _staged(
        self, payload: Payload, part: Part, where: str, staging: Staging
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A payload's tensors as views of one buffer on the staging's device, made once the
        whole payload was read there and its digest matched the manifest's."""
        local = self._local(part)
        try:
            with open(local, "rb") as handle:
                header = self._checked_header(handle, payload, part, where)
                data, digest = staging.read(handle.fileno(), part.size)
        except OSError as exc:
            raise from_os_error(exc, "read", local) from exc
        except EOFError as exc:  # it shrank since its size was checked: not the blob hashed
            raise IntegrityError(
                f"{where} (blob {part.digest}) changed while it was read: {exc}",
                "stop whatever writes to the host cache, then serve again",
            ) from exc
        self._check_digest(digest, part)
        for entry in header.tensors.values():
            yield entry.name, _device_tensor(data, header, entry)

    def _checked_header(self, handle: BinaryIO, payload: Payload, part: Part, where: str) -> Header:
        """The open payload's header, checked against the manifest; where it is refused, the
        blob is hashed first, so that a damaged one is reported (and quarantined) as such."""
        size = os.fstat(handle.fileno()).st_size
        try:
            check_size(part, size, where)
            header = read_header(handle, size, where)
            check_payload(header, payload, where)
        except FormatError:
            self._check_digest(Digest(hash_open_file(handle.fileno(), size, None, None)), part)
            raise
        return header

    def _read_artifacts(self) -> dict[str, bytes]:
        paths = [a.path for a in self.manifest.artifacts]
        doubled = sorted({p for p in paths if paths.count(p) > 1})
        if doubled:
            raise FormatError(
                f"package {self.manifest.name} lists artifact {doubled[0]} twice", MALFORMED_HINT
            )
        parts = self._parts[len(self.manifest.payloads) :]
        return {path: self._read_artifact(part) for path, part in zip(paths, parts, strict=True)}

    def _read_artifact(self, part: Part) -> bytes:
        local = self._local(part)
        try:
            data = local.read_bytes()
        except OSError as exc:
            raise from_os_error(exc, "read", local) from exc
        self._check_digest(hash_bytes(data), part)
        check_size(part, len(data), f"package {self.manifest.name}")
        return data

    def _check_digest(self, actual: Digest, part: Part) -> None:
        """The bytes read must be the blob the manifest names."""
        if actual != part.digest:
            raise self._corrupt(part, actual)

    def _corrupt(self, part: Part, actual: Digest) -> IntegrityError:
        """The error for a blob that changed on this host, quarantined where it can be."""
        what = (
            f"{part.name} of package {self.manifest.name} (blob {part.digest}) is corrupt on this "
            f"host: its bytes hash to {actual.hex[:16]}"
        )
        moved = self.quarantine(part.digest) if self.quarantine is not None else None
        if moved is None:
            return IntegrityError(what, f"replace {self._local(part)} with a good copy")
        return IntegrityError(
            what,
            f"moved it to {moved}; the next flare serve or flare pull fetches it again "
            "from the registry",
        )

    def _local(self, part: Part) -> Path:
        local = self.files.get(str(part.digest))
        if local is None:
            raise NotFoundError(
                f"no local file for {part.name} ({part.digest})", "pull the package again"
            )
        return local


def _check_parts(payload: Payload, rank: int, ranks: int, where: str) -> None:
    """A payload a rank reads holds whole tensors or that rank's part of N: a manifest that
    hands rank R another rank's part (or cuts a tensor otherwise) would load wrong weights."""
    for tensor in payload.tensors:
        split = tensor.split
        if split is not None and (split.index != rank or split.parts != ranks):
            raise FormatError(
                f"{where} gives rank {rank} part {split.index} of {split.parts} of "
                f"{tensor.name} in a {ranks}-rank package",
                MALFORMED_HINT,
            )


def _map(path: Path) -> mmap.mmap | None:
    """The file's bytes, mapped copy-on-write (tensors need a writable buffer, and nothing
    they do reaches the file); None for an empty file, which cannot be mapped."""
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_size == 0:
                return None
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc


def _reader(mapped: mmap.mmap | None) -> BinaryIO:
    """The map as a file for the header reader, from its start."""
    if mapped is None:
        return io.BytesIO(b"")
    mapped.seek(0)
    return mapped  # type: ignore[return-value]


def _tensor(view: memoryview, header: Header, entry: TensorEntry) -> torch.Tensor:
    """A tensor over its bytes in the map (no copy: loading copies it into the model)."""
    dtype = TORCH_DTYPES[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    start = header.data_offset + entry.start
    flat = torch.frombuffer(view, dtype=dtype, count=entry.nbytes // entry.itemsize, offset=start)
    return flat.view(entry.shape)


def _device_tensor(data: torch.Tensor, header: Header, entry: TensorEntry) -> torch.Tensor:
    """A tensor over its bytes in the payload's device buffer: a view, where its offset suits
    its dtype (a flare-built payload puts every tensor so); a copy of its bytes otherwise."""
    start = header.data_offset + entry.start
    raw = data[start : start + entry.nbytes]
    if start % entry.itemsize:
        raw = raw.clone()
    return raw.view(TORCH_DTYPES[entry.dtype]).view(entry.shape)


def load_by_name(
    module: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    ignore: Callable[[str], bool] | None = None,
) -> None:
    """Copy tensors into same-named parameters (casting dtype, moving device); refuse a
    package that leaves a parameter unset, holds a tensor the model does not know, or one
    whose shape is not the one its config gives the parameter."""
    params = dict(module.named_parameters())
    missing = set(params)
    for name, tensor in tensors:
        if ignore is None or not ignore(name):
            _copy_into(params, name, tensor)
            missing.discard(name)
        del tensor  # a staged payload's device buffer goes with its last tensor, not later
    if missing:
        raise InvalidInputError(f"the package lacks tensors: {', '.join(sorted(missing)[:3])}")


def _copy_into(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    """One payload tensor into its parameter, or the error that says why it cannot go."""
    if name not in params:
        raise InvalidInputError(f"the package holds tensor {name}, unknown to this model")
    if params[name].shape != tensor.shape:
        raise FormatError(
            f"tensor {name} is {list(tensor.shape)} in the payload, the package's "
            f"config.json makes it {list(params[name].shape)}",
            MALFORMED_HINT,
        )
    with torch.no_grad():
        params[name].copy_(tensor)
