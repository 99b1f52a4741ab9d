"""The engine in a process of its own: how `flare serve` runs a generating package.

The API's event loop (HTTP, an event per streamed delta) and the engine's step loop each
need a good share of a core once a few dozen streams run. In one process they took turns
under one GIL: on the H200 at 16 and 64 streams, the two threads' busy shares summed to one
core (0.97 and 0.99, docs/performance.md), and the streams got 58% and 29% of what the engine
does alone. So the engine runs in a child process, as vLLM's engine core does: this module is
that process's side, which loads the runtime and runs the step loop (detokenizing and cutting
at stop strings there, as before); serve/engine_client.py is the API process's side, which
keeps HTTP, validation, chat templates and tokenizing.

The two talk over a pipe (multiprocessing's Connection: pickled messages, length-framed):
- API to engine: first ("load", EngineSpec); then ("submit", rid, prompt, params),
  ("cancel", rid), ("call", cid, name), ("stop", drain).
- Engine to API: first ("ready", Ready) or ("failed", LoadFailure); then ("events", [...]),
  each holding what the engine had to say since the last (for a busy engine, one step's
  deltas): ("out", rid, a delta's fields as a tuple, or the exception that ended the
  request) and ("reply", cid, value); last ("stopped",).

The process is started before the API process knows what it will load (`flare serve` starts
it first, so that its imports, torch's above all, overlap the pull); it imports the runtime
only once it ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches both processes, and the
API process drains the engine after its own requests). It stops when its pipe closes (the API
process is gone); one that was not given a package is killed (it holds nothing yet).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flare.errors import FlareError
from flare.serve import install_hashes
from flare.serve.heap import freeze_heap, uncollected
from flare.serve.thread_names import SENDER_THREAD, name_os_thread

if TYPE_CHECKING:
    from flare.serve.artifacts import StartReport
    from flare.serve.engine.output import Delta, RequestHandle
    from flare.serve.engine.sequence import SamplingParams
    from flare.serve.memory_plan import MemoryPlan
    from flare.serve.models.files import WeightsRead
    from flare.serve.runtime import GenerateRuntime
    from flare.store.package import Manifest

log = logging.getLogger(__name__)

CALLS = frozenset({"stats", "kv_stats", "stalled_for"})
"""The runtime's methods the API process may call in the engine process."""

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


class EngineProcess:
    """A started engine process that has been told nothing yet: `flare serve` starts it
    first, so that its imports overlap the pull; `close` lets it go unused (an embedding
    package, a multi-rank one)."""

    def __init__(self, device: str | None = None) -> None:
        """`device`: `--device` as given (None: CUDA where a GPU is), which the process
        prepares while it waits (`make_context`, `backend_imports`)."""
        self.device = device
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        self.conn, theirs = context.Pipe()
        self.process = context.Process(
            target=engine_main, args=(theirs, device), name="flare-engine", daemon=True
        )
        self.process.start()
        theirs.close()
        self.taken = False

    def close(self) -> None:
        """End an engine process that was not given a package; one that was belongs to its
        EngineClient, which stops it."""
        if not self.taken:  # it holds nothing yet: no device, no file of the package
            self.conn.close()
            self.process.kill()
            self.process.join()


_EARLY: list[EngineProcess] = []
"""The engine process `start_early` started, until `engine_for` takes it."""


def start_early(argv: Sequence[str]) -> None:
    """Start the engine process at the command's very start where `argv` (the command's
    arguments) asks to serve, before the CLI is imported: its own imports then overlap the
    CLI's (typer's and every command's, about a second) as well as the pull, and on a GPU
    host the engine's start, not the API process's, is the path to ready. `--device` is read
    from `argv` as typer will read it (a value it refuses reaches the engine as asked, and
    the serve command names it). An engine nobody takes (--help, a refused option) is killed
    as this process exits: it ignores SIGTERM, which is how multiprocessing would end it
    before waiting for it."""
    args = [arg for arg in argv if arg != "--debug"]
    if args[:1] != ["serve"] or "--help" in args:
        return
    device = None
    for given, following in zip(args, [*args[1:], None], strict=True):
        if given == "--device":
            device = following
        elif given.startswith("--device="):
            device = given.removeprefix("--device=")
    _EARLY.append(EngineProcess(device))
    atexit.register(_end_early)


def _end_early() -> None:
    while _EARLY:
        _EARLY.pop().close()


def engine_for(device: str | None) -> EngineProcess:
    """The engine process started early for `device`, else one started now (an early one
    for another device is ended)."""
    while _EARLY:
        early = _EARLY.pop()
        if early.device == device:
            return early
        early.close()
    return EngineProcess(device)


def engine_main(conn: Connection, device: str | None = None) -> None:
    """The engine process: prepare `device`, wait for what to load, load the runtime, say
    ready (or why not), then serve the API process's commands until told to stop or until
    its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Inductor, read at its import: nothing is compiled here once the package is loaded, and
    # a kernel the package lacks is better built in this process than by a pool of compile
    # workers (one per core, up to 32) started beside the serving. Inductor then points
    # Triton at torch's ptxas in this process, which Triton's keys include: use_cache_folder
    # pins it as the build did (serve/compiled.py).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    with uncollected():  # the start makes what lives: collected once, at its end (heap.py)
        runtime = _start(conn, device)
        if runtime is None:
            return
        freeze_heap()  # while the API process makes its app and starts listening
    _EngineSide(conn, runtime).serve()


def _start(conn: Connection, device: str | None) -> GenerateRuntime | None:
    """Prepare `device` while the pull runs, then load what the API process sends; the
    runtime once the API process was told it is ready, else None (told why not, or never
    sent a package)."""
    with uncollected(freeze=True):  # imports, nothing of a load yet: the last collection skips them
        from flare.serve.cache import HostCache  # torch's import, with the signals ignored
        from flare.serve.runtime import GenerateRuntime, load_runtime

        chosen = make_context(device)
        backends = backend_imports(chosen)
        while backends and not conn.poll():  # the pull runs on: import the backends meanwhile
            backends.pop(0)()
    try:
        kind, spec = conn.recv()
    except (EOFError, OSError):  # the API process did not need an engine after all
        return None
    assert kind == "load", kind
    began = time.time()  # the API process's ready line shows what this start took after the pull
    try:
        cache = HostCache(spec.cache_root) if spec.cache_root is not None else None
        quarantine = cache.quarantine_if_corrupt if cache is not None else None
        runtime = load_runtime(
            spec.manifest,
            spec.files,
            spec.device,
            quarantine=quarantine,
            beside_read=partial(_run_left, backends) if backends else None,
            **spec.options,
        )
        if not isinstance(runtime, GenerateRuntime):
            raise FlareError(f"package {spec.manifest.name} does not generate text")
        runtime.start_report.began = began
    except BaseException as exc:
        conn.send(("failed", LoadFailure.of(exc)))
        return None
    conn.send(("ready", Ready.of(runtime)))
    return runtime


def make_context(asked: str | None) -> str | None:
    """The device `--device` picks (None where the API process will refuse it, and name
    it), with its CUDA context made: what the weights' read needs, done while the API
    process imports and pulls (this process would only wait then)."""
    import torch

    from flare.serve.compat import choose_device

    try:
        device = choose_device(asked)
    except FlareError:
        return None
    if device == "cuda":
        torch.empty(1, device=device)  # the context: the first CUDA call makes it
    return device


def backend_imports(device: str | None) -> list[Callable[[], None]]:
    """What loading a generating package needs beyond the weights' read, in steps: on CUDA
    cuBLAS's handle, FlashInfer's import and Triton's install hash (begun on a thread of its
    own, which imports nothing: serve/install_hashes.py); elsewhere Dynamo's and Inductor's
    imports (and the precompiled graphs' loader), which a CUDA forward never needs (it calls
    flare's kernels directly: serve/artifacts.py), and Dynamo's import alone took over a
    second of the H200's host. Each used to run after the package was known, on the path to
    ready (docs/performance.md). `engine_main` runs them while the pull goes on, looking for
    the package between steps: the package known, the steps left run on the main thread
    beside the weights' read (load_runtime's `beside_read`), which takes a second or more for
    billions of parameters, rather than before it; Dynamo's and Inductor's only where the
    forward runs Inductor's graphs (`_run_left`). Never on a thread of their own, as a module
    that two threads import at once can be seen half-initialized (and such a thread slowed
    the read on the H200)."""
    if device == "cuda":  # the hash on a thread: the first kernel's load waits for it
        return [_cublas_handle, _import_flashinfer, install_hashes.start]
    return [_import_dynamo, _import_inductor]


def _run_left(steps: list[Callable[[], None]], compiler: bool) -> None:
    """The backends' steps the pull left, those the load needs: Dynamo's and Inductor's
    imports only for a forward that runs Inductor's graphs. An eager one (a package with no
    compiled forward for the device, such as a CPU package, or one the server runs eagerly)
    never calls them, and Inductor's import was half a second of a tiny CPU package's load,
    on the path to ready (docs/performance.md)."""
    for step in steps:
        if compiler or step not in COMPILER_IMPORTS:
            step()


def _cublas_handle() -> None:
    import torch

    torch.cuda.current_blas_handle()


def _import_flashinfer() -> None:
    from flare.serve import flashinfer_modules

    if flashinfer_modules.available():
        import flashinfer  # noqa: F401


def _import_dynamo() -> None:
    import torch._dynamo  # noqa: F401


def _import_inductor() -> None:
    import torch._inductor.compile_fx  # noqa: F401

    from flare.serve.compiled import AHEAD_OF_TIME

    if AHEAD_OF_TIME:
        from flare.serve import precompiled  # noqa: F401


COMPILER_IMPORTS = frozenset({_import_dynamo, _import_inductor})
"""The steps only a compiled forward needs."""


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
        elif kind == "call":
            self.gather(("reply", key, self._call(rest[0])))
            self.flush()

    def _call(self, name: str) -> Any:
        """The runtime method's value, or the exception that the API process raises for it."""
        if name not in CALLS:
            return ValueError(f"the engine process answers no call {name!r}")
        try:
            return getattr(self.runtime, name)()
        except Exception as exc:
            return _portable(exc)

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
        if ends_request(item):
            self.handles.pop(rid, None)
        if isinstance(item, BaseException):
            self.gather(("out", rid, _portable(item)))
            return
        self.gather(("out", rid, (item.text, item.token_ids, item.logprobs, item.finish_reason)))

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
        """Send one message. Pickled by `pickle` itself: `Connection.send`'s pickler copies
        the copyreg table for every message (for handles and sockets, never sent here), a
        cost the sender paid under the GIL the engine thread needs; `recv` reads it as is."""
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with contextlib.suppress(OSError):  # the API process is gone: serve() sees it and stops
            self.conn.send_bytes(data)


def ends_request(item: Delta | BaseException) -> bool:
    """Whether a request's output is its last: a failure, or a delta with a finish reason."""
    return isinstance(item, BaseException) or item.finish_reason is not None


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
