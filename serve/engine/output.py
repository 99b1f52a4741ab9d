"""What a request gives back: text deltas, cut at stop strings, streamed to its caller.

Text is decoded incrementally by the tokenizers library's `DecodeStream` (one call a token,
over a short window of tokens) and released only when it decodes cleanly, so a multi-byte
character split over tokens is never emitted in halves. What it still holds when a request
ends is decoded then, replacement characters and all, as a whole decode gives it; and a run of
tokens that never decodes cleanly (bytes of no character, which a random or broken model
emits) is released every HOLD_LIMIT tokens, since `DecodeStream` decodes all it holds again at
every token (tests/bench/bench_detokenize.py: 111-570 µs a token a thousand tokens in).
Text that could be the start of a stop string is held back until it is clearly not one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from flare.serve.engine.sequence import TokenLogprob


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


def _move_all(handles: list[RequestHandle]) -> None:
    for handle in handles:
        handle._move_handed()


def _wake(loop: asyncio.AbstractEventLoop, handles: list[RequestHandle]) -> None:
    """Have the readers' loop move what was handed to the handles into their queues."""
    try:
        loop.call_soon_threadsafe(_move_all, handles)
    except RuntimeError:  # the consumers' loop closed: nobody is listening any more
        for handle in handles:
            handle._cancel()


class RequestFailed(RuntimeError):
    """The engine ended this request with an error of its own (or of its batch's forward);
    the message names the request and the cause. Other requests were not touched."""


HOLD_LIMIT = 16
"""Tokens a stream holds before it releases all but the last KEEP of them as they decode
(replacement characters for bytes of no character): clean text holds at most 3 (a 4-byte
character in single-byte tokens)."""
KEEP = 3
"""Tokens a release keeps held: the bytes an unfinished character may already have."""
CONTEXT = 4
"""Tokens of the text the decoder last gave that a release decodes after, and primes a fresh
decoder with (a decoder's output for a token can depend on the one before it: spaces, the
start of the text)."""


class TextStream:
    """Incremental detokenizer with stop strings for one request."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []
        """Tokens the decoder holds: pushed since it last gave text."""
        self._clean: deque[int] = deque(maxlen=CONTEXT)
        """The last CONTEXT tokens of the text the decoder gave (which ends whole)."""
        self.pending = ""
        """Decoded text not yet emitted (it may begin a stop string)."""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return the text now safe to emit and whether a stop string was hit."""
        text = self._step(token_id)
        if len(self._held) >= HOLD_LIMIT:
            text += self._release(self._held[:-KEEP], self._held[-KEEP:])
        if not self.stop:  # nothing is ever held back
            return text, False
        self.pending += text
        found = [at for stop in self.stop if (at := self.pending.find(stop)) >= 0]
        if found:  # the earliest, whichever stop string it is: the text holds none of them
            return self._take(min(found)), True
        return self._take(len(self.pending) - self._held_back()), False

    def flush(self) -> str:
        """The text held back, when the request ends without a stop string: the held tokens
        decoded as they stand (an unfinished character as a replacement character)."""
        if self._held:
            self.pending += self._release(self._held, [])
        return self._take(len(self.pending))

    def _step(self, token_id: int) -> str:
        """The decoder's text for one more token ("" while it holds the token)."""
        text = self._decoder.step(self.tokenizer, token_id)
        if text is None:
            self._held.append(token_id)
            return ""
        if self._held:
            self._clean.extend(self._held)
            self._held = []
        self._clean.append(token_id)
        return text

    def _release(self, released: list[int], kept: list[int]) -> str:
        """The text of `released` (held tokens, in order) decoded after the clean tokens;
        then a fresh decoder, primed with them, steps through `kept`."""
        clean = list(self._clean)
        before = self.tokenizer.decode(clean, skip_special_tokens=True)
        after = self.tokenizer.decode(clean + released, skip_special_tokens=True)
        if not after.startswith(before):  # a decoder that rewrites what came before
            after, before = self.tokenizer.decode(released, skip_special_tokens=True), ""
        text = after[len(before) :]
        self._decoder, self._held = DecodeStream(skip_special_tokens=True), []
        for token in clean:
            self._decoder.step(self.tokenizer, token)
        return text + "".join(self._step(token) for token in kept)

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
        self._forward: Callable[[Delta | BaseException], None] | None = None
        self.finished = False

    def cancel(self) -> None:
        """Stop generating; the request's KV blocks are freed at the engine's next step."""
        if not self.finished:
            self._cancel()

    def push(self, item: Delta | BaseException) -> None:
        """Called by the engine thread. An async reader's loop is woken once for whatever
        was pushed before it ran (not once a token: a wake-up is a system call and a loop
        turn, which 64 streams would pay 64 times a step)."""
        loop = self._hand(item)
        if loop is not None:
            _wake(loop, [self])

    @staticmethod
    def push_all(pushes: Iterable[tuple[RequestHandle, Delta | BaseException]]) -> None:
        """Push to many handles at once, waking each readers' loop once for all of them (a
        step's deltas for 64 streams, as the engine process's reader hands them over)."""
        waking: dict[asyncio.AbstractEventLoop, list[RequestHandle]] = {}
        for handle, item in pushes:
            loop = handle._hand(item)
            if loop is not None:
                waking.setdefault(loop, []).append(handle)
        for loop, handles in waking.items():
            _wake(loop, handles)

    def _hand(self, item: Delta | BaseException) -> asyncio.AbstractEventLoop | None:
        """Queue, forward or hand `item` over; the loop to wake for it, if one must be."""
        with self._lock:
            if self._forward is not None:
                self._forward(item)
                return None
            if self._loop is None:
                self._queue.put(item)
                return None
            self._handed.append(item)
            # more than one: a wake-up is on its way and will take this too
            return self._loop if len(self._handed) == 1 else None

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

    def forward(self, to: Callable[[Delta | BaseException], None]) -> None:
        """Hand every item to `to` as it is pushed, those pushed before first (the engine
        process's outbox: serve/engine_process.py); the handle is then not read."""
        with self._lock:
            self._forward = to
            while not self._queue.empty():
                to(self._queue.get())

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
