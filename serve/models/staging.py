"""Payloads read onto a GPU through a ring of pinned host buffers, hashed as they pass.

Copying a memory-mapped payload's tensors to a GPU one by one moves the weights through page
faults and pageable host-to-device copies (the driver stages each through a bounce buffer of
its own, a copy the host waits for), while the hash reads the map again from memory. `Staging`
reads a payload instead with large reads (`chunk` bytes each, READERS at a time on threads
of their own) into a small ring of pinned host buffers. Each chunk, once read, is copied
asynchronously on a side stream into one device buffer of the payload's size, and hashed on a
thread of its own (BLAKE3 on all cores, the GIL released) while the next chunk is read: the
reads, the hash and the copies overlap, so the payload arrives at about the speed the host
reads it. A buffer of the ring is read into again only once its copy (a CUDA event) and its
hash are done. Nothing of the payload is handed out before its digest is known, so the caller
compares it with the manifest before any tensor is made; the device's is the only full copy.

On a CPU device the same code runs with ordinary host buffers and synchronous copies: that is
how the tests drive it (a CPU serves from memory maps, with no copy: see PackageFiles.tensors).
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from flare.store.digest import Digest
from flare.store.hashing import new_hasher

CHUNK = 16 << 20
"""Bytes per read: large enough that a read's syscall, hash call, copy launch and event cost
nothing beside it; small enough that the ring (SLOTS chunks) stays small, and stays in the
CPU's last-level cache more than a larger one (reads into 32 MiB buffers ran at half the rate
of reads into 4 MiB ones on the 2-core VM: every byte the DMA and the hash find in the cache
is one DRAM does not move again). tests/bench/gpu_load.py --chunk-mb times other sizes."""

READERS = 4
"""Reads in flight at once, each on a thread of its own (a `preadv` releases the GIL). On one
H200 host, page cache warm, 16 MiB reads: alone (3.9 GB, tests/bench/gpu_load.py --readers)
one reader 5.1 GB/s, two 9.9, four 10.9, against `cat`'s 8.3; beside Python that holds the GIL
(2.0 GB, tests/bench/gpu_load_beside.py), as in a server's start, one 1.5 GB/s, two 2.0, four
2.6, slowing that Python alike (1.2-1.3x). A start served with four readers of 64 MiB, on
another host, was no faster than with two of 16 (docs/performance.md)."""

SLOTS = 6
"""Buffers in the ring: READERS being read into, the others' copies and hashes in flight."""

Pending = tuple[torch.cuda.Event | None, Future[object]]
"""What must finish before a ring buffer is read into again: its copy, its hash."""


class Staging:
    """A ring of `slots` host buffers of `chunk` bytes (pinned on a GPU), read into by
    `readers` threads, through which payloads reach `device`, and the side stream that
    copies them there."""

    def __init__(
        self,
        device: torch.device,
        chunk: int = CHUNK,
        slots: int = SLOTS,
        readers: int | None = None,
        hash_threads: int | None = None,
    ) -> None:
        """`readers`: READERS, or fewer where the ring is smaller (one buffer is always
        free to be copied and hashed from); `hash_threads`: the hash's threads (None: as
        many as useful; tests/bench/gpu_load_beside.py times fewer beside busy Python)."""
        readers = readers or min(READERS, slots - 1)
        if not 1 <= readers < slots:
            raise ValueError(f"{readers} readers need more than {readers} ring buffers")
        cuda = device.type == "cuda"
        self.device = device
        self.chunk = chunk
        self.readers = readers
        self.hash_threads = hash_threads
        self._ring = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(slots)]
        self._views = [memoryview(buffer.numpy()) for buffer in self._ring]
        self._stream = torch.cuda.Stream(device) if cuda else None

    def read(self, fd: int, size: int) -> tuple[torch.Tensor, Digest]:
        """The first `size` bytes of the open file `fd`, in one uint8 tensor on the device,
        and their digest. Chunks are read `readers` at a time, each copied and hashed in
        order once read; every copy is done when this returns (the host waited for each), so
        the tensor may be used on any stream; a file shorter than `size` raises EOFError."""
        target = torch.empty(size, dtype=torch.uint8, device=self.device)
        hasher = new_hasher(self.hash_threads)
        pending: list[Pending | None] = [None] * len(self._ring)
        reading: deque[tuple[int, int, Future[None]]] = deque()  # slot, length, its read
        if self._stream is not None:  # the target's memory may be freed work's on this stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with (
            ThreadPoolExecutor(1, thread_name_prefix="payload-hash") as hashing,
            ThreadPoolExecutor(self.readers, thread_name_prefix="payload-read") as reads,
        ):

            def land(offset: int) -> None:
                """The oldest read, done: its copy started and its hash queued, in order."""
                slot, length, done = reading.popleft()
                done.result()
                copied = self._copy(slot, length, target[offset : offset + length])
                pending[slot] = (copied, hashing.submit(hasher.update, self._views[slot][:length]))

            try:
                landed = 0
                for number, offset in enumerate(range(0, size, self.chunk)):
                    slot = number % len(self._ring)
                    _finish(pending[slot])
                    pending[slot] = None
                    view = self._views[slot][: min(self.chunk, size - offset)]
                    reading.append((slot, len(view), reads.submit(read_exactly, fd, view, offset)))
                    if len(reading) == self.readers:
                        land(landed)
                        landed += self.chunk
                while reading:
                    land(landed)
                    landed += self.chunk
            finally:  # a ring buffer is never left to a read, copy or hash still using it
                for _slot, _length, done in reading:
                    done.exception()
                for waiting in pending:
                    _finish(waiting)
        return target, Digest(hasher.hexdigest())

    def _copy(self, slot: int, length: int, into: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying the slot's first `length` bytes into `into`: on the side stream,
        without waiting, on a GPU (the event says when it is done); at once on a CPU."""
        source = self._ring[slot][:length]
        if self._stream is None:
            into.copy_(source)
            return None
        with torch.cuda.stream(self._stream):
            into.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def synchronize(self) -> None:
        """Wait for the work this thread queued on its stream (the caller's copies out of the
        payloads), so that a load's time is the whole of it. Not the whole device's: the
        start captures CUDA graphs beside the read, and a wait for every stream is one CUDA
        forbids any thread while a capture is under way."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _finish(pending: Pending | None) -> None:
    """Wait until a ring buffer's copy and hash are done (raising the hash's error, if any)."""
    if pending is None:
        return
    copied, hashed = pending
    if copied is not None:
        copied.synchronize()
    hashed.result()


def read_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from the file at `offset`, in as many reads as the kernel needs; EOFError
    if the file ends first (it shrank since its size was checked)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(f"the file ended at byte {offset + done}, {len(view) - done} short")
        done += got
