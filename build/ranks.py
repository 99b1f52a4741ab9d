"""Rank zero's side of a multi-process build: share the plan, hand out payloads, gather digests.

Rank zero resolves, loads and plans as a single-process build does, then posts the plan and
the source digests. Each peer answers what it can do: read its own copy of the checkpoint
(`local`) and write into the same store (`shared`, found by a token file rank zero leaves in
the store). Every payload not already finished is then owned by one rank: a rank's own
payloads by that rank, a payload shared by all ranks by rank zero or a peer that can build it
without moving bytes (round robin), so it is read and hashed once. A peer with no copy of the
checkpoint receives its payloads' bytes from rank zero; a peer with no shared store sends the
payload bytes back and rank zero writes them once, checking the peer's digest. Rank zero
journals every payload as it lands, writes the index once every rank has reported, and only
then tells the peers the package digest.
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from flare.build.payloads import PayloadWriter, WrittenPayload, planned_size
from flare.build.plan import PlannedPayload
from flare.errors import IntegrityError
from flare.rendezvous import Rendezvous
from flare.store.blobs import BlobStore
from flare.store.digest import Digest

TAG_DOWN = 1
"""Message tag of payload bytes rank zero sends a peer."""
TAG_UP = 2
"""Message tag of payload bytes a peer sends rank zero."""
TOKEN_DIR = "rendezvous"


def assign_owners(
    plan: Sequence[PlannedPayload], finished: Sequence[bool], caps: dict[int, dict[str, bool]]
) -> list[int | None]:
    """The rank that builds each unfinished payload (None: finished already)."""
    helpers = [0] + [r for r in sorted(caps) if caps[r]["local"] and caps[r]["shared"]]
    owners: list[int | None] = []
    turn = 0
    for payload, done in zip(plan, finished, strict=True):
        if done:
            owners.append(None)
        elif len(payload.ranks) == 1:
            owners.append(payload.ranks[0])
        else:
            owners.append(helpers[turn % len(helpers)])
            turn += 1
    return owners


def run_all(tasks: Sequence[Callable[[], None]]) -> None:
    """Run tasks on threads of their own and raise the first failure at once.

    The threads are daemons: one stuck on a dead peer must not keep the process alive."""
    outcomes: queue.Queue[BaseException | None] = queue.Queue()

    def wrapped(task: Callable[[], None]) -> None:
        try:
            task()
            outcomes.put(None)
        except BaseException as exc:  # handed to the caller's thread
            outcomes.put(exc)

    for task in tasks:
        threading.Thread(target=wrapped, args=(task,), daemon=True).start()
    for _ in tasks:
        failure = outcomes.get()
        if failure is not None:
            raise failure


class Leader:
    """Rank zero's conversation with the peers, for one build."""

    def __init__(self, rendezvous: Rendezvous, store: BlobStore) -> None:
        self.rendezvous = rendezvous
        self.store = store
        self.peers = range(1, rendezvous.world)
        self.token: Path | None = None
        self._work_posted = False

    def share(
        self,
        source: str,
        allow_outside_links: bool,
        plan: Sequence[PlannedPayload],
        files: dict[str, dict[str, Any]],
    ) -> None:
        """Post what every peer needs to take part: the SOURCE rank zero was given (a peer
        resolves its own copy from it), the files' digests, the plan, the store's token."""
        self.token = self._leave_token()
        self.rendezvous.post(
            "setup",
            {
                "source": source,
                "allow_outside_links": allow_outside_links,
                "files": files,
                "plan": [p.describe() for p in plan],
                "sizes": [planned_size(p) for p in plan],
                "store": {
                    "token": self.token.name if self.token else None,
                    "encoding": self.store.encoding.value,
                },
            },
        )

    def _leave_token(self) -> Path | None:
        """A file in the store a peer finds only if it sees the same store (a NAS folder)."""
        name = secrets.token_hex(16)
        path = self.store.backend.local_path(f"{TOKEN_DIR}/{name}")
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)
        return path

    def write_payloads(
        self, writer: PayloadWriter, plan: Sequence[PlannedPayload], sizes: Sequence[int]
    ) -> list[WrittenPayload]:
        """Every payload, in plan order: recorded, built here, or built by its owner."""
        written: list[WrittenPayload | None] = [
            _reused(writer.recorded(p, s)) for p, s in zip(plan, sizes, strict=True)
        ]
        caps = {
            r: self.rendezvous.wait_for(f"caps/{r}", r, "while it checked its checkpoint")
            for r in self.peers
        }
        for rank in self.peers:
            for i, entry in self._finished(writer, plan, written, caps[rank].get("finished", {})):
                written[i] = WrittenPayload(entry, reused=True)
        owners = assign_owners(plan, [w is not None for w in written], caps)
        self._post_work(owners)

        def build_mine() -> None:
            def one(i: int) -> None:
                written[i] = WrittenPayload(writer.write(plan[i], sizes[i]), reused=False)

            writer.map(one, [i for i, o in enumerate(owners) if o == 0])

        def gather(rank: int, indices: list[int]) -> None:
            for i, entry in self._gather(writer, plan, sizes, rank, indices, caps[rank]["shared"]):
                written[i] = WrittenPayload(entry, reused=False)

        tasks: list[Callable[[], None]] = [build_mine]
        for rank in self.peers:
            theirs = [i for i, o in enumerate(owners) if o == rank]
            if theirs and not caps[rank]["local"]:
                tasks.append(lambda r=rank, t=theirs: self._send(writer, plan, sizes, r, t))
            if theirs:
                tasks.append(lambda r=rank, t=theirs: gather(r, t))
        run_all(tasks)
        return [w for w in written if w is not None]

    def _finished(
        self,
        writer: PayloadWriter,
        plan: Sequence[PlannedPayload],
        written: Sequence[WrittenPayload | None],
        finished: dict[str, dict[str, Any]],
    ) -> list[tuple[int, dict[str, Any]]]:
        """Payloads a peer stored on an earlier run but never reported, journaled here now:
        (plan index, manifest entry) of each."""
        taken = []
        for index, record in finished.items():
            i = int(index)
            if written[i] is None and self.store.has(Digest.parse(record["digest"])):
                taken.append((i, writer.record(plan[i], record["digest"], record["size"])))
        return taken

    def _post_work(self, owners: list[int | None]) -> None:
        self.rendezvous.post("work", {"owners": owners})
        self._work_posted = True

    def _send(
        self,
        writer: PayloadWriter,
        plan: Sequence[PlannedPayload],
        sizes: Sequence[int],
        rank: int,
        indices: list[int],
    ) -> None:
        """Stream a peer without a checkpoint the bytes of each payload it owns, in order."""
        for i in indices:
            with writer.stream(plan[i]) as reader:
                self.rendezvous.send_stream(reader, sizes[i], rank, TAG_DOWN, lambda _n: None)

    def _gather(
        self,
        writer: PayloadWriter,
        plan: Sequence[PlannedPayload],
        sizes: Sequence[int],
        rank: int,
        indices: list[int],
        shared: bool,
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Take each payload a peer owns: found in the shared store, or received and stored;
        (plan index, manifest entry) of each as it is journaled."""
        for i in indices:
            stored = None
            if not shared:
                stream = self.rendezvous.receive_stream(rank, sizes[i], TAG_UP)
                stored = self.store.put_stream(stream, sizes[i], progress=writer.progress)
            report = self.rendezvous.wait_for(f"payload/{i}", rank, "while it built payloads")
            if stored is not None and str(stored.digest) != report["digest"]:
                raise IntegrityError(
                    f"payload {i} from rank {rank} arrived as {stored.digest}, "
                    f"but rank {rank} read {report['digest']}",
                    "the bytes were damaged on the way; rerun every rank",
                )
            if shared:
                writer.progress(sizes[i])
            yield i, writer.record(plan[i], report["digest"], report["size"])

    def finish(self, digest: str) -> None:
        """Tell the peers the package digest, and wait until each has heard it."""
        if not self._work_posted:  # every payload was recorded: there was nothing to hand out
            self._post_work([])
        self.rendezvous.post("result", {"digest": digest})
        for rank in self.peers:
            self.rendezvous.wait_for(f"left/{rank}", rank, "after the build")
        self._remove_token()

    def fail(self, reason: str) -> None:
        """Stop every peer with the reason rank zero failed."""
        self.rendezvous.abort(reason)
        self.rendezvous.linger([f"left/{r}" for r in self.peers])
        self._remove_token()

    def _remove_token(self) -> None:
        if self.token is not None:
            self.token.unlink(missing_ok=True)


def _reused(entry: dict[str, Any] | None) -> WrittenPayload | None:
    """A payload recorded by an earlier run, as written; None when it is not."""
    return None if entry is None else WrittenPayload(entry, reused=True)
