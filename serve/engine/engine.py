"""The step loop: admit and cancel requests, schedule, run the model, sample, stream out.

Other threads talk to the engine only through its inbox (submissions and cancellations) and
the request handles it fills; everything else is touched by the engine thread alone.

One request can never fail another. An error in what is done for one sequence (sampling,
detokenizing, stop strings, delivery; a row of logits that cannot be sampled) ends that
sequence alone; a failed forward, or a failed sampling pass over the whole batch (a device
error), ends the sequences of its batch alone; either way the failed requests' handles raise
RequestFailed, their KV blocks are freed, and the engine goes on with every other request.

The loop keeps the device busy while the host works (`step`). Where the runner can take a
step's input tokens from the device (`ModelRunner.reads_fresh_tokens`: one process, whatever
its device), the next step is launched before the step in flight has landed: each of its
sequences counts its coming token as pending, the next step reads those tokens where the
sampler left them on the device, and only then does the host wait for the tokens, append them
and stream them, while the device runs the next step. Without it (tensor-parallel ranks, which
are sent their tokens), a step's tokens are read and appended first, then the next step is
launched, then the tokens are detokenized and streamed.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from flare.errors import FlareError
from flare.serve.engine.output import Delta, RequestHandle, TextStream
from flare.serve.engine.runner import FreshTokens, ModelRunner
from flare.serve.engine.sampler import Sampled, Sampler
from flare.serve.engine.scheduler import ScheduledBatch, Scheduler
from flare.serve.engine.sequence import SamplingParams, Sequence, TokenLogprob
from flare.serve.thread_names import ENGINE_THREAD, name_os_thread

log = logging.getLogger(__name__)

GIL_SWITCH_SECONDS = 0.00025
"""How long a thread that wants the GIL waits before the holder must hand it over (Python's
default: 5 ms). The engine thread shares the GIL with its process's other threads (the
engine process's sender and command threads; in-process, the API's event loop): with the
default, each of the engine's calls that lets go of it (a graph replay, a wait for the
device) could cost it up to 5 ms to get it back from a busy thread, several times a step.
The API process takes the same interval for its event loop (serve/engine_client.py)."""


class EngineStopping(RuntimeError):
    """The engine is stopping (draining or stopped) and takes no new requests; the request
    was not started, so the client may send it again, to this server's successor."""


@dataclass
class _Request:
    seq: Sequence
    handle: RequestHandle
    text: TextStream


@dataclass
class _Flight:
    """A step launched and not yet landed: its batch, its sampling (on a GPU, still being
    computed), when it was launched."""

    batch: ScheduledBatch
    sampled: Sampled
    started: float

    def fresh(self) -> FreshTokens:
        """Its tokens where the next step reads them: on the device, by sequence."""
        rows = {seq.id: row for row, seq in enumerate(self.batch.seqs)}
        return FreshTokens(self.sampled.tokens, rows)


@dataclass
class Counters:
    """Totals since start, for /metrics."""

    requests_finished: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    step_seconds: float = 0.0
    """The engine thread's time in its steps (each step and its hand-over of deltas)."""
    device_wait_seconds: float = 0.0
    """Of that, the time waiting for a step's tokens from the device: the rest is the host
    loop's own work, which bounds the steps a second where it is longer than the device's."""


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
        self._flight: _Flight | None = None
        self._landed_at = 0.0
        self._beat = time.monotonic()
        """When the engine thread last finished a step, or was last given work while idle."""
        self.overlap = runner.reads_fresh_tokens
        """Whether the next step is launched before the step in flight lands."""
        self.after_step: Callable[[], None] | None = None
        """Called on the engine thread after each step, whatever it emitted pushed: where the
        deltas cross to another process, a step's deltas leave in one message."""

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
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=ENGINE_THREAD, daemon=True)
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

    def busy(self) -> bool:
        """Whether a request waits or runs, or a step is in flight (not yet landed)."""
        return self.scheduler.has_work() or self._flight is not None

    def stalled_for(self) -> float:
        """Seconds the engine thread has had work and finished no step (0 while it has none):
        a watchdog's figure. A step past the serve's stall timeout is a hang (a device or a
        collective that never returns, the thread frozen), not a slow step: a step is
        milliseconds on a GPU, and a CPU's longest prefill a few seconds."""
        if not self._wake.is_set():
            return 0.0
        return max(0.0, time.monotonic() - self._beat)

    def _post(self, action: Callable[[], None]) -> None:
        if not self._wake.is_set():  # an idle engine's clock starts when work reaches it
            self._beat = time.monotonic()
        self._inbox.put(action)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        name_os_thread(ENGINE_THREAD)
        while not (self._draining and not self.busy()):
            self._wake.wait()
            started = time.perf_counter()
            try:
                self.step()
            except Exception as exc:  # a fault of the engine's own: nothing in flight is sure
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
            if self.after_step is not None:
                self.after_step()
            self.counters.step_seconds += time.perf_counter() - started
            self._beat = time.monotonic()
            if not self.busy() and self._inbox.empty():
                self._wake.clear()
                if not self._inbox.empty():  # posted between the check and the clear
                    self._wake.set()

    def step(self) -> None:
        """One scheduling round: take the inbox; launch the next step and land the one in
        flight (read its tokens, the one wait for the device), in that order where the runner
        reads fresh tokens on the device, else the other way round; then detokenize and
        stream the landed tokens while the device runs the next step.

        A request a stop string ends has had one more step launched (its text is checked
        after), and with the overlap so has one that end of sequence ends (its token was not
        known at the launch); that step's token for it is dropped (the request has left the
        engine). max_tokens, known from the count alone, ends a request before the next step."""
        while not self._inbox.empty():
            self._inbox.get()()
        flight = self._flight
        if self.overlap and flight is not None:
            self._count_pending(flight)
            self._flight = self._launch(flight.fresh())
            landed = self._land(flight)
        else:
            landed = self._land(flight)
            self._flight = self._launch(None)
        for request, token, logprob in landed:
            self._deliver(request, token, logprob)

    def _count_pending(self, flight: _Flight) -> None:
        """Before the next step is scheduled: each live sequence of the step in flight counts
        the token it is sampling as pending, unless that token is its last (max_tokens), in
        which case it is scheduled no more."""
        for seq in flight.batch.seqs:
            if seq.id not in self._requests:
                continue
            if seq.num_output_tokens + 1 >= seq.max_tokens:
                self.scheduler.set_aside(seq)
            else:
                seq.append_pending()

    def _launch(self, fresh: FreshTokens | None) -> _Flight | None:
        """Schedule and start the next step's forward and sampling (on a GPU they run on while
        the host goes on); a step that fails at once fails its batch alone."""
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        started = time.perf_counter()
        try:
            step = self.runner.run(batch.seqs, batch.prefill, fresh)
            sampled = self.sampler.launch(step.logits, batch.seqs, step.maxima)
        except Exception as exc:
            self._forward_failed(batch, exc)
            return None
        return _Flight(batch, sampled, started)

    def _land(self, flight: _Flight | None) -> list[tuple[_Request, int, TokenLogprob | None]]:
        """The flight's tokens, set in their sequences (a pending token resolved, else
        appended): those that end them are emitted now (so their blocks are free for the
        next step), the others returned to be delivered once the next step is launched. Rows
        of requests that left the engine while the step ran (cancelled, stopped, failed) are
        dropped."""
        if flight is None:
            return []
        batch = flight.batch
        waited = time.perf_counter()
        try:
            picks = flight.sampled.read()
        except Exception as exc:  # the forward's own failure surfaces at the first read
            self._forward_failed(batch, exc)
            return []
        finally:
            self.counters.device_wait_seconds += time.perf_counter() - waited
        landed = []
        for seq, picked in zip(batch.seqs, picks, strict=True):
            request = self._requests.get(seq.id)
            if request is None:
                continue
            if isinstance(picked, Exception):
                self._fail(request, picked)
                continue
            token, logprob = picked
            self._set_token(seq, token)
            self.counters.generated_tokens += 1
            if self._ends(seq, token):
                self._deliver(request, token, logprob)
            else:
                landed.append((request, token, logprob))
        self._count_step(flight)
        return landed

    def _set_token(self, seq: Sequence, token: int) -> None:
        if seq.pending:
            seq.resolve(token)
            self.scheduler.blocks.name_newest(seq)
        else:
            seq.append(token)

    def _count_step(self, flight: _Flight) -> None:
        """Count the step, and the time the device was busy with it: from its launch, or from
        the landing of the step before it where the two overlapped."""
        now = time.perf_counter()
        self.counters.steps += 1
        self.counters.busy_seconds += now - max(flight.started, self._landed_at)
        self._landed_at = now

    def _forward_failed(self, batch: ScheduledBatch, exc: Exception) -> None:
        if isinstance(exc, FlareError):  # said in one line (a lost tensor-parallel rank)
            log.error("the forward of %d sequences failed: %s", len(batch.seqs), exc)
        else:
            log.exception("the forward of %d sequences failed", len(batch.seqs), exc_info=exc)
        self._fail_batch(batch, exc)

    def _ends(self, seq: Sequence, token: int) -> bool:
        """Whether the token alone ends its sequence: end of sequence, or max_tokens."""
        return self._is_eos(seq, token) or seq.num_output_tokens >= seq.max_tokens

    def _is_eos(self, seq: Sequence, token: int) -> bool:
        return token in self.eos_token_ids and not seq.params.ignore_eos

    def _deliver(self, request: _Request, token: int, logprob: TokenLogprob | None) -> None:
        """Detokenize and emit a landed token, unless its request left the engine meanwhile
        (a failed launch); whatever fails here fails this request alone."""
        if request.seq.id not in self._requests:
            return
        try:
            self._advance(request, token, logprob)
        except Exception as exc:
            self._fail(request, exc)

    def _advance(self, request: _Request, token: int, logprob: TokenLogprob | None) -> None:
        """Decide whether the request is done with its appended token, emit a delta."""
        seq = request.seq
        eos = self._is_eos(seq, token)
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
            request = self._requests.get(seq.id)
            if request is not None:  # not one that left the engine while the step ran
                self._fail(request, error)

    def _fail_all(self, error: Exception) -> None:
        """After an error of the engine itself (not of a request or a forward): end every
        request and trust no cached block, so the engine starts clean for later requests."""
        self._flight = None
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
            "step_seconds": self.counters.step_seconds,
            "device_wait_seconds": self.counters.device_wait_seconds,
        }

    def kv_stats(self) -> dict[str, int]:
        tokens = sum(len(seq) for seq in list(self.scheduler.running))
        return {**self.scheduler.blocks.stats(), "tokens_in_cache": tokens}
