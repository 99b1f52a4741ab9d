"""The API process's side of the engine process (serve/engine_process.py, which says why
the engine runs apart and what crosses the pipe): start it, have it load the package, and an
`EngineClient` that the API uses as it would the runtime itself.

A load failure in the engine process is raised here as the flare error it was, exit code
included. If the engine process dies (killed, out of memory), every request in flight fails at
once with the cause, new ones are refused, /health answers 503 saying it, and the server stops
(`Runtime.on_lost`) and exits 1.

An engine that hangs instead (a device call or collective that never returns, the process
frozen by a signal or a debugger) is found by a watchdog: past the stall timeout without a
step while it has work, or without an answer, /health answers 503 `stalled` saying which, and
ok again once it steps. Nothing is failed meanwhile: a hang that ends finishes its requests.
Messages to the engine process are written by a thread of their own, so a full pipe to a
process that stopped reading never blocks the API's event loop, /health included.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from flare.errors import FlareError
from flare.serve.engine.engine import GIL_SWITCH_SECONDS, EngineStopping
from flare.serve.engine.output import Delta, RequestHandle
from flare.serve.engine_process import (
    STOP_TIMEOUT_S,
    EngineProcess,
    EngineSpec,
    Event,
    Ready,
    ends_request,
)
from flare.serve.heap import freeze_heap
from flare.serve.models.files import PackageFiles
from flare.serve.package_text import PackageText, read_text
from flare.serve.runtime import Runtime, SamplingParams, token_budget
from flare.serve.thread_names import (
    READER_THREAD,
    WATCHDOG_THREAD,
    WRITER_THREAD,
    name_os_thread,
)

log = logging.getLogger(__name__)

WATCH_EVERY_S = 1.0
"""How often the watchdog asks the engine process how long its engine has been stuck."""
FIGURES_WAIT_S = 2.0
"""How long a scrape waits for the engine's figures (a live engine answers in
milliseconds); one does not wait at all on an engine process that has been silent for two of
the watchdog's questions."""


def start_engine(
    spec: EngineSpec, package: PackageFiles, engine: EngineProcess, stall_timeout: float
) -> EngineClient:
    """Have `engine` load the package and wait until it has; its load error is raised here as
    the flare error it was. `package` is the same package, whose text side (tokenizer, chat
    template, settings, the prompt bound) the API reads here while the engine loads: read
    after, it held the ready line back (serve/package_text.py). A package whose text side is
    malformed is refused at once, and the engine stopped."""
    engine.taken = True
    ours, process = engine.conn, engine.process
    try:
        ours.send(("load", spec))
        text = read_text(package)
        if text.chars_per_token is None:
            log.info("%s's tokenizer gives no prompt length bound", spec.manifest.name)
        freeze_heap()  # start-up's objects: the freeze once the app is made walks the rest only
        kind, value = ours.recv()
    except (EOFError, OSError):
        process.join()
        raise FlareError(
            f"the engine process {_exit_text(process.exitcode)} while it loaded "
            f"{spec.manifest.name}",
            "see the messages above; out of memory is the usual cause",
        ) from None
    except BaseException:  # interrupted, or a malformed package: it ignores signals, so stop it
        process.kill()
        process.join()
        raise
    if kind == "failed":
        process.join()
        raise value.error()
    return EngineClient(process, ours, package, value, text, stall_timeout)


class EngineClient(Runtime):
    """The runtime as the API process sees it: requests go to the engine process, their
    deltas come back to RequestHandles here, read by the API as from an in-process runtime."""

    kind = "generate"

    def __init__(
        self,
        process: BaseProcess,
        conn: Connection,
        package: PackageFiles,
        ready: Ready,
        text: PackageText,
        stall_timeout: float,
    ) -> None:
        super().__init__(package, ready.context_length, text)
        package.weights_read = ready.weights_read
        self.vocab_size = ready.vocab_size
        self.attention = ready.attention
        self.start_report = ready.start_report
        self.memory_plan = ready.memory_plan
        self._process = process
        self._conn = conn
        self._outbox: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        """Guards the open requests and calls against the engine's loss."""
        self._handles: dict[int, RequestHandle] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count()
        self._accepting = True
        self.stall_timeout = stall_timeout
        self.stalled_seconds = 0.0
        """The engine's time stuck, as the watchdog last saw it (0 when it steps)."""
        self._heard_at = time.monotonic()
        """When the engine process last sent anything: the watchdog asks it every second."""
        self._closed = threading.Event()
        sys.setswitchinterval(GIL_SWITCH_SECONDS)
        self._reader = threading.Thread(target=self._read, name=READER_THREAD, daemon=True)
        self._reader.start()
        threading.Thread(target=self._write, name=WRITER_THREAD, daemon=True).start()
        threading.Thread(target=self._watch, name=WATCHDOG_THREAD, daemon=True).start()

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
        """The engine's figures, and how long it has been stuck; only the latter from an
        engine process that does not answer (a scrape must not wait on a hung engine)."""
        return {**self._figures("stats"), "engine_stalled_seconds": self.stalled_seconds}

    def kv_stats(self) -> dict[str, int]:
        return self._figures("kv_stats")

    def _figures(self, name: str) -> dict[str, Any]:
        if time.monotonic() - self._heard_at > 2 * WATCH_EVERY_S:
            return {}
        try:
            return self._ask(name).result(FIGURES_WAIT_S)
        except TimeoutError:
            return {}

    def stop(self, drain: bool = True) -> None:
        """Stop the engine process: it finishes (drain) or cancels its requests, then exits;
        one that outlives STOP_TIMEOUT_S is killed."""
        with self._lock:
            self._accepting = False
        self._closed.set()
        self._send(("stop", drain))
        self._outbox.put(None)
        self._reader.join(STOP_TIMEOUT_S)
        self._process.join(1 if self._reader.is_alive() else STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.error("the engine process did not stop in time; killing it")
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _ask(self, name: str) -> Future[Any]:
        """Ask the engine process for a runtime method's value: its future, settled by the
        reader when the answer comes (with {} once the engine is lost)."""
        cid = next(self._ids)
        future: Future[Any] = Future()
        with self._lock:
            if self.failure is not None:
                future.set_result({})
                return future
            self._calls[cid] = future
        self._send(("call", cid, name))
        return future

    def _send(self, message: Event) -> None:
        """To the engine process, by the writer thread: the caller never waits on the pipe."""
        self._outbox.put(message)

    def _write(self) -> None:
        """The writer thread: messages to the engine process in their order, until the None
        that `stop` queues; once the process is gone, nothing (the reader fails what was
        open)."""
        name_os_thread(WRITER_THREAD)
        while (message := self._outbox.get()) is not None:
            with contextlib.suppress(OSError):
                self._conn.send(message)

    def _watch(self) -> None:
        """The watchdog thread: every second, how long the engine has had work and finished
        no step (one question in flight at a time); past the stall timeout, or with nothing
        heard from the engine process in that time, the runtime is stalled (/health says so)
        until the engine steps again."""
        name_os_thread(WATCHDOG_THREAD)
        asked: Future[Any] | None = None
        stuck = 0.0
        while not self._closed.wait(min(WATCH_EVERY_S, self.stall_timeout / 4)):
            if asked is None or asked.done():
                stuck = asked.result() if asked is not None else stuck
                if self.failure is not None:
                    return
                asked = self._ask("stalled_for")
            silent = time.monotonic() - self._heard_at
            if silent >= self.stall_timeout:
                self._set_stall(f"the engine process has not answered for {silent:.0f} s", silent)
            elif stuck >= self.stall_timeout:
                cause = f"the engine has finished no step for {stuck:.0f} s with requests waiting"
                self._set_stall(cause, stuck)
            else:
                self._set_stall(None, 0.0)

    def _set_stall(self, cause: str | None, seconds: float) -> None:
        """Record the watchdog's finding; log when the engine stalls and when it goes on."""
        if cause is not None and self.stall is None:
            log.error("%s; /health answers 503 until it goes on", cause)
        elif cause is None and self.stall is not None:
            log.warning("the engine goes on after a stall (%s)", self.stall)
        self.stall = cause
        self.stalled_seconds = seconds

    def _read(self) -> None:
        """The reader thread: the engine process's events, to their handles and calls, until
        it says it stopped; a pipe that breaks first means the engine process is lost."""
        name_os_thread(READER_THREAD)
        try:
            while True:
                message = self._conn.recv()
                self._heard_at = time.monotonic()
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
                    if ends_request(item):
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
        if self.on_lost is not None:
            self.on_lost()


def _settle(future: Future[Any], value: Any) -> None:
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
