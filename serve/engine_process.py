"""The engine in a process of its own: how `flare serve` runs a generating package.

The API's event loop (HTTP, an event per streamed delta) and the engine's step loop each
need a good share of a core once a few dozen streams run. In one process they take turns
under one GIL: on the H200 at 16 and 64 streams, the two threads' busy shares summed to one
core (0.97 and 0.99, docs/performance.md), and the streams got 58% and 29% of what the engine
does alone. So the engine runs in a child process, as vLLM's engine core does: the child
loads the runtime and runs the step loop (detokenizing and cutting at stop strings there, as
before); the API process keeps HTTP, validation, chat templates and tokenizing, and an
`EngineClient`, which the API uses as it would the runtime itself.

The two talk over a pipe (multiprocessing's Connection: pickled messages, length-framed):
- API to engine: ("submit", rid, prompt, params), ("cancel", rid), ("call", cid, name),
  ("stop", drain).
- Engine to API: first ("ready", Ready) or ("failed", LoadFailure); then ("events", [...]),
  each holding what the engine had to say since the last (for a busy engine, about a step's
  deltas): ("out", rid, Delta or the exception that ended the request) and ("reply", cid,
  value); last ("stopped",).

A load failure comes back as the flare error it was, exit code included. The engine process
ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches both processes; the API process
drains the engine after its own requests), and stops when its pipe closes (the API process
is gone). If the engine process dies (killed, out of memory), every request in flight fails
at once, new ones are refused, and /health answers 503 with the cause.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from flare.errors import FlareError
from flare.serve.artifacts import StartReport
from flare.serve.cache import HostCache
from flare.serve.engine.engine import EngineStopping, name_os_thread
from flare.serve.engine.output import Delta, RequestHandle
from flare.serve.memory_plan import MemoryPlan
from flare.serve.models.files import PackageFiles, WeightsRead
from flare.serve.runtime import (
    GenerateRuntime,
    Runtime,
    SamplingParams,
    load_runtime,
    token_budget,
)
from flare.store.package import Manifest

log = logging.getLogger(__name__)

READER_THREAD = "flare-reader"
SENDER_THREAD = "flare-sender"
"""The threads that carry deltas: the API process's reader, the engine process's sender
(named for the OS too, as the engine thread is, for top -H and the benches)."""
CALLS = frozenset({"stats", "kv_stats"})
"""The runtime's methods the API process may call in the engine process."""
CALL_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 120.0
"""How long a stopping engine may take to finish its requests and exit before it is killed
(the API has drained its own requests by then: serve/server.py)."""

Event = tuple[Any, ...]


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads: load_runtime's arguments, picklable (the host cache by
    its root, whose `quarantine_if_corrupt` the engine process calls on its own)."""

    manifest: Manifest
    files: dict[str, Path]
    device: str
    cache_root: Path | None
    options: dict[str, Any]


@dataclass(frozen=True)
class Ready:
    """What the API process needs to know of the loaded runtime."""

    context_length: int
    vocab_size: int
    attention: str
    start_report: StartReport
    memory_plan: MemoryPlan | None
    weights_read: WeightsRead | None

    @staticmethod
    def of(runtime: GenerateRuntime) -> Ready:
        return Ready(
            runtime.context_length,
            runtime.vocab_size,
            runtime.attention,
            runtime.start_report,
            runtime.memory_plan,
            runtime.package.weights_read,
        )


@dataclass(frozen=True)
class LoadFailure:
    """Why the engine process could not load the runtime: a flare error by its class (which
    carries the exit code), what and hint; anything else as an internal error, whose
    traceback the engine process printed."""

    kind: type[FlareError]
    what: str
    hint: str

    @staticmethod
    def of(exc: BaseException) -> LoadFailure:
        if isinstance(exc, FlareError):
            return LoadFailure(type(exc), exc.what, exc.hint)
        log.error("the engine process could not load the runtime", exc_info=exc)
        what = f"loading the runtime failed: {type(exc).__name__}: {exc}"
        return LoadFailure(FlareError, what, "")

    def error(self) -> FlareError:
        """The error as the loading code raised it. Built without its class's own __init__,
        whose arguments vary by class; what and hint are all that any of them prints."""
        error = self.kind.__new__(self.kind)
        FlareError.__init__(error, self.what, self.hint)
        return error


# -- the API process --------------------------------------------------------------------------


def start_engine(spec: EngineSpec, package: PackageFiles) -> EngineClient:
    """Start the engine process and wait until it has loaded the runtime; its load error is
    raised here as the flare error it was. `package` is the same package, read here for the
    tokenizer, chat template and settings the API needs."""
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
    ours, theirs = context.Pipe()
    process = context.Process(
        target=engine_main, args=(theirs, spec), name="flare-engine", daemon=True
    )
    process.start()
    theirs.close()
    try:
        kind, value = ours.recv()
    except EOFError:
        process.join()
        raise FlareError(
            f"the engine process {_exit_text(process.exitcode)} while it loaded "
            f"{spec.manifest.name}",
            "see the messages above; out of memory is the usual cause",
        ) from None
    except BaseException:  # interrupted while it loads: it ignores signals, so stop it here
        process.kill()
        raise
    if kind == "failed":
        process.join()
        raise value.error()
    return EngineClient(process, ours, package, value)


class EngineClient(Runtime):
    """The runtime as the API process sees it: requests go to the engine process, their
    deltas come back to RequestHandles here, read by the API as from an in-process runtime."""

    kind = "generate"

    def __init__(
        self, process: BaseProcess, conn: Connection, package: PackageFiles, ready: Ready
    ) -> None:
        super().__init__(package, ready.context_length)
        package.weights_read = ready.weights_read
        self.vocab_size = ready.vocab_size
        self.attention = ready.attention
        self.start_report = ready.start_report
        self.memory_plan = ready.memory_plan
        self._process = process
        self._conn = conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        """Guards the open requests and calls against the engine's loss."""
        self._handles: dict[int, RequestHandle] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._reader = threading.Thread(target=self._read, name="flare-engine-reader", daemon=True)
        self._reader.start()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request in the engine process; raises ValueError for a prompt or budget
        this model cannot take, EngineStopping once stopping (or once the engine is lost)."""
        token_budget(prompt_token_ids, params, self.context_length, self.vocab_size)
        rid = next(self._ids)
        handle = RequestHandle(rid, lambda: self._send(("cancel", rid)))
        with self._lock:
            if not self._accepting or self.failure is not None:
                raise EngineStopping("the engine is stopping and takes no new requests")
            self._handles[rid] = handle
        self._send(("submit", rid, prompt_token_ids, params))
        return handle

    def stats(self) -> dict[str, float]:
        return self._call("stats")

    def kv_stats(self) -> dict[str, int]:
        return self._call("kv_stats")

    def stop(self, drain: bool = True) -> None:
        """Stop the engine process: it finishes (drain) or cancels its requests, then exits;
        one that outlives STOP_TIMEOUT_S is killed."""
        with self._lock:
            self._accepting = False
        self._send(("stop", drain))
        self._reader.join(STOP_TIMEOUT_S)
        self._process.join(1 if self._reader.is_alive() else STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.error("the engine process did not stop in time; killing it")
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _call(self, name: str) -> Any:
        """A runtime method's value from the engine process ({} once the engine is lost)."""
        cid = next(self._ids)
        future: Future[Any] = Future()
        with self._lock:
            if self.failure is not None:
                return {}
            self._calls[cid] = future
        self._send(("call", cid, name))
        return future.result(CALL_TIMEOUT_S)

    def _send(self, message: Event) -> None:
        """To the engine process; once it is gone, nothing (the reader fails what was open)."""
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:
            pass

    def _read(self) -> None:
        """The reader thread: the engine process's events, to their handles and calls, until
        it says it stopped; a pipe that breaks first means the engine process is lost."""
        name_os_thread(READER_THREAD)
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "stopped":
                    return
                self._dispatch(message[1])
        except (EOFError, OSError):
            self._lost()

    def _dispatch(self, events: list[Event]) -> None:
        """One message's events: replies to their calls, outputs pushed to their handles
        together (the readers' loop woken once for all of them)."""
        pushes = []
        with self._lock:
            for kind, key, value in events:
                if kind == "reply":
                    _settle(self._calls.pop(key), value)
                    continue
                item = Delta(*value) if isinstance(value, tuple) else value
                handle = self._handles.get(key)
                if handle is not None:
                    pushes.append((handle, item))
                    if _final(item):
                        del self._handles[key]
        RequestHandle.push_all(pushes)

    def _lost(self) -> None:
        """The engine process ended without being told to: fail everything open, refuse the
        rest, say why on /health."""
        self._process.join(5)
        cause = f"the engine process {_exit_text(self._process.exitcode)}"
        log.error("%s; failing the requests in flight", cause)
        with self._lock:
            self.failure = cause
            handles, self._handles = self._handles, {}
            calls, self._calls = self._calls, {}
        for handle in handles.values():
            handle.push(RuntimeError(cause))
        for future in calls.values():
            future.set_result({})


def _settle(future: Future[Any], value: Any) -> None:
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _final(item: Delta | BaseException) -> bool:
    return isinstance(item, BaseException) or item.finish_reason is not None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# -- the engine process -----------------------------------------------------------------------


def engine_main(conn: Connection, spec: EngineSpec) -> None:
    """The engine process: load the runtime, say ready (or why not), then serve the API
    process's commands until told to stop or until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        cache = HostCache(spec.cache_root) if spec.cache_root is not None else None
        quarantine = cache.quarantine_if_corrupt if cache is not None else None
        runtime = load_runtime(
            spec.manifest, spec.files, spec.device, quarantine=quarantine, **spec.options
        )
        if not isinstance(runtime, GenerateRuntime):
            raise FlareError(f"package {spec.manifest.name} does not generate text")
    except BaseException as exc:
        conn.send(("failed", LoadFailure.of(exc)))
        return
    conn.send(("ready", Ready.of(runtime)))
    _EngineSide(conn, runtime).serve()


class _EngineSide:
    """The engine process's end: commands in on the main thread; the engine's deltas
    gathered through each step and handed over at its end (`flush`), sent on a sender thread
    (so the engine thread makes no system call for them), one message for whatever piled up
    since its last send."""

    def __init__(self, conn: Connection, runtime: GenerateRuntime) -> None:
        self.conn = conn
        self.runtime = runtime
        self.gathered: list[Event] = []
        self.gathered_lock = threading.Lock()
        self.outbox: queue.SimpleQueue[list[Event] | None] = queue.SimpleQueue()
        self.handles: dict[int, RequestHandle] = {}
        self.sender = threading.Thread(target=self._send, name=SENDER_THREAD, daemon=True)

    def serve(self) -> None:
        self.runtime.engine.after_step = self.flush
        self.runtime.start()
        self.sender.start()
        drain = False
        try:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):  # the API process is gone: nobody to drain for
                    break
                if message[0] == "stop":
                    drain = message[1]
                    break
                self._command(message)
        finally:
            self.runtime.stop(drain)
            self.flush()
            self.outbox.put(None)
            self.sender.join()
            self._post(("stopped",))

    def _command(self, message: Event) -> None:
        kind, key, *rest = message
        if kind == "submit":
            self._submit(key, *rest)
        elif kind == "cancel":
            handle = self.handles.get(key)
            if handle is not None:
                handle.cancel()
        elif kind == "call" and rest[0] in CALLS:
            try:
                value = getattr(self.runtime, rest[0])()
            except Exception as exc:
                value = exc
            self.gather(("reply", key, value))
            self.flush()

    def _submit(self, rid: int, prompt: list[int], params: SamplingParams) -> None:
        try:
            handle = self.runtime.submit(prompt, params)
        except Exception as exc:  # validated by the API process already: a stopping engine
            self.gather(("out", rid, _portable(exc)))
            self.flush()
            return
        self.handles[rid] = handle
        handle.forward(lambda item: self._out(rid, item))

    def _out(self, rid: int, item: Delta | BaseException) -> None:
        """A request's delta (or failure), pushed by the engine thread during a step. A delta
        travels as a plain tuple of its fields: a fifth of a dataclass's pickling cost, paid
        under the GIL the engine thread needs."""
        if _final(item):
            self.handles.pop(rid, None)
        if isinstance(item, Delta):
            wire = (item.text, item.token_ids, item.logprobs, item.finish_reason)
            self.gather(("out", rid, wire))
        else:
            self.gather(("out", rid, _portable(item)))

    def gather(self, event: Event) -> None:
        with self.gathered_lock:
            self.gathered.append(event)

    def flush(self) -> None:
        """Hand what was gathered to the sender (the engine's after_step, and the main
        thread's own replies)."""
        with self.gathered_lock:
            events, self.gathered = self.gathered, []
        if events:
            self.outbox.put(events)

    def _send(self) -> None:
        """The sender thread: wait for a step's events, take every step's queued behind it,
        send them as one message; end at the None that `serve` queues last."""
        name_os_thread(SENDER_THREAD)
        while True:
            batches = [self.outbox.get()]
            while not self.outbox.empty():
                batches.append(self.outbox.get())
            ending = batches[-1] is None
            events = [event for batch in batches if batch is not None for event in batch]
            if events:
                self._post(("events", events))
            if ending:
                return

    def _post(self, message: Event) -> None:
        with contextlib.suppress(OSError):  # the API process is gone: serve() sees it and stops
            self.conn.send(message)


def _portable(item: Any) -> Any:
    """`item`, or, for an exception that would not survive pickling, a RuntimeError that
    names it (the API process words it into the request's failure)."""
    if not isinstance(item, BaseException):
        return item
    try:
        pickle.loads(pickle.dumps(item))
    except Exception:
        return RuntimeError(f"{type(item).__name__}: {item}")
    return item
