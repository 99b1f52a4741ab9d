"""One pass over a blob's bytes: copied to a sink and hashed on the way, the writes on a
thread of their own while the next chunk is read and hashed."""

from __future__ import annotations

import queue
import threading
from typing import BinaryIO

from flare.store.hashing import Progress, new_hasher

COPY_CHUNK = 16 << 20


def copy_hashing(
    source: BinaryIO, sink: BinaryIO, progress: Progress | None, limit: int | None = None
) -> tuple[str, int]:
    """Copy a stream to a sink, hashing it on the way: one pass over the bytes.

    A writer thread writes each chunk while the next is read and hashed (single-threaded:
    the other core is writing), so a durable put costs about what `cp` and `sync` do. With a
    limit, copies at most that many bytes and reads one more to tell whether the source held
    more: a growing file never keeps the copy going.
    """
    hasher = new_hasher(1)
    if limit is not None and limit <= COPY_CHUNK:
        data = source.read(limit) or b""
        hasher.update(data)
        sink.write(data)
        if progress and data:
            progress(len(data))
        extra = len(source.read(1) or b"") if len(data) == limit else 0
        return hasher.hexdigest(), len(data) + extra
    with _ChunkWriter(sink) as writer:
        total = 0
        while limit is None or total < limit:
            chunk = writer.free_buffer()
            want = COPY_CHUNK if limit is None else min(COPY_CHUNK, limit - total)
            read = source.readinto(chunk[:want])  # type: ignore[attr-defined]
            if not read:
                writer.give_back(chunk)
                break
            hasher.update(chunk[:read])
            writer.write(chunk, read)
            total += read
            if progress:
                progress(read)
    if limit is not None and total == limit and source.read(1):
        total += 1
    return hasher.hexdigest(), total


class _ChunkWriter:
    """Writes chunks on a thread of its own, from a small ring of reusable buffers."""

    DEPTH = 3

    def __init__(self, sink: BinaryIO) -> None:
        self._sink = sink
        self._free: queue.Queue[memoryview] = queue.Queue()
        self._allocated = 0
        self._full: queue.Queue[tuple[memoryview, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="blob-writer", daemon=True)

    def __enter__(self) -> _ChunkWriter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._full.put(None)
        self._thread.join()
        if self._error is not None and exc_info[0] is None:
            raise self._error

    def free_buffer(self) -> memoryview:
        """A buffer to read into; raises the writer's error as soon as there is one."""
        if self._free.empty() and self._allocated < self.DEPTH:
            self._allocated += 1
            return memoryview(bytearray(COPY_CHUNK))
        buffer = self._free.get()
        if self._error is not None:
            raise self._error
        return buffer

    def give_back(self, buffer: memoryview) -> None:
        self._free.put(buffer)

    def write(self, buffer: memoryview, length: int) -> None:
        self._full.put((buffer, length))

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            buffer, length = item
            if self._error is None:
                try:
                    self._sink.write(buffer[:length])
                except BaseException as exc:  # handed to the reading thread
                    self._error = exc
            self._free.put(buffer)


def hash_stream(source: BinaryIO, progress: Progress | None) -> str:
    """The hex digest of what the stream holds, read once and kept nowhere."""
    hex_digest, _ = copy_hashing(source, _NullSink(), progress)  # type: ignore[arg-type]
    return hex_digest


class _NullSink:
    """A sink that discards what it is given: hashing without keeping the bytes."""

    def write(self, data: bytes | memoryview) -> int:
        return len(data)
