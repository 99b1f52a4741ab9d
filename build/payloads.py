"""Writing a payload: a safetensors file made of the checkpoint's bytes, never of arrays.

The header is computed from the plan; each tensor's bytes are runs of its source files (one
run for a whole tensor or a dim-0 slice, one per row for a later dim; a fused tensor is its
pieces' dim-0 runs one after another). The store copies those
runs file to file in the kernel (store/splice.py); peers and remote stores read them as one
stream instead. `PayloadWriter` is rank zero's side of it for one build: each payload taken
from the journal, written here, or journaled once another rank stored it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from flare.build.journal import Journal, inputs_digest
from flare.build.plan import PlannedPayload
from flare.errors import from_os_error
from flare.faults import crash_point
from flare.store.blobs import BlobStore, PutResult
from flare.store.digest import Digest
from flare.store.hashing import FileState, Progress, check_unchanged, parallel_map
from flare.store.safetensors import encode_header
from flare.store.splice import FileRuns, Piece, PiecesReader

T = TypeVar("T")
R = TypeVar("R")

PAYLOAD_WORKERS = 4
"""Payloads written at once by default: the kernel copies and the hashing of some overlap
the writeback of others (4 beat 2 on a 2-core host: docs/performance.md)."""


def planned_size(payload: PlannedPayload) -> int:
    """The payload's size in bytes, header included, without opening any file."""
    header = encode_header([t.spec for t in payload.tensors], {})
    return len(header) + sum(t.spec.nbytes for t in payload.tensors)


def payload_key(payload: PlannedPayload) -> Digest:
    """The journal key of one payload: what its bytes are made of (ranks share it)."""
    return inputs_digest("payload", payload.describe())


@contextmanager
def payload_pieces(
    payload: PlannedPayload, root: Path, states: Mapping[str, FileState]
) -> Iterator[list[Piece]]:
    """The payload as pieces: its header, then each tensor's runs of its (open) source file
    under `root`. Each opened source must be the file resolve hashed (`states`: the same
    inode, size and times), when opened and once read: else the manifest's source digests
    would lie, or a file swapped in since (a link out of the checkpoint) would be stored."""
    with ExitStack() as stack:
        fds: dict[str, int] = {}
        pieces: list[Piece] = [encode_header([t.spec for t in payload.tensors], {})]
        for piece in (piece for tensor in payload.tensors for piece in tensor.pieces):
            name = piece.source.file
            if name not in fds:
                fds[name] = _open(root / name)
                stack.callback(os.close, fds[name])
                _check_opened(root / name, fds[name], states[name])
            pieces.append(FileRuns(fds[name], *piece.regions()))
        yield pieces
        for name, fd in fds.items():
            _check_opened(root / name, fd, states[name])


@contextmanager
def payload_stream(
    payload: PlannedPayload, root: Path, states: Mapping[str, FileState]
) -> Iterator[PiecesReader]:
    """The payload's bytes as one stream (`.size` long): for another rank, or a peer's store."""
    with payload_pieces(payload, root, states) as pieces:
        yield PiecesReader(pieces)


def store_payload(
    store: BlobStore,
    payload: PlannedPayload,
    root: Path,
    states: Mapping[str, FileState],
    progress: Progress,
) -> PutResult:
    """Write the payload into the store as one blob (file to file where the store allows)."""
    with payload_pieces(payload, root, states) as pieces:
        return store.put_pieces(pieces, progress)


@dataclass(frozen=True)
class WrittenPayload:
    """A payload's manifest entry, and whether an earlier run had stored it already."""

    entry: dict[str, Any]
    reused: bool


class PayloadWriter:
    """Rank zero's payloads of one build, each journaled as it lands.

    A payload the journal records, whose blob is still stored, is taken as it is; any other
    is copied from the checkpoint under `root` (each file still the one resolve hashed:
    `states`), or, with peers, journaled once the rank owning it stored it. Every blob is
    named to `keep` (the build's lease) before it is relied on, so a concurrent gc keeps it.
    """

    def __init__(
        self,
        store: BlobStore,
        journal: Journal,
        root: Path,
        states: Mapping[str, FileState],
        progress: Progress,
        keep: Callable[[Digest], None],
        workers: int | None = None,
        reuse: bool = True,
    ) -> None:
        """`workers`: payloads written at once (None: PAYLOAD_WORKERS); `reuse`: take
        recorded payloads (a --check rebuild takes none)."""
        self.store, self.journal = store, journal
        self.root, self.states = root, states
        self.progress, self.keep = progress, keep
        self.workers, self.reuse = workers or PAYLOAD_WORKERS, reuse

    def write_all(
        self, plan: Sequence[PlannedPayload], sizes: Sequence[int]
    ) -> list[WrittenPayload]:
        """Every payload, recorded or written here, on the build's payload workers."""

        def one(item: tuple[PlannedPayload, int]) -> WrittenPayload:
            entry = self.recorded(*item)
            return WrittenPayload(entry or self.write(*item), entry is not None)

        return self.map(one, list(zip(plan, sizes, strict=True)))

    def map(self, action: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """`action` on each item, on the build's payload workers; the results in order."""
        return parallel_map(action, items, self.workers)

    def recorded(self, payload: PlannedPayload, size: int) -> dict[str, Any] | None:
        """The payload's entry from its journal record, if its blob is still stored."""
        record = self.journal.get("payload", payload_key(payload)) if self.reuse else None
        if record is None:
            return None
        self.keep(Digest.parse(record["digest"]))
        if not self.store.has(Digest.parse(record["digest"])):
            return None
        self.progress(size)
        return payload.manifest_entry(record["digest"], record["size"])

    def write(self, payload: PlannedPayload, size: int) -> dict[str, Any]:
        """One payload blob copied from the checkpoint into the store, then recorded."""
        result = store_payload(self.store, payload, self.root, self.states, self.progress)
        return self.record(payload, str(result.digest), result.size)

    def record(self, payload: PlannedPayload, digest: str, size: int) -> dict[str, Any]:
        """Journal a stored payload (it is kept from gc) and return its manifest entry."""
        self.keep(Digest.parse(digest))
        self.journal.put("payload", payload_key(payload), {"digest": digest, "size": size})
        crash_point("assemble:payload")
        return payload.manifest_entry(digest, size)

    def stream(self, payload: PlannedPayload) -> AbstractContextManager[PiecesReader]:
        """The payload's bytes from the checkpoint, for a peer that has no copy of it."""
        return payload_stream(payload, self.root, self.states)


def _check_opened(path: Path, fd: int, state: FileState) -> None:
    """The open file at `path` is still the one hashed, in the state it was hashed in."""
    check_unchanged(path, state, FileState.of(os.fstat(fd)))


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
