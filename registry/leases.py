"""Leases: work in progress (a build, a pull, a server) tells gc what it must not remove.

A lease is a small file under `leases/` in the store, so every host sees every lease. It
names package digests to keep and, for builds, a start time: blobs touched since then are
kept too (a build's payloads are written before any tag names them). A heartbeat thread
pushes the expiry forward; a lease whose holder died expires and stops protecting anything.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from flare.store.blobs import BlobStore
from flare.store.digest import Digest

LEASES_DIR = "leases"
TTL_S = 120.0
"""A lease not renewed for this long has expired (its holder is gone)."""


@dataclass
class Lease:
    """What one piece of work holds."""

    id: str
    holder: str
    purpose: str
    packages: list[str] = field(default_factory=list)
    blobs: list[str] = field(default_factory=list)
    """Single blobs in use (a build's reused payloads), kept whatever their age."""
    since: float | None = None
    """For builds: blobs touched at or after this time are kept."""
    expires: float = 0.0
    started: float = 0.0
    """When the work began (`flare ps` shows it)."""
    url: str = ""
    """For servers: where the API answers."""
    what: str = ""
    """The work, for people: a server's NAME@DIGEST."""

    def host(self) -> str:
        return self.holder.rpartition(":")[0]

    def pid(self) -> int:
        return int(self.holder.rpartition(":")[2])

    def live(self, now: float) -> bool:
        return self.expires > now


def _key(lease_id: str) -> str:
    return f"{LEASES_DIR}/{lease_id}.json"


def _write(store: BlobStore, lease: Lease) -> None:
    lease.expires = time.time() + TTL_S
    store.backend.write_atomic(_key(lease.id), json.dumps(asdict(lease)).encode())


def live_leases(store: BlobStore, slack_s: float = 0.0) -> list[Lease]:
    """Every unexpired lease in the store (unreadable files count as none); with `slack_s`,
    also those expired less than that long ago (a holder whose clock is behind)."""
    now, found = time.time() - slack_s, []
    for name in store.backend.list_dir(LEASES_DIR):
        data = store.backend.read(f"{LEASES_DIR}/{name}")
        try:
            lease = Lease(**json.loads(data or b""))
        except (ValueError, TypeError):
            continue
        if lease.live(now):
            found.append(lease)
    return found


def drop_expired_leases(store: BlobStore, older_than_s: float = 3600.0) -> list[str]:
    """Remove lease files that expired long ago (their holders died without cleaning up)."""
    cutoff, dropped = time.time() - older_than_s, []
    for name in store.backend.list_dir(LEASES_DIR):
        data = store.backend.read(f"{LEASES_DIR}/{name}")
        try:
            expires = float(json.loads(data or b"")["expires"])
        except (ValueError, TypeError, KeyError):
            continue
        if expires < cutoff:
            store.backend.remove(f"{LEASES_DIR}/{name}")
            dropped.append(name)
    return dropped


@contextmanager
def hold_lease(
    store: BlobStore,
    purpose: str,
    packages: list[Digest] | None = None,
    protect_new: bool = False,
    url: str = "",
    what: str = "",
) -> Iterator[Lease]:
    """Hold a lease for the duration of the block, renewed by a heartbeat thread."""
    now = time.time()
    lease = Lease(
        id=secrets.token_hex(8),
        holder=f"{socket.gethostname()}:{os.getpid()}",
        purpose=purpose,
        packages=[str(d) for d in packages or []],
        since=now - 1.0 if protect_new else None,
        started=now,
        url=url,
        what=what,
    )
    store.backend.ensure()
    _write(store, lease)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(TTL_S / 4):
            _write(store, lease)

    heart = threading.Thread(target=beat, name=f"lease-{lease.id}", daemon=True)
    heart.start()
    try:
        yield lease
    finally:
        stop.set()
        heart.join()
        store.backend.remove(_key(lease.id))


def add_to_lease(store: BlobStore, lease: Lease, blob: Digest) -> None:
    """Protect one more blob under a held lease (written before the holder relies on it)."""
    if str(blob) not in lease.blobs:
        lease.blobs.append(str(blob))
        _write(store, lease)


def outlast_caches(window_s: float) -> None:
    """Keep holding the lease (its heartbeat goes on) until every host's view of the store
    shows what the holder just published: a tag written now is in every gc's roots a cache
    window from now, and until then only this lease keeps the package's blobs (0 on a local
    disk: no wait)."""
    if window_s > 0:
        time.sleep(window_s)
