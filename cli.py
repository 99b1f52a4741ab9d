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
from rich.progress import Progress

from flare.build.target import MAX_CONCURRENCY, PREFILL_CHUNK
from flare.cli_common import (
    AcceptOption,
    JsonOption,
    RegistryOption,
    bar_columns,
    err,
    out,
    print_done,
    print_json,
    print_table,
    progress_bar,
)
from flare.config import (
    SETTINGS,
    Config,
    load_config,
    parse_body_size,
    parse_size,
    parse_target,
    parse_timeout,
)
from flare.errors import (
    FlareError,
    IntegrityError,
    InvalidInputError,
    from_os_error,
)
from flare.registry.commands import open_registry, registry_app
from flare.registry.registry import Registry
from flare.registry.signature_commands import sign_command, verify_command
from flare.sign import policy as trust
from flare.sign.commands import key_app, trust_app, warn_accepted
from flare.store import Digest
from flare.store.commands import store_app

if TYPE_CHECKING:  # imported where used: a listing command should not load what builds need
    from flare.build.check import CheckResult
    from flare.build.pipeline import BuildResult, PhaseReport, Signer
    from flare.sign import keys
    from flare.store.package import Manifest

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


# -- output helpers ---------------------------------------------------------------------------


# -- flare build ------------------------------------------------------------------------------


class BuildProgress:
    """A bar per phase on a terminal; one line per phase in logs."""

    def __init__(self) -> None:
        columns = bar_columns("{task.description:<9}")
        self.bar = Progress(*columns, console=err, disable=not err.is_terminal)
        self.task: Any = None

    def phase_started(self, name: str, total: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, visible=False)
        self.task = self.bar.add_task(name, total=total or None)
        if not err.is_terminal:
            err.print(f"phase {name}", markup=False)

    def advance(self, nbytes: int) -> None:
        self.bar.advance(self.task, nbytes)

    def phase_finished(self, report: PhaseReport) -> None:
        self.bar.update(self.task, completed=self.bar.tasks[-1].total or 0, visible=False)

    def note(self, message: str) -> None:
        err.print(message, markup=False)


TimeoutOption = Annotated[
    float,
    typer.Option(
        min=1, help="Seconds a rank may take to join or stay silent before the build stops."
    ),
]


@app.command("build")
def build_command(
    source: Annotated[
        str | None, typer.Argument(help="Checkpoint folder, or ORG/NAME\\[@REVISION].")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Package name.")] = None,
    tag: Annotated[str, typer.Option(help="Tag to point at the package.")] = "latest",
    ranks: Annotated[int, typer.Option(min=1, help="Tensor-parallel ranks.")] = 1,
    model_id: Annotated[
        str | None,
        typer.Option(help="Model id (default: the hub id, else config.json's, else --name)."),
    ] = None,
    payload_size: Annotated[str, typer.Option(help="Target payload blob size.")] = "256M",
    registry: Annotated[str | None, typer.Option(help="Registry (default: the config's).")] = None,
    rehash: Annotated[bool, typer.Option(help="Hash every source file again.")] = False,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Files hashed and payloads written at once.")
    ] = None,
    check: Annotated[
        str | None, typer.Option(help="Rebuild REF from its recorded inputs and compare.")
    ] = None,
    rendezvous: Annotated[
        str | None,
        typer.Option(
            metavar="HOST:PORT",
            help="Be rank zero of --ranks processes; the others run `flare join HOST:PORT`.",
        ),
    ] = None,
    timeout: TimeoutOption = 300.0,
    allow_outside_links: Annotated[
        bool,
        typer.Option(
            "--allow-outside-links",
            help="Build from files that link out of the checkpoint folder (refused by default).",
        ),
    ] = False,
    prepare_for: Annotated[
        str | None,
        typer.Option(
            "--target",
            help="What to prepare (tune, compile) for: cpu, cuda, none, or auto (this host's "
            "device; default: the config's build.target).",
        ),
    ] = None,
    max_concurrency: Annotated[
        int, typer.Option(help="The largest decode batch the package plans for.")
    ] = MAX_CONCURRENCY,
    prefill_chunk: Annotated[
        int, typer.Option(help="Prompt tokens prefilled in one step at most.")
    ] = PREFILL_CHUNK,
    retune: Annotated[
        bool,
        typer.Option("--retune", help="Tune again instead of reusing the kernel cache's records."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Build a package from a checkpoint, resumably, and publish it to the registry."""
    from flare.build.check import check_build
    from flare.build.pipeline import Build, BuildRequest
    from flare.build.target import resolve_target

    config = load_config()
    target = open_registry(registry, create=check is None)
    progress = BuildProgress()
    if check is not None:
        with progress.bar:
            checked = check_build(
                target,
                check,
                config["paths.export_staging"],
                config["paths.hub_cache"],
                progress,
                source,
                allow_outside_links,
            )
        _print_check(check, checked, as_json)
        return
    if source is None or name is None:
        raise InvalidInputError("flare build needs SOURCE and --name", "see flare build --help")
    request = BuildRequest(
        source=source,
        name=name,
        tag=tag,
        ranks=ranks,
        model_id=model_id,
        rehash=rehash,
        payload_bytes=parse_size(payload_size),
        workers=workers,
        rendezvous=rendezvous,
        timeout=timeout,
        allow_outside_links=allow_outside_links,
        staging=config["paths.export_staging"],
        hub_cache=config["paths.hub_cache"],
        target=resolve_target(parse_target(prepare_for or config["build.target"])),
        max_concurrency=max_concurrency,
        prefill_chunk=prefill_chunk,
        kernel_cache=config["paths.kernel_cache"],
        retune=retune,
    )
    with progress.bar:
        result = Build(request, target, progress, sign=configured_signer(config)).run()
    _print_build(result, as_json)


def _print_check(ref: str, checked: CheckResult, as_json: bool) -> None:
    if as_json:
        print_json(
            {
                "ref": ref,
                "digest": str(checked.digest),
                "rebuilt": str(checked.rebuilt),
                "identical": checked.identical,
                "source_files": checked.source_files,
                "payloads": checked.payloads,
                "artifacts": checked.artifacts,
            }
        )
    elif checked.identical:
        out.print(f"identical: {ref} rebuilds to {checked.rebuilt}")
    else:
        out.print(f"DIFFERENT: {ref} is {checked.digest}, its inputs rebuild to {checked.rebuilt}")
        for path in checked.source_files:
            out.print(f"  source file changed: {path}")
        for payload in checked.payloads:
            out.print(
                f"  payload not reproduced: {payload['digest']} ranks {payload['ranks']} "
                f"(first tensor {payload['first_tensor']})"
            )
        for artifact in checked.artifacts:
            out.print(f"  artifact not reproduced: {artifact['path']} ({artifact['digest']})")
    if not checked.identical:
        raise typer.Exit(IntegrityError.exit_code)


def _print_build(result: BuildResult, as_json: bool) -> None:
    phases = [asdict(p) for p in result.phases]
    if as_json:
        print_json(
            {"name": result.name, "tag": result.tag, "digest": str(result.digest), "phases": phases}
        )
        return
    rows = [
        (p.name, p.status, f"{p.seconds:.2f} s", decimal(p.bytes), _rate(p.bytes, p.seconds))
        for p in result.phases
    ]
    total = sum(p.seconds for p in result.phases)
    rows.append(("total", "", f"{total:.2f} s", "", ""))
    print_table("", ("phase", "status", "time", "bytes", "rate"), rows)
    out.print(f"{result.name}@{result.digest}")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{decimal(int(nbytes / seconds))}/s" if nbytes and seconds > 0 else ""


# -- flare join -------------------------------------------------------------------------------


@app.command("join")
def join_command(
    address: Annotated[str, typer.Argument(metavar="HOST:PORT", help="Rank zero's --rendezvous.")],
    rank: Annotated[int, typer.Option(min=1, help="This process's rank (1 to ranks - 1).")],
    local_checkpoint: Annotated[
        str | None,
        typer.Option(
            metavar="require|prefer",
            help="Read this host's copy of the checkpoint (prefer: else receive from rank 0).",
        ),
    ] = None,
    checkpoint: Annotated[
        str | None,
        typer.Option(help="This host's copy (default: the SOURCE rank 0 was given)."),
    ] = None,
    registry: RegistryOption = None,
    workers: Annotated[int | None, typer.Option(min=1, help="Payloads written at once.")] = None,
    rehash: Annotated[bool, typer.Option(help="Hash the local checkpoint again.")] = False,
    timeout: TimeoutOption = 300.0,
    as_json: JsonOption = False,
) -> None:
    """Take part as rank R in a build rank zero runs with --rendezvous HOST:PORT."""
    from flare.build.join import LOCAL_MODES, Join, JoinRequest

    if local_checkpoint not in (None, *LOCAL_MODES):
        raise InvalidInputError(
            f"--local-checkpoint {local_checkpoint} is not require or prefer", "pick one"
        )
    config = load_config()
    request = JoinRequest(
        address=address,
        rank=rank,
        registry=registry or config.registry,
        staging=config["paths.export_staging"],
        hub_cache=config["paths.hub_cache"],
        local_checkpoint=local_checkpoint,
        checkpoint=checkpoint,
        workers=workers,
        timeout=timeout,
        rehash=rehash,
    )
    progress = BuildProgress()
    with progress.bar:
        result = Join(request, progress).run()
    phases = [asdict(p) for p in result.phases]
    if as_json:
        print_json({**asdict(result), "phases": phases})
        return
    rows = [(p.name, p.status, f"{p.seconds:.2f} s", decimal(p.bytes)) for p in result.phases]
    print_table("", ("phase", "status", "time", "bytes"), rows)
    out.print(
        f"rank {rank}: {result.written} payloads written, {result.reused} reused "
        f"(bytes from {result.source}, into {result.store}); package {result.digest}"
    )


# -- flare demo -------------------------------------------------------------------------------


DEMO_QUESTION = "what does the registry keep?"


@app.command("demo")
def demo_command(as_json: JsonOption = False) -> None:
    """The main job on the embedded default: a tiny seeded model built, published, signed with
    a development key, pulled, served, and asked one question over the HTTP API."""
    from flare.build.pipeline import Build, BuildRequest

    config = load_config()
    source = config.home / "demo" / "tiny-llama"
    if not (source / "model.safetensors").exists():
        from flare.build.tiny import make_tiny_llama  # numpy: only the demo needs it here

        err.print(f"making a tiny seeded model in {source}", markup=False)
        make_tiny_llama(source)
    request = BuildRequest(
        source=str(source),
        name="tiny-llama",
        staging=config["paths.export_staging"],
        hub_cache=config["paths.hub_cache"],
    )
    progress = BuildProgress()
    registry = open_registry(create=True)
    with progress.bar:
        result = Build(request, registry, progress, sign=demo_signer(config)).run()
    report = registry.verify(f"tiny-llama@{result.digest.hex}")
    if not report.ok:
        raise IntegrityError(f"the demo package failed verification: {report}")
    if not as_json:
        _print_build(result, as_json)
    answer = ask_served(f"tiny-llama@{result.digest.hex}", DEMO_QUESTION)
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


# -- signing ----------------------------------------------------------------------------------

DEMO_PUBLISHER = "flare-demo"


def key_signer(key: keys.PrivateKey, publisher: str) -> Signer:
    """The build's sign hook: sign the published package and store the signature beside it."""

    def sign(registry: Registry, digest: Digest, manifest: Manifest) -> None:
        from flare.sign.envelope import sign_package

        registry.add_signature(digest, sign_package(key, publisher, digest, manifest))

    return sign


def configured_signer(config: Config) -> Signer | None:
    """Sign builds with this host's signing key, when one is configured."""
    path = config["signing.key"]
    if path is None:
        return None
    from flare.sign import keys

    key = keys.load_private_key(path)
    policy = trust.load_policy(config)
    return key_signer(key, trust.publisher_for(policy, key, config["signing.publisher"]))


def demo_signer(config: Config) -> Signer:
    """A development key under FLARE_HOME, made and trusted on first use (the user's own
    signing key, if any, is neither used nor touched)."""
    from flare.sign import keys

    path = config.home / "demo" / "signing-key.pem"
    if not path.exists():
        keys.write_private_key(keys.generate_key(), path)
        err.print(f"made a development signing key {path}", markup=False)
    key = keys.load_private_key(path)
    policy = trust.load_policy(config)
    if policy.by_fingerprint(keys.fingerprint(key)) is None:
        if policy.by_name(DEMO_PUBLISHER) is not None:  # an older dev key, from a wiped home
            policy = trust.remove(policy, DEMO_PUBLISHER)
        policy = trust.add_key(policy, DEMO_PUBLISHER, keys.public_pem(key))
        trust.save_policy(policy, config["trust.file"])
    return key_signer(key, DEMO_PUBLISHER)


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


# -- flare trust ------------------------------------------------------------------------------


# -- flare store ------------------------------------------------------------------------------


# -- flare registry ---------------------------------------------------------------------------


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
