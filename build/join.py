"""A peer rank of a multi-process build (`flare join HOST:PORT --rank R`).

The peer learns everything from rank zero: the source's file digests, the plan, the payloads
it owns. It reads those payloads' bytes from its own copy of the checkpoint when asked to
(`--local-checkpoint`) and the copy matches rank zero's digests, else it receives them from
rank zero. It writes each payload straight into the store when it sees rank zero's store (the
token file is there), journaling it in its own staging area so a rerun reuses it; else it
sends the bytes to rank zero, which writes them once. Either way it reports each payload's
digest, and waits for the package digest rank zero publishes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare.build.journal import Journal
from flare.build.payloads import payload_key, payload_stream, store_payload
from flare.build.phases import Events, PhaseLog, PhaseReport
from flare.build.plan import PlannedPayload
from flare.build.ranks import TAG_DOWN, TAG_UP, TOKEN_DIR
from flare.build.sources import Source, resolve_source
from flare.build.statcache import StatCache, digest_files
from flare.errors import FlareError, IntegrityError, NotFoundError
from flare.faults import crash_point
from flare.registry.leases import Lease, add_to_lease, hold_lease
from flare.rendezvous import Rendezvous
from flare.store.blobs import BlobStore, PutResult
from flare.store.digest import Digest
from flare.store.encoding import Encoding
from flare.store.hashing import FileState, parallel_map

LOCAL_MODES = ("require", "prefer")


@dataclass(frozen=True)
class JoinRequest:
    """What `flare join` was given, plus where this host keeps things."""

    address: str
    rank: int
    registry: str
    staging: Path
    hub_cache: Path
    local_checkpoint: str | None = None
    """None: receive payload bytes from rank zero; require or prefer: read a local copy."""
    checkpoint: str | None = None
    """The local copy (default: the SOURCE rank zero was given, as this host resolves it)."""
    workers: int | None = None
    timeout: float = 300.0
    rehash: bool = False


@dataclass
class JoinResult:
    rank: int
    digest: str
    source: str
    """Where this rank's bytes came from: its local checkpoint, or rank 0."""
    store: str
    """Where its payloads went: the shared store, or rank 0."""
    written: int = 0
    reused: int = 0
    phases: list[PhaseReport] = field(default_factory=list)


class Join:
    """One peer rank's part of a multi-process build."""

    def __init__(self, request: JoinRequest, events: Events) -> None:
        self.request = request
        self.events = events
        self.phases = PhaseLog(events)
        self.rendezvous: Rendezvous | None = None
        self.source: Source | None = None
        self.states: dict[str, FileState] = {}
        self.store: BlobStore | None = None
        self.lease: Lease | None = None
        self.journal = Journal(request.staging)
        self.counts = {"written": 0, "reused": 0}
        self._counting = threading.Lock()

    def run(self) -> JoinResult:
        """Join, do this rank's share, and wait for the digest rank zero publishes."""
        request = self.request
        started = time.perf_counter()
        self.events.phase_started("rendezvous", 0)
        self.rendezvous = Rendezvous.join(request.address, request.rank, request.timeout)
        self.phases.finish("rendezvous", started, 0)
        try:
            with self._failing_aloud():
                return self._take_part(self.rendezvous)
        finally:
            self.rendezvous.say_goodbye()
            self.rendezvous.close()

    @contextmanager
    def _failing_aloud(self) -> Iterator[None]:
        """A failure here stops every rank, with this rank's reason."""
        assert self.rendezvous is not None
        try:
            yield
        except FlareError as exc:
            self.rendezvous.abort(str(exc))
            raise

    def _take_part(self, rendezvous: Rendezvous) -> JoinResult:
        setup = rendezvous.wait_for("setup", 0, "while it planned the build")
        self._use_local_checkpoint(setup)
        self.store = self._shared_store(setup["store"])
        plan = [PlannedPayload.from_description(p) for p in setup["plan"]]
        finished = self._finished(plan)
        self.counts["reused"] = len(finished)
        rendezvous.post(
            f"caps/{self.request.rank}",
            {
                "local": self.source is not None,
                "shared": self.store is not None,
                "finished": finished,
            },
        )
        owners = rendezvous.wait_for("work", 0, "while it checked its journal")["owners"]
        mine = [i for i, owner in enumerate(owners) if owner == self.request.rank]
        self._build(plan, setup["sizes"], mine)
        digest = rendezvous.wait_for("result", 0, "while it published the package")["digest"]
        return JoinResult(
            self.request.rank,
            digest,
            "local checkpoint" if self.source else "rank 0",
            "shared store" if self.store else "rank 0",
            self.counts["written"],
            self.counts["reused"],
            self.phases.reports,
        )

    # -- the checkpoint and the store ------------------------------------------------------

    def _use_local_checkpoint(self, setup: dict[str, Any]) -> None:
        """Take the local copy if asked and it matches rank zero's digests, file by file."""
        mode = self.request.local_checkpoint
        if mode is None:
            return
        started = time.perf_counter()
        spec = self.request.checkpoint or setup["source"]
        try:
            source = resolve_source(spec, self.request.hub_cache, setup["allow_outside_links"])
        except NotFoundError as exc:
            self._refuse_or_note(
                mode, NotFoundError(f"rank {self.request.rank}: {exc.what}", _HINT)
            )
            return
        wanted: dict[str, dict[str, Any]] = setup["files"]
        present = [n for n in wanted if n in source.files]
        total = sum(wanted[n]["size"] for n in present)
        self.events.phase_started("resolve", total)
        digests = digest_files(
            [source.root / n for n in present],
            StatCache(self.request.staging / "stat"),
            self.request.rehash,
            self.request.workers,
            self.events.advance,
        )
        found = {n: str(d) for n, (d, _) in zip(present, digests, strict=True)}
        differ = [n for n in wanted if found.get(n) != wanted[n]["digest"]]
        self.phases.finish("resolve", started, total)
        if differ:
            what = f"rank {self.request.rank}'s checkpoint {source.root} differs from rank 0's"
            detail = f"{what} in {differ[0]}" + (
                f" and {len(differ) - 1} more" if differ[1:] else ""
            )
            self._refuse_or_note(mode, IntegrityError(detail, _HINT))
            return
        self.source = source
        self.states = {n: s for n, (_, s) in zip(present, digests, strict=True)}
        for name, state in self.states.items():
            source.identity(name, state)

    def _refuse_or_note(self, mode: str, error: FlareError) -> None:
        if mode == "require":
            raise error
        self.events.note(f"{error.what}; receiving its bytes from rank 0 instead")

    def _shared_store(self, store: dict[str, Any]) -> BlobStore | None:
        """This host's store, if it is rank zero's (it holds rank zero's token file)."""
        if store["token"] is None:
            return None
        shared = BlobStore(self.request.registry, Encoding(store["encoding"]))
        token = shared.backend.local_path(f"{TOKEN_DIR}/{store['token']}")
        if token is None or not token.is_file() or token.read_text() != store["token"]:
            return None
        return shared

    # -- payloads --------------------------------------------------------------------------

    def _build(self, plan: list[PlannedPayload], sizes: list[int], mine: list[int]) -> None:
        """Each payload this rank owns, on parallel workers where nothing crosses the network."""
        started = time.perf_counter()
        total = sum(sizes[i] for i in mine)
        self.events.phase_started("assemble", total)
        with ExitStack() as stack:
            if self.store is not None:
                self.lease = stack.enter_context(hold_lease(self.store, "join", protect_new=True))
            parallel = self.source is not None and self.store is not None
            workers = (self.request.workers or 2) if parallel else 1
            parallel_map(lambda i: self._payload(i, plan[i], sizes[i]), mine, workers)
        status = "reused" if not self.counts["written"] else "done"
        if self.counts["written"] and self.counts["reused"]:
            status = "resumed"
        self.phases.finish("assemble", started, total, status)

    def _payload(self, index: int, payload: PlannedPayload, size: int) -> None:
        assert self.rendezvous is not None
        if self.source is not None and self.store is not None:  # file to file, as rank 0 does
            root, progress = self.source.root, self.events.advance
            record = self._stored(store_payload(self.store, payload, root, self.states, progress))
        else:
            with self._bytes_of(payload, size) as stream:
                record = self._deliver(stream, size)
        if self.store is not None:
            self.journal.put("payload", payload_key(payload), record)
        crash_point("join:payload")  # stored and journaled, not yet reported
        with self._counting:
            self.counts["written"] += 1
        self.rendezvous.post(f"payload/{index}", record)

    def _finished(self, plan: list[PlannedPayload]) -> dict[int, dict[str, Any]]:
        """Payloads this rank stored in the shared store on an earlier run, by plan index.

        Rank zero may never have heard of them (this rank died before reporting): it takes
        them from here instead of handing them out again."""
        if self.store is None:
            return {}
        found = {}
        for index, payload in enumerate(plan):
            record = self.journal.get("payload", payload_key(payload))
            if record is not None and self.store.has(Digest.parse(record["digest"])):
                found[index] = record
        return found

    @contextmanager
    def _bytes_of(self, payload: PlannedPayload, size: int) -> Iterator[Any]:
        """The payload's bytes: read from the local checkpoint, or received from rank zero."""
        assert self.rendezvous is not None
        if self.source is None:
            yield self.rendezvous.receive_stream(0, size, TAG_DOWN)
            return
        with payload_stream(payload, self.source.root, self.states) as reader:
            yield reader

    def _deliver(self, stream: Any, size: int) -> dict[str, Any]:
        """Into the shared store, or over to rank zero; the digest of the bytes either way."""
        assert self.rendezvous is not None
        if self.store is None:
            digest = self.rendezvous.send_stream(stream, size, 0, TAG_UP, self.events.advance)
            return {"digest": str(Digest(digest)), "size": size}
        return self._stored(self.store.put_stream(stream, size, progress=self.events.advance))

    def _stored(self, result: PutResult) -> dict[str, Any]:
        """A payload now in the shared store: held by this rank's lease, and its record."""
        assert self.store is not None
        if self.lease is not None:
            add_to_lease(self.store, self.lease, result.digest)
        return {"digest": str(result.digest), "size": result.size}


_HINT = (
    "copy rank 0's checkpoint here (or give --checkpoint PATH), or use --local-checkpoint prefer"
)
