"""gc's sweep: the stored blobs its mark did not reach, found in several processes at once.

The fan-out folders are split into contiguous shares. A share lists each of its folders, drops
the names the mark reached there (one set operation per marks file, on a set of a few hundred
names) and stats the rest. Listing, hashing names and stat-ing are CPU work in CPython, so
threads gain nothing under the GIL (docs/performance.md); forked processes do. A child inherits
the marks as they are (nothing is pickled), sends back its few unmarked blobs through a pipe
and leaves with `os._exit`, so none of the parent's state (open DB connections, buffered
output) is closed or flushed twice. Children only read. A child that fails has its share done
again in the parent, which then raises the real error, or succeeds where the failure passed.
"""

from __future__ import annotations

import gc
import marshal
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

from flare.store.blobs import BlobStore
from flare.store.encoding import Encoding
from flare.store.layout import BLOB_DIR, blob_file

Reached = Callable[[str], list[list[str]]]
"""The hex digests the mark reached in one fan-out folder, as lists (one per marks file)."""

Unmarked = tuple[str, str, int, float]
"""A blob the mark did not reach, as the sweep listed it: hex digest, key, size, time (a plain
tuple: the sweep makes one per unreachable blob)."""


@dataclass(frozen=True)
class Share:
    """What one share of the folders held: how many stored blobs the mark reached, and the
    blobs it did not reach."""

    marked: int
    unmarked: list[Unmarked]


def unmarked(store: BlobStore, reached: Reached) -> Iterator[Share]:
    """Every stored blob whose digest is not reached, one share of the folders at a time:
    as many shares as the backend's `sweep_processes`, all running at once."""
    folders = store.backend.list_dir(BLOB_DIR)
    count = max(1, min(store.backend.sweep_processes, len(folders)))
    shares = [
        folders[len(folders) * k // count : len(folders) * (k + 1) // count] for k in range(count)
    ]
    yield from forked([partial(sweep_share, store, share, reached) for share in shares])


def sweep_share(store: BlobStore, folders: list[str], reached: Reached) -> Share:
    """List the folders and keep the blobs not reached, with size and time as listed.

    A live blob costs no Python work of its own: each folder's listing drops the folder's
    marked names in one set operation per list, against a set of a few hundred names. A zstd
    store's names carry a suffix, so there the marked names get it too. A blob stored in the
    other encoding is checked against the folder's marked digests before it counts as
    unreached. A stray file named like a live blob is kept, which is safe; other stray names
    are left out."""
    suffix = Encoding.ZSTD.suffix
    marked, found = 0, []
    for folder in folders:
        lists = reached(folder)
        if store.encoding is Encoding.ZSTD:
            lists += [[f"{d}{suffix}" for d in names] for names in lists]
        prefix = f"{BLOB_DIR}/{folder}"
        dropped, listed = store.backend.stat_folder(prefix, lists)
        marked += dropped
        here: set[str] | None = None
        for name, size, modified in listed:
            parsed = blob_file(folder, name)
            if parsed is None:
                continue
            if parsed[0] != name:  # an encoded name: the lists may hold its digest
                here = set().union(*lists) if here is None else here
                if parsed[0] in here:
                    marked += 1
                    continue
            found.append((parsed[0], f"{prefix}/{name}", size, modified))
    return Share(marked, found)


def forked(tasks: list[Callable[[], Share]]) -> Iterator[Share]:
    """Run the first task here and each other in a forked child, all at once; yield the
    results in order. Children the caller stopped waiting for are killed and reaped."""
    children = [_fork(task) for task in tasks[1:]]
    try:
        yield tasks[0]()
        for child, task in zip(children, tasks[1:], strict=True):
            result = child.result()
            yield task() if result is None else result
    finally:
        for child in children:
            child.stop()


@dataclass
class _Child:
    """A forked share: its process and the read end of the pipe its result comes through."""

    pid: int
    pipe: int
    waited: bool = False

    def result(self) -> Share | None:
        """The child's share, or None if it failed (its exit status says so)."""
        pipe, self.pipe = self.pipe, -1  # closed below, whatever happens
        with open(pipe, "rb") as reader:
            data = reader.read()
        _, status = os.waitpid(self.pid, 0)
        self.waited = True
        if os.waitstatus_to_exitcode(status) != 0 or not data:
            return None
        return Share(*marshal.loads(data))

    def stop(self) -> None:
        """Kill and reap a child not waited for (never signal a pid already reaped: it may
        belong to another process by now)."""
        if self.waited:
            return
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        if self.pipe >= 0:
            os.close(self.pipe)


def _fork(task: Callable[[], Share]) -> _Child:
    """Start a child that runs the task and writes its result to a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it leaves through os._exit
        status = 1
        try:
            # No collection of the parent's pending garbage here: a finalizer (a DB
            # connection's close) would act on state the parent still uses.
            gc.disable()
            os.close(read_end)
            share = task()
            with open(write_end, "wb") as pipe:
                pipe.write(marshal.dumps((share.marked, share.unmarked)))
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    return _Child(pid, read_end)
