"""Leases: work in progress (a build, a pull, a server) tells gc what it must not remove.

A lease is a small file under `leases/` in the store, so every host sees every lease. It
names package digests to keep and, for builds, a start time: blobs touched since then are
kept too (a build's payloads are written before any tag names them). A heartbeat thread
pushes the expiry forward; a lease whose holder died expires and stops protecting anything.

Anyone who may write to a shared registry can put any file under `leases/`. A file that is not
a lease as `hold_lease` writes it (not JSON, a field of the wrong type, a package that is no
digest, a FIFO) protects nothing, as an expired lease protects nothing: every reader passes
over it with a one-line warning on stderr that names it, and gc goes on (one damaged file must
not stop every collection of a shared registry). A live holder's own file cannot stay so: its
heartbeat rewrites it whole, atomically, every TTL_S / 4.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from flare.errors import FlareError
from flare.store.backends.regular import NotAFileError
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


class BadLease(ValueError):
    """A lease file that is not a lease as `hold_lease` writes it: why, for the warning."""


_HOLDER = re.compile(r"[^\x00-\x1f\x7f]*:[0-9]{1,10}")
"""HOST:PID, as `hold_lease` writes it (`flare ps` shows both)."""
_LATEST_START = 1e11
"""A start time later than this (the year 5138) is no time `flare ps` can show."""
_TEXT = ("id", "holder", "purpose", "url", "what")
_DIGESTS = ("packages", "blobs")
_warned: set[tuple[str, str]] = set()


def parse_lease(data: bytes) -> Lease:
    """The lease a file holds, every field checked for its type and shape (fields this flare
    does not know are ignored: a newer flare's lease still protects what it names); raises
    BadLease saying what is wrong."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadLease("not JSON") from exc
    if not isinstance(body, dict):
        raise BadLease("not a JSON object")
    known = {f.name for f in fields(Lease)}
    values = {k: v for k, v in body.items() if k in known}
    missing = [name for name in ("id", "holder", "purpose") if name not in values]
    if missing:
        raise BadLease(f"no {', '.join(missing)}")
    for name in _TEXT:
        if name in values and not isinstance(values[name], str):
            raise BadLease(f"{name} is {_shown(values[name])}, not text")
        if name in values and not values[name].isprintable():  # `flare ps` shows them
            raise BadLease(f"{name} is {_shown(values[name])}, with control characters")
    if not _HOLDER.fullmatch(values["holder"]):
        raise BadLease(f"holder is {_shown(values['holder'])}, not HOST:PID")
    for name in _DIGESTS:
        values[name] = _digests(name, values.get(name, []))
    for name in ("expires", "started"):
        if name in values:
            values[name] = _time(name, values[name])
    if values.get("since") is not None:
        values["since"] = _time("since", values["since"])
    if not 0.0 <= values.get("started", 0.0) < _LATEST_START:
        raise BadLease(f"started is {values['started']!r}, out of range")
    return Lease(**values)


def _digests(name: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise BadLease(f"{name} is {_shown(value)}, not a list of digests")
    for item in value:
        if not isinstance(item, str):
            raise BadLease(f"{name} holds {_shown(item)}, not a digest")
        try:
            Digest.parse(item)
        except FlareError:
            raise BadLease(f"{name} holds {_shown(item)}, not a digest") from None
    return value


def _time(name: str, value: Any) -> float:
    """A time as seconds since the epoch: a finite JSON number (true and false are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadLease(f"{name} is {_shown(value)}, not a number")
    try:
        seconds = float(value)
    except OverflowError:  # an integer of hundreds of digits
        seconds = math.inf
    if not math.isfinite(seconds):
        raise BadLease(f"{name} is {_shown(value)}, not a finite number")
    return seconds


def _shown(value: Any) -> str:
    """A JSON value as the warning shows it: short, one line, printable."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except ValueError:  # an integer too long to write out
        text = "a number"
    return text if len(text) <= 40 else f"{text[:37]}..."


def _printable(text: str) -> str:
    """Text as a warning may show it on a terminal: control characters escaped."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def read_leases(store: BlobStore) -> Iterator[Lease]:
    """Every lease file's lease, expired ones included; a file that holds none (unreadable,
    or not a lease: see the module's notes) is passed over with a warning that names it."""
    for name in store.backend.list_dir(LEASES_DIR):
        key = f"{LEASES_DIR}/{name}"
        try:
            data = store.backend.read(key)
        except NotAFileError as exc:
            _warn(store, key, f"{exc.kind}, not a file")
            continue
        except FlareError as exc:
            if not isinstance(exc.__cause__, IsADirectoryError):
                raise  # a read that failed (EIO, EACCES): the lease may be live, gc must stop
            _warn(store, key, "a folder, not a file")
            continue
        if data is None:
            continue  # removed since the listing: its holder finished
        try:
            yield parse_lease(data)
        except BadLease as exc:
            _warn(store, key, str(exc))


def _warn(store: BlobStore, key: str, why: str) -> None:
    """One line on stderr, once per file and reason in a process (gc reads the leases again
    and again while it sweeps)."""
    where = f"{store.location}/{key}"
    if (where, why) in _warned:
        return
    _warned.add((where, why))
    print(
        f"warning: ignoring lease file {_printable(where)}: {_printable(why)}; it protects nothing "
        "(remove it if no flare process writes it)",
        file=sys.stderr,
        flush=True,
    )


def _key(lease_id: str) -> str:
    return f"{LEASES_DIR}/{lease_id}.json"


def _write(store: BlobStore, lease: Lease) -> None:
    lease.expires = time.time() + TTL_S
    store.backend.write_atomic(_key(lease.id), json.dumps(asdict(lease)).encode())


def live_leases(store: BlobStore, slack_s: float = 0.0) -> list[Lease]:
    """Every unexpired lease in the store (a file that holds no lease counts as none, with a
    warning: read_leases); with `slack_s`, also those expired less than that long ago (a
    holder whose clock is behind)."""
    now = time.time() - slack_s
    return [lease for lease in read_leases(store) if lease.live(now)]


def drop_expired_leases(store: BlobStore, older_than_s: float = 3600.0) -> list[str]:
    """Remove lease files that expired long ago (their holders died without cleaning up)."""
    cutoff, dropped = time.time() - older_than_s, []
    for name in store.backend.list_dir(LEASES_DIR):
        try:  # a file without an expiry stays: it protects nothing, and warns who reads it
            data = store.backend.read(f"{LEASES_DIR}/{name}")
            expires = _time("expires", json.loads(data or b"")["expires"])
        except (ValueError, TypeError, KeyError, RecursionError, FlareError):
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
