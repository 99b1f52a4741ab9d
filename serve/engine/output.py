"""What a request gives back: text deltas, cut at stop strings, streamed to its caller.

Text is decoded incrementally over a short window of tokens and released only when it
decodes cleanly, so a multi-byte character split over tokens is never emitted in halves.
Text that could be the start of a stop string is held back until it is clearly not one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer

from flare.serve.engine.sequence import TokenLogprob

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Delta:
    """New output of one request: text, the tokens behind it, and why it ended (if it did):
    "stop" (end-of-sequence token or stop string), "length", or "cancelled"."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None

    @staticmethod
    def joined(deltas: list[Delta]) -> Delta:
        """Consecutive deltas of one request as one: their text, tokens and logprobs in
        order, the last one's finish reason."""
        logprobs = [lp for d in deltas for lp in d.logprobs or []]
        return Delta(
            "".join(d.text for d in deltas),
            [t for d in deltas for t in d.token_ids],
            logprobs if any(d.logprobs is not None for d in deltas) else None,
            deltas[-1].finish_reason,
        )


class RequestFailed(RuntimeError):
    """The engine ended this request with an error of its own (or of its batch's forward);
    the message names the request and the cause. Other requests were not touched."""


class TextStream:
    """Incremental detokenizer with stop strings for one request."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""
        """Decoded text not yet emitted (it may begin a stop string)."""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return the text now safe to emit and whether a stop string was hit."""
        self.pending += self._decode_new(token_id)
        for stop in self.stop:
            at = self.pending.find(stop)
            if at >= 0:
                return self._take(at), True
        return self._take(len(self.pending) - self._held_back()), False

    def flush(self) -> str:
        """The text held back, when the request ends without a stop string."""
        return self._take(len(self.pending))

    def _decode_new(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _held_back(self) -> int:
        """The longest tail of the pending text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if stop.startswith(self.pending[-n:]):
                    longest = n
                    break
        return longest

    def _take(self, n: int) -> str:
        text, self.pending = self.pending[:n], self.pending[n:]
        return text


class RequestHandle:
    """A submitted request: iterate it (blocking) or `async for` over `stream()`.

    The engine thread pushes deltas; the last one has a finish_reason. If the engine ends
    the request with an error instead, reading raises RequestFailed. Use one of the two ways
    of reading, not both.
    """

    def __init__(self, request_id: int, cancel: Callable[[], None]) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Delta | BaseException] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue[Delta | BaseException] | None = None
        self._handed: list[Delta | BaseException] = []
        """Pushed for the loop, not yet moved to its queue (one wake-up moves them all)."""
        self.finished = False

    def cancel(self) -> None:
        """Stop generating; the request's KV blocks are freed at the engine's next step."""
        if not self.finished:
            self._cancel()

    def push(self, item: Delta | BaseException) -> None:
        """Called by the engine thread. An async reader's loop is woken once for whatever
        was pushed before it ran (not once a token: a wake-up is a system call and a loop
        turn, which 64 streams would pay 64 times a step)."""
        with self._lock:
            if self._loop is None:
                self._queue.put(item)
                return
            self._handed.append(item)
            if len(self._handed) > 1:  # a wake-up is on its way and will take this too
                return
            loop = self._loop
        try:
            loop.call_soon_threadsafe(self._move_handed)
        except RuntimeError:  # the consumer's loop closed: nobody is listening any more
            self._cancel()

    def _move_handed(self) -> None:
        """On the reader's loop: what the engine pushed, into the queue the reader awaits."""
        with self._lock:
            handed, self._handed = self._handed, []
        assert self._async_queue is not None
        for item in handed:
            self._async_queue.put_nowait(item)

    def __iter__(self) -> Iterator[Delta]:
        while not self.finished:
            yield self._unwrap(self._queue.get())

    async def stream(self) -> AsyncIterator[Delta]:
        """Deltas without blocking the event loop; leaving early cancels the request. Deltas
        that arrived while the reader was busy come joined as one, so a reader that fell
        behind (64 streams on one loop) catches up in one event, not one per token."""
        self._bind(asyncio.get_running_loop())
        queued = self._async_queue
        assert queued is not None
        try:
            while not self.finished:
                item = await queued.get()
                waiting: list[Delta] = []
                while isinstance(item, Delta) and item.finish_reason is None and not queued.empty():
                    waiting.append(item)
                    item = queued.get_nowait()
                if waiting and isinstance(item, Delta):
                    item = Delta.joined([*waiting, item])
                elif waiting:  # deltas, then the request's failure: the text first
                    yield Delta.joined(waiting)
                yield self._unwrap(item)
        finally:
            if not self.finished:
                self.cancel()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Switch delivery to the loop, moving over what arrived before."""
        with self._lock:
            self._loop = loop
            self._async_queue = asyncio.Queue()
            while not self._queue.empty():
                self._async_queue.put_nowait(self._queue.get())

    def _unwrap(self, item: Delta | BaseException) -> Delta:
        if isinstance(item, BaseException):
            self.finished = True
            cause = f"{type(item).__name__}: {item}"
            raise RequestFailed(f"request {self.request_id} failed: {cause}") from item
        self.finished = item.finish_reason is not None
        return item
