"""Writing a payload: a safetensors file made of the checkpoint's bytes, never of arrays.

The header is computed from the plan; each tensor's bytes are runs of the source file (one
run for a whole tensor or a dim-0 slice, one per row for a later dim). The store copies those
runs file to file in the kernel (store/splice.py); peers and remote stores read them as one
stream instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from flare.build.journal import inputs_digest
from flare.build.plan import PlannedPayload
from flare.errors import from_os_error
from flare.store.blobs import BlobStore, PutResult
from flare.store.digest import Digest
from flare.store.hashing import FileState, Progress, check_unchanged
from flare.store.safetensors import encode_header
from flare.store.splice import FileRuns, Piece, PiecesReader


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
    under `root`. Each source must still be the file resolve hashed (`states`), before the
    bytes are read and after: else the manifest's source digests would lie."""
    paths = {t.source.file: root / t.source.file for t in payload.tensors}
    _check_unchanged(paths, states)
    with ExitStack() as stack:
        fds: dict[str, int] = {}
        pieces: list[Piece] = [encode_header([t.spec for t in payload.tensors], {})]
        for tensor in payload.tensors:
            name = tensor.source.file
            if name not in fds:
                fds[name] = _open(paths[name])
                stack.callback(os.close, fds[name])
            pieces.append(FileRuns(fds[name], *tensor.regions()))
        yield pieces
    _check_unchanged(paths, states)


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


def _check_unchanged(paths: Mapping[str, Path], states: Mapping[str, FileState]) -> None:
    for name, path in paths.items():
        check_unchanged(path, states[name], FileState.of(path.stat()))


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise from_os_error(exc, "read", path) from exc
