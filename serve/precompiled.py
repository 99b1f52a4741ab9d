"""Precompiled graphs: each graph of the compiled forward as Dynamo's ahead-of-time compile
keeps it, saved by the build and loaded by a start, which then traces nothing.

`torch.compile(...).aot_compile` (torch 2.11 and later, experimental; in 2.11 only with
Dynamo's `enable_aot_compile`, which `compile_graph` turns on for its call) traces a function
once with Dynamo, compiles the graph with Inductor, and keeps what a call needs: the guards,
the bytecode that calls the graph, and the compiled graph itself (its wrapper code and, on CUDA,
its Triton kernels' binaries). `torch.compiler.load_compiled_function` makes the function
again from those bytes without tracing: Dynamo's trace of the forward's three graphs took
1.3-2.5 s of every 8B start on the H200, on its critical path.

A package's bytes must not depend on when or where it was built, and three things in what
`aot_compile` keeps do: the name of the compiled graph's global (a counter and a random UUID:
renamed here, in the bytecode too), the guards' cached hashes and code text (both hold memory
addresses: left out, a load makes them again), and Inductor's timings and debug strings (the
compile time, a repro script and a post-grad graph dump that name the cache folder, a line
map: cleared, none is read when a graph is called). Sets in the guards and sources are
pickled in string-hash order, which the build fixes with PYTHONHASHSEED.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

from flare.atomic import write_file_atomic
from flare.serve.inductor_archive import stable_graph

SUFFIX = ".graph"
"""A precompiled graph's file: `<kind>.graph`."""


def compile_graph(fn: Callable[..., Any], args: tuple[Any, ...], kind: str) -> bytes:
    """`fn` traced on `args` and compiled, as the bytes `kind`'s graph is saved in (a forward
    loads them back before it calls the graph: the build runs what a server will run)."""
    with _stable_guards(), torch._dynamo.config.patch(enable_aot_compile=True):
        graph = torch.compile(fn, fullgraph=True).aot_compile((args, {}))
    _rename_graph(graph, f"__compiled_fn_flare_{kind}")
    compiled = graph._artifacts.compiled_fn
    graph._artifacts.compiled_fn = _StableCallable(compiled.compiled_fn)
    return AOTCompiledFunction.serialize(graph).serialized_data


def save(data: bytes, folder: Path, kind: str) -> None:
    """Write `kind`'s graph to `folder/<kind>.graph`, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    write_file_atomic(folder / f"{kind}{SUFFIX}", data)


def read(folder: Path, kind: str) -> bytes | None:
    """The bytes of `kind`'s graph saved in `folder`, or None where there is none."""
    path = folder / f"{kind}{SUFFIX}"
    return path.read_bytes() if path.is_file() else None


def load(data: bytes) -> AOTCompiledFunction:
    """A graph from its bytes, ready to call. Raises where it does not load here (another
    torch, Python or GPU than the one it was compiled with).

    Loaded in inference mode, as the forward runs: the guards are made again as the graph
    loads, and a tensor guard expects the dispatch keys of a tensor made in the mode of the
    moment (an inference tensor has no ADInplaceOrView key), so guards made outside it fail
    every call. A loaded graph's guards expect tensors with no dimension marked dynamic (a
    saved tensor keeps no such mark): call it with the tensors as they are."""
    with torch.inference_mode():
        return AOTCompiledFunction.deserialize(data)


@contextmanager
def _stable_guards() -> Iterator[None]:
    """Guards pickled without their cached hash (of the creating function's memory address)
    and their code as text (which names types by their memory address): numbers that differ
    from one process to the next. A load builds both again from the guards themselves."""
    from torch._guards import Guard

    def state(guard: Guard) -> tuple[None, dict[str, Any]]:
        slots = {name: getattr(guard, name) for name in Guard.__slots__ if hasattr(guard, name)}
        return None, slots | {"_hash": None, "code_list": None}

    Guard.__getstate__ = state
    try:
        yield
    finally:
        del Guard.__getstate__


def _rename_graph(graph: AOTCompiledFunction, name: str) -> None:
    """Call the compiled graph by `name` instead of Dynamo's unique, random one: the global
    the bytecode loads and the name it is installed under at load."""
    artifacts = graph._artifacts
    old, env = artifacts.backend_id, artifacts.runtime_env
    code = env.bytecode
    artifacts.backend_id = name
    artifacts.runtime_env = dataclasses.replace(
        env,
        bytecode=code.replace(co_names=tuple(name if n == old else n for n in code.co_names)),
        external_refs={name if n == old else n for n in env.external_refs},
    )


class _StableCallable(BundledAOTAutogradSerializableCallable):
    """The compiled graph, serialized without what differs between two compiles of it."""

    @classmethod
    def serialize_compile_artifacts(cls, fn: BundledAOTAutogradSerializableCallable) -> bytes:
        entry, kernels, constants = pickle.loads(super().serialize_compile_artifacts(fn))
        entry.forward_time_taken_ns = entry.backward_time_taken_ns = 0
        for part in (entry.compiled_fw, entry.compiled_bw):
            graph = getattr(part, "result", None)
            if graph is not None:
                stable_graph(graph)
                graph.inductor_post_grad_graph_str = ""
                graph.cache_linemap = []
        return pickle.dumps((entry, kernels, constants))
