"""`flare pull` and `flare serve`: their options, the body limits taken from options or
settings, and the ready line.

Top-level commands, not a group: cli.py registers them on the root app. What they do is in
serve/launch.py, imported inside the commands: it loads the signature checks, and serving
loads torch, neither of which a listing command should pay for."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from contextlib import closing
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.filesize import decimal

from flare.cli_common import AcceptOption, JsonOption, RegistryOption, err, print_done
from flare.config import load_config, parse_body_size, parse_timeout
from flare.errors import InvalidInputError

if TYPE_CHECKING:
    from flare.serve.limits import BodyLimits
    from flare.serve.pull import PullPlan
    from flare.serve.runtime import Runtime

Parsed = TypeVar("Parsed")


def _not_blank(value: str | None) -> str | None:
    """An option given as an empty string (an unset shell variable, most often) is refused,
    not taken: an empty --host listens on every interface, an empty --api-key would let any
    request in, an empty --revision matches nothing."""
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty; give a value, or leave the option out")
    return value


DeviceOption = Annotated[
    str | None, typer.Option("--device", help="cpu or cuda (default: CUDA where a GPU is).")
]
RevisionOption = Annotated[
    str | None,
    typer.Option(
        "--revision",
        callback=_not_blank,
        help="Refuse the package unless built from this model revision.",
    ),
]


class Attention(StrEnum):
    """`flare serve --attention`: the names make_attention takes (ATTENTION_KINDS; listed
    here again because importing the engine would load torch for every command)."""

    AUTO = "auto"
    FLASHINFER = "flashinfer"
    TORCH = "torch"


def pull_command(
    ref: Annotated[str, typer.Argument(help="The package: NAME, NAME:TAG or NAME@DIGEST.")],
    registry: RegistryOption = None,
    device: DeviceOption = None,
    revision: RevisionOption = None,
    accept: AcceptOption = None,
    as_json: JsonOption = False,
) -> None:
    """Pull a package into this host's cache: checked before any weight byte moves."""
    from flare.build.commands import is_source
    from flare.serve.launch import pull_into_cache

    if is_source(ref):
        raise InvalidInputError(
            f"{ref} is a checkpoint folder or hub id, not a package",
            f"build it first: flare build {ref} --name NAME (flare serve {ref} builds and serves)",
        )

    _source, cache, report = pull_into_cache(ref, registry, device, revision, accept)
    plan = report.plan
    data = {
        "name": plan.name,
        "digest": str(plan.digest),
        "publisher": plan.verdict.publisher,
        "signer": plan.verdict.signer,
        "cache": str(cache.root),
        "blobs": report.methods,
        "bytes": report.bytes,
    }
    methods = ", ".join(f"{n} {m}" for m, n in sorted(report.methods.items())) or "all present"
    print_done(
        as_json,
        data,
        f"pulled {plan.name or ''}@{plan.digest} into {cache.root}: {methods}, "
        f"{decimal(report.bytes)}; signed by {plan.verdict.publisher} ({plan.verdict.signer})",
    )


def serve_command(
    ref: Annotated[
        str,
        typer.Argument(
            help="The package: NAME, NAME:TAG or NAME@DIGEST; or a checkpoint folder (./PATH) "
            "or hub id (ORG/NAME[@REV]) to build first."
        ),
    ],
    registry: RegistryOption = None,
    host: Annotated[
        str, typer.Option(callback=_not_blank, help="Address to listen on.")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free port).")
    ] = 8000,
    device: DeviceOption = None,
    revision: RevisionOption = None,
    accept: AcceptOption = None,
    compile_on_start: Annotated[
        bool,
        typer.Option(
            "--compile-on-start",
            help="Compile the forward at start (the package's compiled artifacts, if any, are "
            "not used, so they need not match this host).",
        ),
    ] = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="FLARE_API_KEY",
            callback=_not_blank,
            help="Require `Authorization: Bearer KEY`.",
        ),
    ] = None,
    kv_cache_tokens: Annotated[
        int | None, typer.Option(min=16, help="KV cache size in tokens (default: by memory).")
    ] = None,
    attention: Annotated[
        Attention,
        typer.Option(
            help="Attention kernels: flashinfer (CUDA), torch, or auto (FlashInfer where it "
            "can run)."
        ),
    ] = Attention.AUTO,
    cuda_graphs: Annotated[
        bool,
        typer.Option(
            "--cuda-graphs/--no-cuda-graphs",
            help="Replay decode steps from CUDA graphs captured at start (CUDA, FlashInfer "
            "attention, one rank); --no-cuda-graphs runs every step's kernels one by one.",
        ),
    ] = True,
    prefill_graphs: Annotated[
        bool | None,
        typer.Option(
            "--prefill-graphs/--no-prefill-graphs",
            help="Replay prefill steps of up to 2,048 tokens from CUDA graphs captured at "
            "start too (with --cuda-graphs; default: on, off with --batch-invariant, whose "
            "unpadded prefills they would pad).",
            show_default=False,
        ),
    ] = None,
    batch_invariant: Annotated[
        bool,
        typer.Option(
            "--batch-invariant",
            help="Give a greedy request the tokens it gets alone, whatever runs beside it or "
            "before it: each prompt prefilled whole (no cached prefix) in a step of its own, "
            "every decode product of up to 64 sequences summed in one order (one rank; costs "
            "throughput: docs/performance.md).",
        ),
    ] = False,
    max_body_size: Annotated[
        str | None,
        typer.Option(
            help="Largest request body taken, e.g. 4M; 413 past it (default: serve.max_body_size)."
        ),
    ] = None,
    body_timeout: Annotated[
        str | None,
        typer.Option(
            help="Time a request body may take to arrive, e.g. 30s; 408 past it (default: "
            "serve.body_timeout)."
        ),
    ] = None,
    stall_timeout: Annotated[
        str | None,
        typer.Option(
            help="Time the engine may have work and finish no step, or not answer, e.g. 60s; "
            "/health answers 503 stalled past it, until it goes on (default: "
            "serve.stall_timeout).",
        ),
    ] = None,
    ranks: Annotated[
        int | None,
        typer.Option(
            min=1, help="The ranks of a multi-rank package (checked against it); see --rendezvous."
        ),
    ] = None,
    rendezvous: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="Serve rank zero of a multi-rank package here; the other hosts run "
            "`flare join HOST:PORT --rank R` (default: every rank on this host).",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help="Seconds a rank may take to join or stay silent before the server stops.",
        ),
    ] = 30.0,
) -> None:
    """Pull, verify and check a package, then serve it behind an OpenAI-compatible API (a
    checkpoint folder or hub id is built and published first)."""
    from flare.serve.launch import (
        load_package_app,
        pull_into_cache,
        require_serve_extra,
        start_ranks,
    )

    require_serve_extra()
    _refuse_blank_key(api_key)
    limits = _body_limits(max_body_size, body_timeout)
    from flare.serve.engine_process import engine_for
    from flare.serve.heap import uncollected

    with closing(engine_for(device)) as engine:  # its imports run beside this process's and pull
        with uncollected(freeze=True):  # torch's among them: a quarter off (serve/heap.py)
            from flare.build.commands import build_to_serve, is_source
            from flare.serve.launch import serving_leases
            from flare.serve.runtime import refuse_prefill_graphs_alone
            from flare.serve.server import listen, run_server, url_of

        refuse_prefill_graphs_alone(cuda_graphs, prefill_graphs)
        sock = listen(host, port)
        if is_source(ref):  # a checkpoint folder or hub id: build it first, as vllm serve does
            ref = build_to_serve(ref, registry)
        times = {"start": time.perf_counter()}
        source, cache, report = pull_into_cache(
            ref, registry, device, revision, accept, compile_on_start, (0,) if rendezvous else None
        )
        plan = report.plan
        times["pulled"] = time.perf_counter()
        times["pulled_at"] = time.time()
        if batch_invariant:
            from flare.serve.runtime import refuse_invariance_over_ranks, refuse_padded_invariance

            refuse_invariance_over_ranks(plan.manifest.name, plan.manifest.ranks)
            refuse_padded_invariance(prefill_graphs)
        with serving_leases(source, cache, plan, url_of(sock)):
            leader = None
            if plan.manifest.ranks > 1 or rendezvous is not None:
                leader = start_ranks(plan, rendezvous, ranks, timeout)
            try:
                runtime, app = load_package_app(
                    source,
                    cache,
                    plan,
                    kv_cache_tokens,
                    api_key,
                    attention.value,
                    limits,
                    "start" if compile_on_start else "package",
                    leader,
                    cuda_graphs,
                    batch_invariant,
                    prefill_graphs,
                    engine=engine,
                    stall_timeout=_stall_timeout(stall_timeout),
                )
            except BaseException as exc:
                if leader is not None:
                    leader.abandon(f"rank 0 could not load its part: {exc}")
                raise
            times["loaded"] = time.perf_counter()
            if runtime.memory_plan is not None:
                err.print(runtime.memory_plan.describe(), markup=False)
            run_server(app, runtime, sock, _say_ready(plan, runtime, times))
            if leader is not None:
                leader.close()


def _refuse_blank_key(api_key: str | None) -> None:
    """FLARE_API_KEY set but empty: typer takes it as unset, and the server would take every
    request; refused, as an empty --api-key is."""
    blank = os.environ.get("FLARE_API_KEY")
    if api_key is None and blank is not None and not blank.strip():
        raise InvalidInputError(
            "FLARE_API_KEY is set but empty, so no key would be asked of any request",
            "set it to the key, or unset it to serve without one",
        )


def _body_limits(max_body_size: str | None, body_timeout: str | None) -> BodyLimits:
    """The options, else the serve.* settings."""
    from flare.serve.limits import BodyLimits

    config = load_config()
    return BodyLimits(
        _option("--max-body-size", max_body_size, parse_body_size, config["serve.max_body_size"]),
        _option("--body-timeout", body_timeout, parse_timeout, config["serve.body_timeout"]),
    )


def _stall_timeout(given: str | None) -> float | None:
    """--stall-timeout in seconds; None for serve.stall_timeout."""
    return _option("--stall-timeout", given, parse_timeout, None)


def _option(
    name: str, given: str | None, parse: Callable[[str], Parsed], default: Parsed
) -> Parsed:
    """An option's value parsed, or the default; a bad value names the option."""
    if given is None:
        return default
    try:
        return parse(given)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{name}: {exc.what}", exc.hint) from exc


def _say_ready(plan: PullPlan, runtime: Runtime, times: dict[str, float]) -> Callable[[str], None]:
    """The ready line: where, start-to-ready and its parts, how the forward runs."""

    def ready(url: str) -> None:
        now = time.perf_counter()
        timeline = runtime.start_report.timeline(
            pull=times["pulled"] - times["start"],
            load=times["loaded"] - times["pulled"],
            total=now - times["start"],
            weights=runtime.package.weights_read,
            launched=_process_age(),
            pulled_at=times["pulled_at"],
        )
        ranks = runtime.rank_stats()
        if ranks:
            timeline += f"; {len(ranks)} ranks: {_describe_ranks(ranks)}"
        sys.stdout.write(f"serving {plan.manifest.name}@{plan.digest} at {url} ({timeline})\n")
        sys.stdout.flush()

    return ready


def _process_age() -> float | None:
    """Seconds since this process began, its interpreter's start and imports included (from
    Linux's /proc, to 10 ms); None where there is no /proc."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _describe_ranks(ranks: dict[int, dict[str, float]]) -> str:
    """Each rank's load time and memory (weights and KV cache), for the ready line."""
    parts = []
    for rank, figures in sorted(ranks.items()):
        memory = int(figures.get("rank_weight_bytes", 0) + figures.get("rank_kv_bytes", 0))
        seconds = figures.get("rank_load_seconds", 0)
        parts.append(f"rank {rank} load {seconds:.2f} s, {decimal(memory)}")
    return "; ".join(parts)
