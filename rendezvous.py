"""Rendezvous and transport between the ranks of a multi-process build or server, over
torch.distributed.

Rank zero hosts a TCPStore at HOST:PORT; every rank joins it, says it arrived, and beats a
counter while it lives. Small messages (the plan, each rank's abilities, payload digests) are
JSON values under keys of that store; payload bytes travel over a gloo process group in
fixed-size chunks, so sender and receiver agree on every message size without telling it.

Rank zero says what the group is for under the key `kind` (`build` or `serve`), so that
`flare join` takes part in either.

Every wait watches the rank it waits for: a rank whose heartbeat stops for `timeout` seconds,
or whose connection closes, ends the wait with a RankError naming it, never a hang.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from flare.errors import FlareError, InvalidInputError
from flare.store.hashing import new_hasher

CHUNK = 16 << 20
"""Bytes per message between ranks: both sides cut a payload the same way."""

POLL_S = 0.02
"""How often a wait looks at the store: small against any payload's transfer time."""


GROUPS = {"build": "build", "serve": "server"}
"""What each kind of group is called in messages."""
KINDS = tuple(GROUPS)


class RankError(FlareError):
    """A rank that did not join, stopped, or failed: the whole multi-rank build or server
    stops."""

    exit_code = 13


def parse_address(text: str, any_port: bool = False) -> tuple[str, int]:
    """HOST:PORT as given to --rendezvous and join (`any_port`: rank zero may give port 0,
    any free one)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not int(not any_port) <= int(port) < 65536:
        raise InvalidInputError(f"bad rendezvous address {text!r}", "give HOST:PORT")
    return host.strip("[]"), int(port)


def local_address(host: str, port: int) -> str:
    """This host's address on the route to HOST: the one gloo must listen on.

    (gloo's default, the address of the host name, is loopback on many machines and would
    be unreachable from another host or network namespace.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


class Rendezvous:
    """This rank's view of the group: the shared store, the process group, the heartbeats."""

    def __init__(self, address: str, rank: int, world: int, timeout: float, store: Any) -> None:
        self.address = address
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.store = store
        self.group: Any = None
        self.kind = "build"
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    # -- joining ---------------------------------------------------------------------------

    @classmethod
    def host(
        cls,
        address: str,
        world: int,
        timeout: float,
        kind: str = "build",
        started: Callable[[str], None] | None = None,
    ) -> Rendezvous:
        """Rank zero: serve the store, wait for every rank, then form the process group.
        `started` is told the address once the store listens (port 0 picks a free one), so
        that the other ranks can be started."""
        dist = _distributed()
        host, port = parse_address(address, any_port=True)
        try:
            store = dist.TCPStore(
                host, port, world, True, timedelta(seconds=timeout), wait_for_workers=False
            )
        except (RuntimeError, OSError) as exc:
            raise RankError(
                f"cannot serve the rendezvous at {address}: {_first_line(exc)}",
                "pick a free port on an address of this host",
            ) from exc
        address = f"{host}:{store.port}"
        store.set("kind", kind)
        store.set("timeout", f"{timeout:g}")
        store.set("world", str(world))
        if started is not None:
            started(address)
        rendezvous = cls(address, 0, world, timeout, store)
        rendezvous.kind = kind
        with rendezvous._closed_on_failure():
            rendezvous._arrive()
            rendezvous._await_arrivals()
            store.set("ready", "1")
            rendezvous._connect_group()
        return rendezvous

    @classmethod
    def join(cls, address: str, rank: int, timeout: float, kind: str = "build") -> Rendezvous:
        """Another rank: reach rank zero's store, check the rank, form the process group."""
        store = connect(address, rank, timeout)
        world = int(store.get("world"))
        if not 0 < rank < world:
            raise InvalidInputError(
                f"--rank {rank} is not a peer rank of this {world}-rank {kind}",
                f"give a rank from 1 to {world - 1}",
            )
        rendezvous = cls(address, rank, world, timeout, store)
        rendezvous.kind = kind
        with rendezvous._closed_on_failure():
            rendezvous._arrive()
            rendezvous.wait_for("ready", 0, "to see every rank arrive")
            rendezvous._connect_group()
        return rendezvous

    @contextlib.contextmanager
    def _closed_on_failure(self) -> Iterator[None]:
        """A rank that fails while joining says goodbye (rank zero keeps its store up until the
        arrived ranks have read why the build stopped) and stops its heartbeat before the error
        goes up: a daemon thread still inside a TCPStore call when the interpreter ends aborts
        the process (SIGABRT, "terminate called without an active exception") instead of
        letting it exit with its error's status."""
        try:
            yield
        except BaseException:
            if self.rank:
                self.say_goodbye()
            self.close()
            raise

    def _arrive(self) -> None:
        """Claim the rank (refusing a second process with it) and start the heartbeat."""
        if self.store.add(f"arrived/{self.rank}", 1) > 1:
            raise InvalidInputError(
                f"rank {self.rank} already joined {self.address}",
                "give each process a different --rank",
            )
        self._beating = threading.Thread(target=self._beat, name=f"beat-{self.rank}", daemon=True)
        self._beating.start()

    def _beat(self) -> None:
        period = min(1.0, self.timeout / 4)
        while not self._stop.wait(period):
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except (RuntimeError, OSError):
                return

    def _await_arrivals(self) -> None:
        deadline = time.monotonic() + self.timeout
        missing = list(range(1, self.world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not self.store.check([f"arrived/{r}"])]
            time.sleep(POLL_S)
        if missing:
            self.abort(f"rank {missing[0]} did not join")
            self.linger([f"left/{r}" for r in range(1, self.world) if r not in missing])
            raise RankError(
                f"rank {missing[0]} did not join {self.address} within {self.timeout:g} s"
                + (f" (nor did ranks {missing[1:]})" if missing[1:] else ""),
                f"run `flare join {self.address} --rank {missing[0]}` there, or raise --timeout",
            )

    def _connect_group(self) -> None:
        """The gloo group that carries payload bytes, listening on the route to rank zero."""
        dist = _distributed()
        host, port = parse_address(self.address)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=self.timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, port))]
        prefix = dist.PrefixStore("gloo", self.store)
        try:
            self.group = dist.ProcessGroupGloo(prefix, self.rank, self.world, options)
        except RuntimeError as exc:
            raise RankError(
                f"rank {self.rank} could not connect to every rank: {_first_line(exc)}",
                "check that the ranks' hosts can reach each other on any port",
            ) from exc

    # -- messages --------------------------------------------------------------------------

    def post(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def say_goodbye(self) -> None:
        """Tell rank zero this rank is done with the store (it may already be gone)."""
        with contextlib.suppress(RuntimeError, OSError):
            self.post(f"left/{self.rank}", True)

    def wait_for(self, key: str, rank: int, doing: str) -> Any:
        """The JSON value under key, once posted; fails if `rank` stops or anyone aborts."""
        while True:
            try:
                if self.store.check([key]):
                    return json.loads(self.store.get(key))
                aborted = self.store.check(["abort"])
            except (RuntimeError, OSError) as exc:
                raise self._gone(0, doing) from exc
            if aborted and key != "abort":
                reason = json.loads(self.store.get("abort"))
                raise RankError(
                    f"the {GROUPS[self.kind]} stopped: {reason}", "see that rank's error; rerun all"
                )
            self.check_alive(rank, doing)
            time.sleep(POLL_S)

    def abort(self, reason: str) -> None:
        """Tell every rank to stop (best effort: the store may be gone already)."""
        try:
            if not self.store.check(["abort"]):
                self.post("abort", f"rank {self.rank}: {reason}")
        except (RuntimeError, OSError):
            pass

    def linger(self, keys: list[str], seconds: float = 2.0) -> None:
        """Keep the store up a moment until these keys appear: peers read an abort from it."""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(POLL_S)
        except (RuntimeError, OSError):
            pass

    def check_alive(self, rank: int, doing: str) -> None:
        """Raise if `rank`'s heartbeat has not moved for the timeout."""
        if rank == self.rank:
            return
        beats = self.store.add(f"beat/{rank}", 0)
        now = time.monotonic()
        last, since = self._seen.get(rank, (-1, now))
        if beats != last:
            self._seen[rank] = (beats, now)
        elif now - since > self.timeout:
            raise self._gone(rank, doing)

    def _gone(self, rank: int, doing: str) -> RankError:
        return RankError(
            f"rank {rank} stopped answering {doing} (no sign of life for {self.timeout:g} s "
            "or its connection closed)",
            "see that rank's error, then rerun every rank: finished payloads are kept",
        )

    def close(self) -> None:
        """Stop the heartbeat and the process group's threads before the interpreter exits
        (left running, they abort the process as it ends)."""
        self._stop.set()
        if self._beating is not None:
            self._beating.join()
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    # -- bytes -----------------------------------------------------------------------------

    def send_stream(
        self, source: io.RawIOBase, size: int, dst: int, tag: int, progress: Callable[[int], None]
    ) -> str:
        """Send `size` bytes of a stream to rank `dst` in CHUNK pieces; return their digest."""
        import torch

        hasher = new_hasher(1)
        buffer = bytearray(min(CHUNK, size) or 1)
        sent = 0
        while sent < size:
            view = memoryview(buffer)[: min(CHUNK, size - sent)]
            _read_exactly(source, view)
            hasher.update(view)
            self._transfer(self.group.send, torch.frombuffer(view, dtype=torch.uint8), dst, tag)
            sent += len(view)
            progress(len(view))
        return hasher.hexdigest()

    def receive_stream(self, src: int, size: int, tag: int) -> io.RawIOBase:
        """The `size` bytes rank `src` sends with send_stream, as a stream to read once."""
        return _ReceivedStream(self, src, size, tag)

    def _transfer(self, action: Callable[..., Any], tensor: Any, rank: int, tag: int) -> None:
        try:
            action([tensor], rank, tag).wait()
        except RuntimeError as exc:
            raise self._gone(rank, "while payload bytes were moving") from exc


class _ReceivedStream(io.RawIOBase):
    """Bytes arriving from another rank, chunk by chunk, read by the store's hashing writer."""

    def __init__(self, rendezvous: Rendezvous, src: int, size: int, tag: int) -> None:
        import torch

        super().__init__()
        self._rendezvous, self._src, self._tag = rendezvous, src, tag
        self._left = size
        self._tensor = torch.empty(min(CHUNK, size) or 1, dtype=torch.uint8)
        self._chunk = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if not self._chunk:
            if not self._left:
                return 0
            length = min(CHUNK, self._left)
            part = self._tensor[:length]
            self._rendezvous._transfer(self._rendezvous.group.recv, part, self._src, self._tag)
            self._chunk = memoryview(part.numpy()).cast("B")
            self._left -= length
        view = memoryview(buffer).cast("B")
        take = min(len(view), len(self._chunk))
        view[:take] = self._chunk[:take]
        self._chunk = self._chunk[take:]
        return take


def _read_exactly(source: io.RawIOBase, view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        got = source.readinto(view[filled:])
        if not got:
            raise RankError("a payload's source ended early", "the checkpoint changed; rerun")
        filled += got


def connect(address: str, rank: int, timeout: float) -> Any:
    """A client of rank zero's store (what `kind` to read says what the group is for)."""
    dist = _distributed()
    host, port = parse_address(address)
    unreachable = RankError(
        f"rank {rank} could not reach rank 0 at {address} within {timeout:g} s",
        "start `flare build --rendezvous` or `flare serve --rendezvous` there first, and "
        "check the address",
    )
    if not _listening(host, port, timeout):
        raise unreachable
    try:
        with _c10d_quiet():
            store = dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
            store.get("world")
    except (RuntimeError, OSError) as exc:
        raise unreachable from exc
    return store


def group_kind(address: str, rank: int, timeout: float) -> tuple[str, float]:
    """What rank zero's group at `address` is for (`build` or `serve`), and its timeout: a
    serving group's ranks watch each other with rank zero's."""
    store = connect(address, rank, timeout)
    kind = store.get("kind").decode() if store.check(["kind"]) else "build"
    if kind not in KINDS:
        raise RankError(f"rank 0 at {address} runs an unknown kind of group: {kind!r}")
    if store.check(["timeout"]):
        timeout = float(store.get("timeout").decode())
    return kind, timeout


def _distributed() -> Any:
    """torch.distributed, imported only by multi-rank builds (torch is slow to import).

    c10d logs a warning with a C++ stack for every call on a closed connection; a dead rank
    is reported once, as a RankError, so its logs are cut down to errors."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    import torch.distributed

    return torch.distributed


def _listening(host: str, port: int, timeout: float) -> bool:
    """Whether something listens at HOST:PORT within `timeout`, asked with plain connects.

    torch's TCPStore client, asked the same, retries past its timeout (12 s for 5) and logs a
    C++ stack at every try; a probe that connects and closes costs its server nothing."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(left, 1.0))):
                return True
        except OSError:
            if left <= 0:
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def _c10d_quiet() -> Iterator[None]:
    """Keep what c10d's C++ code writes on stderr (file descriptor 2: a failed connect's
    stack, dozens of lines) out of the user's terminal while a rank connects; the failure is
    reported as one RankError line instead."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
