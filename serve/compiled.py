"""The compiled forward: a model's decoder layer and its logits compiled, for every batch.

One graph runs every decoder layer after the first (which has no residual yet, and a graph of
its own), one computes the last positions' logits; each is compiled once, with the token and
sequence dimensions unbacked, so it serves prefills and decodes of any size with no
recompile; attention is the opaque `flare::paged_attention` operator
(engine/attention_op.py). Weights are the graphs' inputs, never their constants, so a
compiled forward holds code only and any package of the same shapes can run it.

`flare build` compiles it (serve/prepare.py, in a fresh process and Inductor cache), each
graph ahead of time (serve/precompiled.py), and ships the graphs with Inductor's cache folder
as an artifact (serve/inductor_archive.py); `flare serve` unpacks it, points Inductor at it,
loads the graphs and runs `warm_up` before it says ready: nothing is traced or compiled. A
package whose graphs do not load here (built before they were saved, or with another torch
or GPU) has each graph traced and compiled at its first call, its kernels found in the cache.
Both sides apply `settings()` first: Inductor keys its cache by its configuration.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.torch_version import TorchVersion

from flare.serve import compilations
from flare.serve.engine.attention import AttentionBackend
from flare.serve.engine.attention_op import OperatorAttention, bound_attention
from flare.serve.engine.block_manager import BlockManager
from flare.serve.engine.runner import ModelRunner
from flare.serve.engine.sequence import SamplingParams, Sequence

MARCH = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}
"""The baseline each x86 ISA level compiles for, instead of -march=native: a kernel built
on one CPU of a level runs on every other of that level (the ISA's own flags, such as
-mavx512bf16, come from the features the toolchain records)."""

WARM_UP = ((3, 5), (1,))
"""The prompt lengths of warm-up's batches, each prefilled then decoded once: two sequences
together, then one of a single token. Shorter than a KV block, so nothing enters the prefix
cache."""

KINDS = ("first", "layers", "logits")
"""The forward's graphs: the first decoder layer's (no residual yet), the other layers',
the logits'."""

AHEAD_OF_TIME = TorchVersion(torch.__version__) >= (2, 11)
"""Whether the forward's graphs are compiled ahead of time, saved and loaded
(serve/precompiled.py): Dynamo's ahead-of-time compile, an experimental API of torch 2.11
(off by a setting there, on by default in 2.13) whose internals change between releases.
Before 2.11, each graph is traced at its first call, a start included."""

_installed = False


def settings() -> None:
    """Configure Inductor as every flare compile and load does (idempotent).

    The choices are part of Inductor's cache keys, so build and serve must make the same:
    single-threaded fused kernels (matrix products still run on torch's threads): at decode
    sizes an OpenMP region per kernel cost more than it saved (tiny Llama decode 0.21x eager
    with them, 0.9-1.2x without: docs/performance.md), and no thread count is compiled in;
    ISA detection from the CPU's flags (not by building a probe per ISA, 17 s here); a fixed
    -march per ISA level; no precompiled headers (with them, loading a kernel runs the
    preprocessor to key the header); the compiler hook below; and on GPUs that take it,
    Triton kernels that launch as dependents of the kernel ahead
    (serve/engine/dependent_launch.py).

    And Dynamo's: no automatic dynamic shapes. The forward's graphs are dynamic in exactly
    the dimensions it marks (tokens, rows); Dynamo would otherwise make any other dimension
    dynamic once a second model of other sizes traced the same code in the process (a
    layer's rotary rows, which only the attention operator reads, after a model of another
    head size), a graph the package does not hold."""
    global _installed
    if _installed:
        return
    import torch._inductor.config as inductor

    torch._dynamo.config.automatic_dynamic_shapes = False
    inductor.cpp.threads = 1
    inductor.cpp.vec_isa_ok = True
    if hasattr(inductor.cpp, "march"):  # not in torch 2.11: -march=native there, CPU only
        inductor.cpp.march = MARCH.get(torch.backends.cpu.get_cpu_capability())
    inductor.triton.enable_pdl = True
    if hasattr(inductor, "cpp_cache_precompile_headers"):
        inductor.cpp_cache_precompile_headers = False
    _hook_compiler()
    compilations.watch()
    _installed = True


def _hook_compiler() -> None:
    """Every C++ build Inductor runs, counted, and with source paths made relative.

    Inductor compiles `<cache dir>/xx/<key>.cpp` by absolute path, and its bounds checks
    (TORCH_CHECK) embed __FILE__, as does the debug line table, so a kernel built in another
    cache folder differed in those bytes; mapping the cache folder away makes the same source
    give the same shared object wherever it is built. The cache keys do not include the map: they
    are computed before the command runs."""
    from torch._inductor import cpp_builder
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    run = cpp_builder.run_compile_cmd

    def compile_relative(cmd_line: str, cwd: str) -> None:
        sources = [Path(part).name for part in shlex.split(cmd_line) if part.endswith(".cpp")]
        compilations.note_kernel(sources[0] if sources else "a C++ kernel")
        maps = (f"{cache_dir()}/=",)
        run(cmd_line + "".join(f" {shlex.quote('-ffile-prefix-map=' + m)}" for m in maps), cwd)

    cpp_builder.run_compile_cmd = compile_relative


def use_cache_folder(folder: Path) -> None:
    """Point Inductor, and Triton, at `folder` (read at every lookup, so before the first
    compile). Triton's cache is the one Inductor would choose for GPU 0, named for every GPU:
    a kernel that Triton compiles in this process rather than in Inductor's compile workers (on
    its first launch) lands in the folder that is packed, and a server finds it there."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton" / "0")
    pin_triton_ptxas()


def pin_triton_ptxas() -> None:
    """Point Triton at torch's own ptxas, now, before anything compiles, as Inductor does in
    the processes that compile its kernels (its compile workers at build, the process itself
    where it compiles on one thread). Triton keys every kernel with its ptxas's version, so a
    kernel flare launches itself (`few_rows`, the KV store, the norm) keyed with Triton's
    ptxas at build and with torch's at serve was missed in the package and built again at
    every start (tests/bench/gpu_start_kernels.py). Inductor's own setter is not called: its
    import imports Dynamo and Inductor, which a CUDA start, whose forward calls flare's
    kernels directly, never needs. Its rule is kept: torch's `bin/ptxas` (where torch 2.11's
    CUDA wheel has it) where that is an executable file, unless TRITON_PTXAS_PATH is set."""
    ptxas = Path(torch.__file__).parent / "bin" / "ptxas"
    if "TRITON_PTXAS_PATH" not in os.environ and ptxas.is_file() and os.access(ptxas, os.X_OK):
        os.environ["TRITON_PTXAS_PATH"] = str(ptxas)


class CompiledForward:
    """A model's step with its decoder layers and its logits compiled: (input ids, positions,
    last rows) → logits.

    Every decoder layer runs one compiled graph, the same code for all of them (their weights
    are its inputs, and so is the layer index its attention reads), so a build compiles one
    layer, not the whole stack, and a start loads it (or, where it traces, traces one layer:
    bench_trace_layers.py, 0.71 s for 16 and for 32 layers, against 1.72 and 3.2 s for the
    whole step). The first layer, which has no residual
    yet, is a graph of its own; the embedding lookup, the rotary rows' gather and the final
    norm run as they are between the graphs, one kernel each."""

    def __init__(self, model: Any, saved: Path | None = None) -> None:
        """`saved`: a folder of precompiled graphs to load (what the package's build
        saved); a graph not loaded from it is traced and compiled at its first call."""
        settings()
        self.model = model
        self._operator = OperatorAttention()
        self._graphs: dict[str, Callable[..., Any]] = {}
        self._compiled: dict[str, bytes] = {}
        """The bytes of each graph compiled here (not loaded), as `precompiled` saves them."""
        self._unchecked: set[str] = set()
        """The loaded graphs not called yet (see `_first_call`)."""
        self.not_loaded = ""
        """Why the saved graphs were not loaded, where they were not (then they are traced)."""
        self.not_ahead = ""
        """Why this forward's graphs were traced rather than compiled ahead of time, where
        the ahead-of-time compile failed (then nothing is saved)."""
        self._ahead_entries: set[Path] = set()
        """The AOTAutograd cache entries the ahead-of-time compiles wrote (see `_compile`)."""
        if saved is not None and AHEAD_OF_TIME:
            self._load(saved)

    @property
    def graphs(self) -> int:
        """The graphs a warm-up makes: the first layer's, the other layers' (where there
        are others) and the logits'. More would be a recompile, which a batch must not cause."""
        return 1 + min(len(self.model.model.layers), 2)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        with bound_attention(attention):
            hidden = self.model.forward(input_ids, positions, self._operator, self._call_layer)
            return self._run("logits", _run_logits, self.model, hidden, last)

    def save(self, folder: Path) -> None:
        """Write every graph this forward compiled to `folder`, for a start to load (one it
        loaded is there already): all or none, as a package's graphs are loaded all or none
        and its archive keeps AOTAutograd's entries only where there are none."""
        from flare.serve import precompiled

        if self.not_ahead:
            return
        for kind, data in self._compiled.items():
            precompiled.save(data, folder, kind)

    def trust_guards(self) -> None:
        """Call the ahead-of-time graphs without checking their guards first, once a
        warm-up has run each of them on every layer (a refused guard raises there; nothing
        recompiles): the check takes tens of microseconds a layer call on the H200's host,
        and the calls after the warm-up are the graphs' captures and the steps too long for
        a graph, on the same tensors of other lengths (a length no guard checks)."""
        from flare.serve import precompiled

        for graph in self._graphs.values():
            if isinstance(graph, precompiled.AOTCompiledFunction):
                graph.disable_guard_check()

    def _load(self, folder: Path) -> None:
        """Load the graphs saved in `folder`; none where one does not load here (a torch,
        Python or GPU other than the build's): the forward is traced instead, and says why."""
        from flare.serve import precompiled

        graphs = {}
        try:
            for kind in KINDS:
                data = precompiled.read(folder, kind)
                if data is not None:
                    graphs[kind] = precompiled.load(data)
        except Exception as exc:  # whatever the loader raises: trace instead, and say why
            self.not_loaded = _described(exc)
            return
        self._graphs, self._unchecked = graphs, set(graphs)
        for _ in graphs:
            compilations.note("loaded")

    def _call_layer(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: torch.Tensor,
        attention: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "first" if residual is None else "layers"
        return self._run(kind, _run_layer, layer, x, residual, rotary, attention)

    def _run(self, kind: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`kind`'s graph called on `args`; at its first call, where it was not loaded,
        traced and compiled from `fn` on them (their first dimension unbacked)."""
        graph = self._graphs.get(kind)
        if graph is not None and kind in self._unchecked:
            return self._first_call(kind, fn, graph, args)
        if graph is None:
            graph = self._graphs[kind] = self._compile(kind, fn, args)
        return graph(*args)

    def _first_call(
        self, kind: str, fn: Callable[..., Any], graph: Any, args: tuple[Any, ...]
    ) -> Any:
        """A loaded graph's first call, its guards checked first (its every call checks
        them, and would raise): one whose guards refuse `args`, or that raises, is compiled
        anew and called again, and the forward says why, rather than fail the start (the
        graphs are an experimental API's, loaded on a host the build did not run on). What
        the failed call began is run again from its inputs: it writes the same KV entries."""
        self._unchecked.discard(kind)
        try:
            if graph.guard_check(*args):
                return graph(*args)
            self.not_loaded = f"the saved {kind} graph's guards refuse this model's inputs"
        except Exception as exc:  # whatever the loaded graph raises: compile it here instead
            failure = _described(exc)
            self.not_loaded = f"the saved {kind} graph failed at its first call: {failure}"
        graph = self._graphs[kind] = self._compile(kind, fn, args)
        return graph(*args)

    def _compile(self, kind: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """`kind`'s graph compiled ahead of time and loaded back from the bytes it is saved
        in, so a build runs what a start will. Traced by `torch.compile` at its first call
        instead, with every call's tensors marked (nothing saved), on a torch before 2.11 and
        where the ahead-of-time compile fails (an experimental API: `not_ahead` says why,
        and the forward's later graphs are traced too)."""
        if AHEAD_OF_TIME and not self.not_ahead:
            from flare.serve import precompiled

            before = _autograd_entries()
            try:
                data = precompiled.compile_graph(fn, _unbacked(args, alias=True), kind)
                graph = precompiled.load(data)
            except Exception as exc:  # whatever the experimental API raises: trace instead
                self.not_ahead = _described(exc)
                self._drop_ahead_entries(before)
            else:
                self._ahead_entries |= _autograd_entries() - before
                compilations.note("traced")
                compilations.note("compiled")
                self._compiled[kind] = data
                return graph
        traced = torch.compile(fn, fullgraph=True)
        return lambda *call: traced(*_unbacked(call))

    def _drop_ahead_entries(self, before: set[Path]) -> None:
        """Remove the AOTAutograd cache entries this forward's ahead-of-time compiles wrote,
        the failed one's included, once it falls back to tracing: nothing reads them (a
        start finds no saved graph and traces), and each compile keys its entry anew, so a
        package whose archive kept them would not rebuild byte for byte (`build --check`)."""
        for entry in self._ahead_entries | (_autograd_entries() - before):
            shutil.rmtree(entry, ignore_errors=True)
        self._ahead_entries.clear()


def _autograd_entries() -> set[Path]:
    """The AOTAutograd cache's entries in Inductor's cache folder now (one folder a key)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from flare.serve.inductor_archive import AUTOGRAD

    folder = Path(cache_dir()) / AUTOGRAD
    return set(folder.iterdir()) if folder.is_dir() else set()


def _described(exc: Exception) -> str:
    """An exception as one line of the ready line's reasons: its type and first line."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _run_layer(layer: torch.nn.Module, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's call, as the layers' graph is traced from it: the layer is an input
    like the tensors, so every layer of the same shapes runs the one graph."""
    return layer(*inputs)


def _run_logits(model: torch.nn.Module, hidden: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The logits of the rows `last` picks, as the logits' graph is traced from it."""
    return model.compute_logits(hidden[last])


def _unbacked(args: tuple[Any, ...], alias: bool = False) -> tuple[Any, ...]:
    """`args` with each tensor's first dimension (tokens, or rows) marked unbacked (with
    `alias`, on an alias of it, the caller's tensor left unmarked): a graph traced from them
    serves every batch size, with no guard on the size and no recompile."""
    marked = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            arg = arg.view(arg.shape) if alias else arg
            torch._dynamo.decorators.mark_unbacked(arg, 0)
        marked.append(arg)
    return tuple(marked)


def warm_up(runner: ModelRunner, blocks: BlockManager) -> None:
    """Run a prefill and a decode of each kind through `runner`, so its forward is traced
    and loaded (or compiled) now; the sequences' blocks are freed and forgotten after."""
    greedy = SamplingParams(temperature=0)
    for lengths in WARM_UP:
        seqs = [Sequence(list(range(1, n + 1)), greedy, max_tokens=2) for n in lengths]
        for seq in seqs:
            blocks.allocate(seq)
        runner.run(seqs, prefill=True)
        for seq in seqs:
            seq.append(1)
            blocks.append_slot(seq)
        runner.run(seqs, prefill=False)
        for seq in seqs:
            blocks.free_sequence(seq)
            blocks.forget(seq)
