"""`flare build` and `flare join`: a build's options, its progress on stderr, its per-phase
table; the signing hook a build is given; and the demo's build.

Top-level commands, not a group: cli.py registers them on the root app. The pipeline (and
with it torch and numpy) is imported inside the commands, so that listing commands, which
load this module too, start without it."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.filesize import decimal
from rich.progress import Progress, TaskID

from flare.build.target import MAX_CONCURRENCY, PREFILL_CHUNK
from flare.cli_common import (
    MAX_WORKERS,
    AcceptOption,
    JsonOption,
    RegistryOption,
    bar_columns,
    err,
    note,
    out,
    print_json,
    print_table,
)
from flare.config import Config, load_config, parse_size, parse_target
from flare.errors import IntegrityError, InvalidInputError
from flare.progress import PlainProgress
from flare.registry.commands import open_registry
from flare.registry.registry import Registry
from flare.sign import policy as trust
from flare.store.digest import Digest

if TYPE_CHECKING:  # imported where used: a listing command should not load what builds need
    from flare.build.check import CheckResult
    from flare.build.pipeline import BuildResult, PhaseReport, Signer
    from flare.sign.keys import PrivateKey
    from flare.store.package import Manifest

DEMO_PACKAGE = "tiny-llama"


class BuildProgress:
    """A bar per phase on a terminal; one line per phase in logs."""

    def __init__(self) -> None:
        columns = bar_columns("{task.description:<9}")
        self.bar = Progress(*columns, console=err, disable=not err.is_terminal)
        self.task: TaskID | None = None
        self.plain: PlainProgress | None = None

    def phase_started(self, name: str, total: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, visible=False)
        self.task = self.bar.add_task(name, total=total or None)
        if not err.is_terminal:
            err.print(f"phase {name}", markup=False)
            self.plain = PlainProgress(name, total, note)

    def advance(self, nbytes: int) -> None:
        assert self.task is not None, "a phase advances after it started"
        self.bar.advance(self.task, nbytes)
        if self.plain is not None:
            self.plain.advance(nbytes)

    def phase_finished(self, report: PhaseReport) -> None:
        assert self.task is not None, "a phase finishes after it started"
        self.bar.update(self.task, completed=self.bar.tasks[-1].total or 0, visible=False)

    def note(self, message: str) -> None:
        err.print(message, markup=False)


def _payload_bytes(text: str) -> int:
    """--payload-size in bytes; 0 is refused (a target of no bytes: every tensor a blob)."""
    size = parse_size(text)
    if size < 1:
        raise InvalidInputError(
            f"--payload-size {text} is no size for a payload", "use e.g. 256M (the default)"
        )
    return size


TimeoutOption = Annotated[
    float,
    typer.Option(
        min=1,
        help="Seconds a rank may take to join or stay silent before the build stops (a "
        "server's ranks take rank zero's --timeout).",
    ),
]


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
        int | None,
        typer.Option(min=1, max=MAX_WORKERS, help="Files hashed and payloads written at once."),
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
    no_sign: Annotated[
        bool,
        typer.Option("--no-sign", help="Publish unsigned, even with a signing key configured."),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Build a package from a checkpoint, resumably, and publish it to the registry."""
    from flare.build.check import check_build
    from flare.build.pipeline import Build, BuildRequest
    from flare.build.target import resolve_target

    config = load_config()
    payload_bytes = _payload_bytes(payload_size)
    progress = BuildProgress()
    if check is not None:
        target = open_registry(registry)
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
        payload_bytes=payload_bytes,
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
    )  # checked as it is made: before the registry is opened (and created)
    target = open_registry(registry, create=True)
    with progress.bar:
        sign = None if no_sign else configured_signer(config)
        result = Build(request, target, progress, sign=sign).run()
    print_build(result, as_json)


def is_source(ref: str) -> bool:
    """Whether `flare serve REF` names a checkpoint folder or hub id (ORG/NAME) rather than a
    package: package names have no `/`, and a folder is written as a path (`./tiny`)."""
    return "/" in ref or ref.startswith(("~", "."))


def build_to_serve(source: str, registry: str | None) -> str:
    """Build SOURCE as `flare build` does (resumably; signed with this host's key where one
    is configured), published under a name made from it; say so on stderr (stdout is the
    server's); return the NAME@DIGEST that serve pulls."""
    from flare.build.pipeline import Build, BuildRequest
    from flare.build.target import resolve_target

    config = load_config()
    name = _name_for(source)
    request = BuildRequest(
        source=source,
        name=name,
        staging=config["paths.export_staging"],
        hub_cache=config["paths.hub_cache"],
        target=resolve_target(parse_target(config["build.target"])),
        kernel_cache=config["paths.kernel_cache"],
    )
    progress = BuildProgress()
    with progress.bar:
        target = open_registry(registry, create=True)
        built = Build(request, target, progress, sign=configured_signer(config)).run()
    ref = f"{built.name}@{built.digest.short()}"
    note(f"built {built.name}:latest@{built.digest} from {source}; serve it again as {ref}")
    return f"{built.name}@{built.digest.hex}"


def _name_for(source: str) -> str:
    """A package name from a folder's name or a hub id's NAME: lowercased, other characters
    made `-`."""
    from flare.store.names import check_name

    folder = Path(source).expanduser()
    last = folder.resolve().name if folder.exists() else source.split("@")[0].rstrip("/")
    name = re.sub(r"[^a-z0-9._-]+", "-", last.rsplit("/", 1)[-1].lower()).strip("-._")
    try:
        return check_name(name)
    except InvalidInputError as exc:
        raise InvalidInputError(
            f"cannot make a package name of {source!r}",
            f"build it with a name first: flare build {source} --name NAME, then flare serve NAME",
        ) from exc


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


def print_build(result: BuildResult, as_json: bool) -> None:
    """The build's JSON, or its per-phase table and the package reference."""
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
    workers: Annotated[
        int | None, typer.Option(min=1, max=MAX_WORKERS, help="Payloads written at once.")
    ] = None,
    rehash: Annotated[bool, typer.Option(help="Hash the local checkpoint again.")] = False,
    timeout: TimeoutOption = 300.0,
    accept: AcceptOption = None,
    as_json: JsonOption = False,
) -> None:
    """Take part as rank R in a build or a server rank zero runs with --rendezvous HOST:PORT."""
    from flare.build.join import LOCAL_MODES, Join, JoinRequest
    from flare.rendezvous import group_kind

    kind, group_timeout = group_kind(address, rank, timeout)
    if kind == "serve":
        from flare.serve.launch import join_serve

        join_serve(address, rank, group_timeout, registry, accept)
        return

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


# -- signing a build --------------------------------------------------------------------------


def key_signer(key: PrivateKey, publisher: str) -> Signer:
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


# -- the demo's build -------------------------------------------------------------------------


def build_demo() -> BuildResult:
    """Build, publish and verify the demo package: a tiny seeded Llama (made on first use),
    signed with the development key (sign/demo.py)."""
    from flare.build.pipeline import Build, BuildRequest
    from flare.sign.demo import DEMO_PUBLISHER, development_key

    config = load_config()
    source = config.home / "demo" / DEMO_PACKAGE
    if not (source / "model.safetensors").exists():
        from flare.build.tiny import make_tiny_llama  # numpy: only the demo needs it here

        err.print(f"making a tiny seeded model in {source}", markup=False)
        make_tiny_llama(source)
    request = BuildRequest(
        source=str(source),
        name=DEMO_PACKAGE,
        staging=config["paths.export_staging"],
        hub_cache=config["paths.hub_cache"],
    )
    progress = BuildProgress()
    registry = open_registry(create=True)
    sign = key_signer(development_key(config, note), DEMO_PUBLISHER)
    with progress.bar:
        result = Build(request, registry, progress, sign=sign).run()
    report = registry.verify(f"{DEMO_PACKAGE}@{result.digest.hex}")
    if not report.ok:
        raise IntegrityError(f"the demo package failed verification: {report}")
    return result
