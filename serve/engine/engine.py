"""The step loop: admit and cancel requests, schedule, run the model, sample, stream out.

Other threads talk to the engine only through its inbox (submissions and cancellations) and
the request handles it fills; everything else is touched by the engine thread alone.

One request can never fail another. An error in what is done for one sequence (sampling,
detokenizing, stop strings, delivery; a row of logits that cannot be sampled) ends that
sequence alone; a failed forward, or a failed sampling pass over the whole batch (a device
error), ends the sequences of its batch alone; either way the failed requests' handles raise
RequestFailed, their KV blocks are freed, and the engine goes on with every other request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from flare.errors import FlareError
from flare.serve.engine.output import Delta, RequestHandle, TextStream
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sampler import Picked, Sampler
from flare.serve.engine.scheduler import ScheduledBatch, Scheduler
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob

log = logging.getLogger(__name__)


class EngineStopping(RuntimeError):
    """The engine is stopping (draining or stopped) and takes no new requests; the request
    was not started, so the client may send it again, to this server's successor."""


@dataclass
class _Request:
    seq: Sequence
    handle: RequestHandle
    text: TextStream


@dataclass
class Counters:
    """Totals since start, for /metrics."""

    requests_finished: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_seconds: float = 0.0


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.counters = Counters()
        self._requests: dict[int, _Request] = {}
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._draining = False

    # -- other threads --------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, max_tokens: int) -> RequestHandle:
        """Queue a request; raises EngineStopping once `stop` was called."""
        if not self._accepting:
            raise EngineStopping("the engine is stopping and takes no new requests")
        seq = Sequence(prompt, params, max_tokens)
        handle = RequestHandle(seq.id, lambda: self._post(lambda: self._cancel(seq.id)))
        request = _Request(seq, handle, TextStream(self.tokenizer, params.stop))
        self._post(lambda: self._add(request))
        return handle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="flare-engine", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = True) -> None:
        """Stop taking requests; finish the ones in flight (drain) or cancel them; join."""
        self._accepting = False
        if not drain:
            self._post(self._cancel_all)
        self._post(self._begin_drain)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def abort(self, error: BaseException) -> None:
        """From any thread, when the engine can run no more steps (a tensor-parallel rank was
        lost, and the engine thread may be stuck in a collective until it times out): refuse
        new requests and end every one in flight with `error` now."""
        self._accepting = False
        for request in list(self._requests.values()):
            request.handle.push(error)

    def _post(self, action: Callable[[], None]) -> None:
        self._inbox.put(action)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while not (self._draining and not self.scheduler.has_work()):
            self._wake.wait()
            try:
                self.step()
            except Exception as exc:  # a fault of the engine's own: nothing in flight is sure
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
            if not self.scheduler.has_work() and self._inbox.empty():
                self._wake.clear()
                if not self._inbox.empty():  # posted between the check and the clear
                    self._wake.set()

    def step(self) -> None:
        """One scheduling round: take the inbox, run one batch, emit its tokens."""
        while not self._inbox.empty():
            self._inbox.get()()
        batch = self.scheduler.schedule()
        if batch is None:
            return
        started = time.perf_counter()
        try:
            logits = self.runner.run(batch.seqs, batch.prefill)
            picks = self.sampler.sample(logits, batch.seqs)
        except FlareError as exc:  # said in one line (a lost tensor-parallel rank)
            log.error("the forward of %d sequences failed: %s", len(batch.seqs), exc)
            self._fail_batch(batch, exc)
            return
        except Exception as exc:
            log.exception("the forward or sampling of %d sequences failed", len(batch.seqs))
            self._fail_batch(batch, exc)
            return
        for seq, picked in zip(batch.seqs, picks, strict=True):
            self._next_token(self._requests[seq.id], picked)
        self._count(batch, time.perf_counter() - started)

    def _next_token(self, request: _Request, picked: Picked | Exception) -> None:
        """Detokenize and emit one request's token, or fail it where its row could not be
        sampled; whatever fails here fails this request alone, and the step goes on with the
        others."""
        if isinstance(picked, Exception):
            self._fail(request, picked)
            return
        try:
            self._advance(request, *picked)
        except Exception as exc:
            self._fail(request, exc)

    def _count(self, batch: ScheduledBatch, seconds: float) -> None:
        self.counters.steps += 1
        self.counters.busy_seconds += seconds
        self.counters.generated_tokens += len(batch.seqs)

    def _advance(self, request: _Request, token: int, logprob: TokenLogprob | None) -> None:
        """Append the sampled token, decide whether the request is done, emit a delta."""
        seq = request.seq
        seq.append(token)
        eos = token in self.eos_token_ids and not seq.params.ignore_eos
        text, stopped = ("", False) if eos else request.text.push(token)
        reason = None
        if eos or stopped:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens:
            reason = "length"
        if reason == "length" or eos:
            text += request.text.flush()
        logprobs = [logprob] if logprob is not None else None
        self._emit(request, Delta(text, [token], logprobs, reason))

    def _emit(self, request: _Request, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self._retire(request)
            self.counters.requests_finished += 1
        request.handle.push(delta)

    def _retire(self, request: _Request) -> None:
        """Take the request out of the engine and free its blocks (once; again is a no-op)."""
        self.scheduler.finish(request.seq)
        self._requests.pop(request.seq.id, None)

    def _add(self, request: _Request) -> None:
        self._requests[request.seq.id] = request
        self.counters.prompt_tokens += request.seq.num_prompt_tokens
        self.scheduler.add(request.seq)

    def _cancel(self, seq_id: int) -> None:
        request = self._requests.get(seq_id)
        if request is not None:
            self._emit(request, Delta("", [], None, "cancelled"))

    def _cancel_all(self) -> None:
        for seq_id in list(self._requests):
            self._cancel(seq_id)

    def _begin_drain(self) -> None:
        self._draining = True

    def _fail(self, request: _Request, error: Exception) -> None:
        """End one request with an error: free its blocks, count it, say so in one line."""
        log.error("request %d failed: %s: %s", request.seq.id, type(error).__name__, error)
        self._retire(request)
        self.counters.requests_failed += 1
        request.handle.push(error)

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> None:
        """A forward that failed ends its batch's requests, whose blocks named this step may
        lack their KV; the other requests' KV was written by earlier steps and stays."""
        for seq in batch.seqs:
            self.scheduler.blocks.forget(seq)
            self._fail(self._requests[seq.id], error)

    def _fail_all(self, error: Exception) -> None:
        """After an error of the engine itself (not of a request or a forward): end every
        request and trust no cached block, so the engine starts clean for later requests."""
        self.scheduler.blocks.forget_cached()
        for request in list(self._requests.values()):
            self._fail(request, error)

    def stats(self) -> dict[str, float]:
        return {
            "requests_finished": self.counters.requests_finished,
            "requests_failed": self.counters.requests_failed,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "prompt_tokens": self.counters.prompt_tokens,
            "generated_tokens": self.counters.generated_tokens,
            "preemptions": self.scheduler.preemptions,
            "steps": self.counters.steps,
            "busy_seconds": self.counters.busy_seconds,
        }

    def kv_stats(self) -> dict[str, int]:
        tokens = sum(len(seq) for seq in list(self.scheduler.running))
        return {**self.scheduler.blocks.stats(), "tokens_in_cache": tokens}
