"""Writing a payload: a safetensors file streamed straight from the checkpoint's bytes.

The header is computed from the plan, then each tensor's bytes are read from the source file
(one range for a whole tensor or a dim-0 slice, one range per row for a later dim) into the
store's hashing writer. No tensor is ever materialised as an array.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

from flare.build.plan import PlannedPayload
from flare.store.errors import from_os_error
from flare.store.safetensors import encode_header


class PayloadReader(io.RawIOBase):
    """The bytes of one payload, read on demand: header, then each tensor's regions."""

    def __init__(self, payload: PlannedPayload, files: Mapping[str, Path]) -> None:
        super().__init__()
        self._stack = ExitStack()
        self._header = encode_header([t.spec for t in payload.tensors], {})
        self._pieces = [(None, 0, 1, len(self._header), len(self._header))]
        fds: dict[str, int] = {}
        for tensor in payload.tensors:
            name = tensor.source.file
            if name not in fds:
                fds[name] = self._open(files[name])
            self._pieces.append((fds[name], *tensor.regions()))
        self.size = sum(rows * length for _, _, rows, _, length in self._pieces)
        self._piece = 0
        self._done = 0
        """Bytes of the current piece already returned."""

    @staticmethod
    def planned_size(payload: PlannedPayload) -> int:
        """The payload's size in bytes, header included, without opening any file."""
        header = encode_header([t.spec for t in payload.tensors], {})
        return len(header) + sum(t.spec.nbytes for t in payload.tensors)

    def _open(self, path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise from_os_error(exc, "read", path) from exc
        self._stack.callback(os.close, fd)
        return fd

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and self._piece < len(self._pieces):
            filled += self._fill(view[filled:])
        return filled

    def _fill(self, view: memoryview) -> int:
        """Copy from the current piece into view; move to the next piece when it is done."""
        fd, offset, rows, stride, length = self._pieces[self._piece]
        row, column = divmod(self._done, length)
        take = min(len(view), length - column)
        if fd is None:
            view[:take] = self._header[column : column + take]
            got = take
        else:
            got = os.preadv(fd, [view[:take]], offset + row * stride + column)
            if got == 0:
                raise from_os_error(
                    OSError(5, "source file is shorter than its header says"),
                    "read",
                    f"tensor data at offset {offset}",
                )
        self._done += got
        if self._done == rows * length:
            self._piece, self._done = self._piece + 1, 0
        return got

    def close(self) -> None:
        self._stack.close()
        super().close()
