"""The `flare` command: argument parsing and printing only, one typer sub-app per component."""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import asdict
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.filesize import decimal

from flare.build.commands import build_command, join_command
from flare.cli_common import (
    AcceptOption,
    JsonOption,
    RegistryOption,
    err,
    out,
    print_done,
    print_json,
    print_table,
    progress_bar,
)
from flare.config import (
    SETTINGS,
    load_config,
    parse_body_size,
    parse_timeout,
)
from flare.errors import (
    FlareError,
    InvalidInputError,
    from_os_error,
)
from flare.registry.commands import open_registry, registry_app
from flare.registry.registry import Registry
from flare.registry.signature_commands import sign_command, verify_command
from flare.sign import policy as trust
from flare.sign.commands import key_app, trust_app, warn_accepted
from flare.store.commands import store_app

if TYPE_CHECKING:  # imported where used: a listing command should not load what builds need
    pass

_state = {"debug": bool(os.environ.get("FLARE_DEBUG"))}

app = typer.Typer(
    help="flare: reproducible, signed runtime packages for LLM checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="The effective configuration.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
app.add_typer(store_app, name="store")
app.add_typer(config_app, name="config")
app.add_typer(key_app, name="key")
app.add_typer(trust_app, name="trust")


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    """Options for every command."""
    _state["debug"] = _state["debug"] or debug


# -- flare demo -------------------------------------------------------------------------------


DEMO_QUESTION = "what does the registry keep?"


app.command("build")(build_command)
app.command("join")(join_command)


@app.command("demo")
def demo_command(as_json: JsonOption = False) -> None:
    """The main job on the embedded default: a tiny seeded model built, published, signed with
    a development key, pulled, served, and asked one question over the HTTP API."""
    from flare.build.commands import build_demo, print_build

    result = build_demo()
    if not as_json:
        print_build(result, as_json)
    answer = ask_served(f"{result.name}@{result.digest.hex}", DEMO_QUESTION)
    if as_json:
        phases = [asdict(p) for p in result.phases]
        print_json({"name": result.name, "digest": str(result.digest), "phases": phases} | answer)
        return
    out.print(f"signed by {answer['publisher']}; served at {answer['url']}", markup=False)
    out.print(f"asked:  {DEMO_QUESTION}", markup=False)
    out.print(f"answer: {answer['answer']!r} (a tiny random model: words are not expected)")


def ask_served(ref: str, question: str) -> dict[str, Any]:
    """Pull REF, serve it on a free loopback port, ask one chat question, stop the server."""
    import httpx

    from flare.registry.leases import hold_lease
    from flare.serve.server import background_server

    source, cache, pulled = pull_into_cache(ref, None, None, None, None)
    runtime, api = load_package_app(source, cache, pulled.plan, None, None)
    body = {
        "model": pulled.plan.manifest.name,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 24,
        "temperature": 0,
    }
    with (
        hold_lease(source.store, "serve", packages=[pulled.plan.digest]),
        background_server(api, runtime) as url,
    ):
        reply = httpx.post(f"{url}/chat/completions", json=body, timeout=120)
    if reply.status_code != 200:
        raise FlareError(f"the demo server answered {reply.status_code}: {reply.text}")
    data = reply.json()
    return {
        "publisher": pulled.plan.verdict.publisher,
        "url": url,
        "question": question,
        "answer": data["choices"][0]["message"]["content"],
        "usage": data["usage"],
    }


app.command("sign")(sign_command)
app.command("verify")(verify_command)


# -- flare pull / flare serve ----------------------------------------------------------------

DeviceOption = Annotated[
    str | None, typer.Option("--device", help="cpu or cuda (default: CUDA where a GPU is).")
]
RevisionOption = Annotated[
    str | None,
    typer.Option("--revision", help="Refuse the package unless built from this model revision."),
]


def pull_into_cache(
    ref: str,
    registry: str | None,
    device: str | None,
    revision: str | None,
    accept: str | None,
    compiles: bool = False,
) -> Any:
    """Admission (signature, compatibility, disk, memory), then the missing blobs, with a bar.
    `compiles`: the server compiles at start, so compiled artifacts need not match this host.

    Returns the source registry, the host cache and the pull report."""
    _require_serve_extra()
    from flare.serve.cache import HostCache
    from flare.serve.compat import choose_device, detect_toolchain
    from flare.serve.models import served_recipes
    from flare.serve.pull import PullRequest, fetch, plan_pull
    from flare.serve.runtime import kv_cache_reservation

    config = load_config()
    source = open_registry(registry)
    cache = HostCache(config["paths.package_cache"])
    chosen = choose_device(device)
    request = PullRequest(
        ref=ref,
        host=detect_toolchain(chosen, served_recipes(), compiles),
        policy=trust.load_policy(config),
        reserve=config["memory.reserve"] + kv_cache_reservation(chosen),
        revision=revision,
        accept_publisher=accept,
    )
    plan = plan_pull(source, cache, request)
    if plan.verdict.accepted_dangerously:
        warn_accepted(plan.verdict)
    with progress_bar("pull", sum(size for _, size in plan.admission.missing)) as advance:
        report = fetch(source, cache, plan, progress=advance)
    return source, cache, report


def _require_serve_extra() -> None:
    """Pull and serve run models: without the serve extra, say how to get it."""
    import importlib.util

    missing = [m for m in ("torch", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise FlareError(
            f"flare pull and serve need {', '.join(missing)}, which are not installed",
            "pip install 'flare[serve]'",
        )


@app.command("pull")
def pull_command(
    ref: Annotated[str, typer.Argument(help="The package: NAME, NAME:TAG or NAME@DIGEST.")],
    registry: RegistryOption = None,
    device: DeviceOption = None,
    revision: RevisionOption = None,
    accept: AcceptOption = None,
    as_json: JsonOption = False,
) -> None:
    """Pull a package into this host's cache: checked before any weight byte moves."""
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


class Attention(StrEnum):
    """`flare serve --attention`: the names make_attention takes (ATTENTION_KINDS; listed
    here again because importing the engine would load torch for every command)."""

    AUTO = "auto"
    FLASHINFER = "flashinfer"
    TORCH = "torch"


@app.command("serve")
def serve_command(
    ref: Annotated[str, typer.Argument(help="The package: NAME, NAME:TAG or NAME@DIGEST.")],
    registry: RegistryOption = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8000,
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
        typer.Option(envvar="FLARE_API_KEY", help="Require `Authorization: Bearer KEY`."),
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
) -> None:
    """Pull, verify and check a package, then serve it behind an OpenAI-compatible API."""
    _require_serve_extra()
    limits = _body_limits(max_body_size, body_timeout)
    from flare.registry.leases import hold_lease
    from flare.serve.server import listen, run_server

    sock = listen(host, port)
    times = {"start": time.perf_counter()}
    source, cache, report = pull_into_cache(
        ref, registry, device, revision, accept, compile_on_start
    )
    plan = report.plan
    times["pulled"] = time.perf_counter()
    with hold_lease(source.store, "serve", packages=[plan.digest]):
        runtime, app_ = load_package_app(
            source,
            cache,
            plan,
            kv_cache_tokens,
            api_key,
            attention.value,
            limits,
            "start" if compile_on_start else "package",
        )
        times["loaded"] = time.perf_counter()
        run_server(app_, runtime, sock, _say_ready(plan, runtime, times))


def _body_limits(max_body_size: str | None, body_timeout: str | None) -> Any:
    """The options, else the serve.* settings."""
    from flare.serve.limits import BodyLimits

    config = load_config()
    return BodyLimits(
        _option("--max-body-size", max_body_size, parse_body_size, config["serve.max_body_size"]),
        _option("--body-timeout", body_timeout, parse_timeout, config["serve.body_timeout"]),
    )


def _option(name: str, given: str | None, parse: Any, default: Any) -> Any:
    """An option's value parsed, or the default; a bad value names the option."""
    if given is None:
        return default
    try:
        return parse(given)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{name}: {exc.what}", exc.hint) from exc


def load_package_app(
    source: Registry,
    cache: Any,
    plan: Any,
    kv_cache_tokens: int | None,
    api_key: str | None,
    attention: str = "auto",
    limits: Any = None,
    compile_mode: str = "package",
) -> tuple[Any, Any]:
    """Load the pulled package on the device pull admitted it for (printing what it cost)
    and make its API app."""
    from flare.serve.api import ServedPackage, create_app
    from flare.serve.runtime import load_runtime

    started = time.perf_counter()
    runtime = load_runtime(
        plan.manifest,
        cache.files(plan.manifest),
        plan.device,
        kv_cache_tokens,
        memory_reserve=load_config()["memory.reserve"],
        attention=attention,
        quarantine=cache.quarantine_if_corrupt,
        compile_mode=compile_mode,
        compile_root=cache.root / "compiled",
    )
    weights = sum(p.size for p in plan.manifest.payloads)
    kv = runtime.kv_stats()
    kv_text = ""
    if kv:  # a generating model
        tokens = kv["blocks_total"] * kv["block_size"]
        kv_text = f"; KV cache {tokens} tokens, {runtime.attention} attention"
    err.print(
        f"loaded {plan.manifest.name} ({decimal(weights)} of weights) on {plan.device} in "
        f"{time.perf_counter() - started:.2f} s{kv_text}",
        markup=False,
    )
    package = ServedPackage(
        name=plan.manifest.name,
        digest=str(plan.digest),
        publisher=plan.verdict.publisher,
        created=_created(source, plan),
    )
    return runtime, create_app(runtime, package, api_key, limits)


def _created(source: Registry, plan: Any) -> int:
    """When the package was published under its name (0 if it has none)."""
    from datetime import datetime

    from flare.registry.refs import read_record

    record = read_record(source.store, plan.name, plan.digest) if plan.name else None
    return int(datetime.fromisoformat(record.created).timestamp()) if record else 0


def _say_ready(plan: Any, runtime: Any, times: dict[str, float]) -> Any:
    """The ready line: where, start-to-ready and its parts, how the forward runs."""

    def ready(url: str) -> None:
        now = time.perf_counter()
        timeline = runtime.start_report.timeline(
            pull=times["pulled"] - times["start"],
            load=times["loaded"] - times["pulled"],
            total=now - times["start"],
        )
        sys.stdout.write(f"serving {plan.manifest.name}@{plan.digest} at {url} ({timeline})\n")
        sys.stdout.flush()

    return ready


# -- flare config -----------------------------------------------------------------------------


@config_app.command("show")
def config_show(as_json: JsonOption = False) -> None:
    """Print every effective setting and where it came from."""
    config = load_config()
    rows = [(key, _show(v.value), v.source) for key, v in config.values.items()]
    if as_json:
        print_json(
            {
                "file": str(config.file),
                "home": str(config.home),
                "settings": {k: {"value": v, "source": s} for k, v, s in rows},
            }
        )
        return
    out.print(f"config file: {config.file}{'' if config.file.exists() else ' (absent)'}")
    about = {s.key: (s.env, s.help) for s in SETTINGS}
    print_table(
        "",
        ("setting", "value", "source", "variable", "meaning"),
        [(*row, *about[row[0]]) for row in rows],
    )


def _show(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


# -- entry point ------------------------------------------------------------------------------


def main() -> None:
    """Run the CLI; user errors become one line on stderr and a meaningful exit code."""
    try:
        app()
    except FlareError as exc:
        _fail(str(exc), exc.exit_code)
    except OSError as exc:
        error = from_os_error(exc, "access", exc.filename or "a file")
        _fail(str(error), error.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except Exception as exc:  # a bug: say so, and how to see more
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for details)", 1)


def _fail(message: str, code: int) -> None:
    if _state["debug"]:
        traceback.print_exc()
    err.print(f"error: {message}", markup=False)
    sys.exit(code)
