"""`flare registry`: list, show, tag, pin, remove, measure, reindex, migrate, collect garbage,
verify and copy packages; and `open_registry`, how every command that acts on a registry
opens it."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer
from rich.filesize import decimal

from flare.cli_common import (
    MAX_WORKERS,
    JsonOption,
    NoTruncOption,
    RegistryOption,
    RestoreOption,
    VerifyDryRunOption,
    err,
    out,
    print_done,
    print_json,
    print_table,
    progress_bar,
)
from flare.config import load_config, parse_duration
from flare.errors import IntegrityError, InvalidInputError
from flare.registry.database import UnusableIndexError, set_aside, sqlite_file
from flare.registry.refs import BadRef, BadRefError, TagMove
from flare.registry.registry import Registry, index_database
from flare.sign import policy as trust
from flare.sign.commands import warn_accepted
from flare.sign.errors import UntrustedError
from flare.store.commands import exit_for, print_verify, verify_fields
from flare.store.digest import Digest
from flare.store.names import check_name

if TYPE_CHECKING:  # imported where used: a listing command should not load cryptography
    from flare.sign.verify import Verdict
    from flare.store.package import Manifest

registry_app = typer.Typer(
    help="Packages in the registry: list, tag, pin, remove, collect garbage, verify, copy.",
    no_args_is_help=True,
)


def open_registry(
    location: str | None = None, set_aside_corrupt: bool = False, create: bool = False
) -> Registry:
    """The registry a command acts on: --registry, else the configured one.

    For reindex, an unreadable SQLite index is moved aside (kept, renamed) and a new one made.
    """
    if location is not None:
        check_location(location, "leave --registry out for the configured registry")
    config = load_config()
    where = location or config.registry
    database = index_database(where, config.registry, config.database, config.home)
    options = (config.store_encoding, config.zstd_level)
    try:
        opened = Registry(where, database, *options, create, config.cache_window)
        if set_aside_corrupt:
            _require_intact(opened)
    except UnusableIndexError as exc:
        broken = sqlite_file(database)
        if not (set_aside_corrupt and exc.corrupt and broken is not None):
            raise
        err.print(f"moved the unreadable index DB to {set_aside(broken)}", markup=False)
        opened = Registry(where, database, *options, cache_window=config.cache_window)
    for note in opened.notes:
        err.print(note, markup=False)
    return opened


def _require_intact(opened: Registry) -> None:
    """Refuse (as corrupt) an index DB that opens but has damaged pages: reindex's first
    write would fail on them, and only a DB that is moved aside can be made anew."""
    problem = opened.db.check()
    if problem is not None:
        opened.db.dispose()
        raise opened.db.damaged(problem)


def check_location(location: str, otherwise: str) -> None:
    """Refuse an empty registry location (an unset shell variable, most often), saying what
    else to do."""
    if not location.strip():
        raise InvalidInputError(
            f"the registry location {location!r} is empty", f"give a path or URL, or {otherwise}"
        )


def signature_verdict(
    registry: Registry,
    digest: Digest,
    manifest: Manifest,
    policy: trust.TrustPolicy,
    accept: str | None,
) -> Verdict | UntrustedError:
    """The signature check's verdict, or its refusal (reported after the blobs' figures)."""
    from flare.sign.verify import check_trusted

    try:
        verdict = check_trusted(registry.signatures(digest), digest, manifest, policy, accept)
    except UntrustedError as exc:
        return exc
    if verdict.accepted_dangerously:
        warn_accepted(verdict)
    return verdict


@registry_app.command("ls")
def registry_ls(
    name: Annotated[str | None, typer.Option(help="Only packages of this name.")] = None,
    model: Annotated[str | None, typer.Option(help="Only packages of this model id.")] = None,
    registry: RegistryOption = None,
    as_json: JsonOption = False,
    _no_trunc: NoTruncOption = False,
) -> None:
    """List published packages with their tags, sizes and pins."""
    if name is not None:
        check_name(name)  # a name no package can have is a typo, not an empty listing
    rows = open_registry(registry).listings(name, model)
    if as_json:
        print_json([vars(r) for r in rows])
        return
    columns = (
        "name",
        "tags",
        "digest",
        "model",
        "recipe",
        "ranks",
        "size",
        "unique",
        "pinned",
        "created",
        "publisher",
    )
    print_table(
        "",
        columns,
        [
            (
                r.name,
                ",".join(r.tags),
                r.digest[7:19],
                r.model,
                r.recipe,
                r.ranks,
                decimal(r.size),
                decimal(r.unique_size),
                "yes" if r.pinned else "",
                r.created,
                r.publisher or "",
            )
            for r in rows
        ],
    )


@registry_app.command("show")
def registry_show(
    ref: str,
    registry: RegistryOption = None,
    as_json: JsonOption = False,
    _no_trunc: NoTruncOption = False,
) -> None:
    """Print a package's manifest."""
    name, digest, manifest = open_registry(registry).manifest(ref)
    if as_json:
        print_json(
            {"name": name, "digest": str(digest), "manifest": manifest.model_dump(mode="json")}
        )
        return
    out.print(f"{name or ''}@{digest}")
    out.print(
        f"model {manifest.model.id}@{manifest.model.revision or '-'}, recipe "
        f"{manifest.recipe.name}/{manifest.recipe.version}, {manifest.ranks} ranks, "
        f"{len(manifest.payloads)} payloads, {decimal(manifest.total_size())}"
    )
    rows = [
        (
            "payload",
            f"ranks {list(p.ranks)}: {len(p.tensors)} tensors",
            p.digest[7:19],
            decimal(p.size),
        )
        for p in manifest.payloads
    ]
    rows += [(a.kind, a.path, a.digest[7:19], decimal(a.size)) for a in manifest.artifacts]
    print_table("", ("kind", "contents", "digest", "size"), rows)


@registry_app.command("tag")
def registry_tag(
    ref: str,
    name_tag: Annotated[str, typer.Argument(metavar="NAME:TAG")],
    registry: RegistryOption = None,
    as_json: JsonOption = False,
) -> None:
    """Point NAME:TAG at the package REF names (moving it, if it named another, says so)."""
    name, tag, digest, move = open_registry(registry).tag(ref, name_tag)
    moved = [] if move is None else [move]
    print_moves(moved)
    data = {"name": name, "tag": tag, "digest": str(digest), "moved": move_fields(moved)}
    print_done(as_json, data, f"{name}:{tag} -> {digest}")


def print_moves(moved: list[TagMove]) -> None:
    """One line on stderr per tag moved off another package: a notice, not a refusal, since
    the move may have left that package to gc."""
    for move in moved:
        err.print(move.notice(), markup=False)


def move_fields(moved: list[TagMove]) -> list[dict[str, object]]:
    """The moves as --json prints them (an empty list when no tag moved)."""
    return [move.fields() for move in moved]


@registry_app.command("untag")
def registry_untag(
    name_tag: Annotated[str, typer.Argument(metavar="NAME:TAG")],
    registry: RegistryOption = None,
    as_json: JsonOption = False,
) -> None:
    """Remove the tag NAME:TAG; the package stays (gc keeps it while a tag or pin names it)."""
    name, tag, digest = open_registry(registry).untag(name_tag)
    data = {"name": name, "tag": tag, "digest": str(digest)}
    print_done(as_json, data, f"untagged {name}:{tag} (was {digest})")


@registry_app.command("pin")
def registry_pin(ref: str, registry: RegistryOption = None, as_json: JsonOption = False) -> None:
    """Pin a package: gc never removes it, rm refuses it."""
    name, digest = open_registry(registry).pin(ref)
    data = {"name": name, "digest": str(digest), "pinned": True}
    print_done(as_json, data, f"pinned {name}@{digest}")


@registry_app.command("unpin")
def registry_unpin(ref: str, registry: RegistryOption = None, as_json: JsonOption = False) -> None:
    """Unpin a package."""
    name, digest = open_registry(registry).pin(ref, pinned=False)
    data = {"name": name, "digest": str(digest), "pinned": False}
    print_done(as_json, data, f"unpinned {name}@{digest}")


@registry_app.command("rm")
def registry_rm(ref: str, registry: RegistryOption = None, as_json: JsonOption = False) -> None:
    """Remove a package from its name (and its tags); gc frees its blobs later."""
    name, digest, tags = open_registry(registry).remove(ref)
    suffix = f" (tags {', '.join(tags)})" if tags else ""
    data = {"name": name, "digest": str(digest), "tags": tags}
    print_done(as_json, data, f"removed {name}@{digest}{suffix}")


@registry_app.command("du")
def registry_du(registry: RegistryOption = None, as_json: JsonOption = False) -> None:
    """Bytes the packages take: total, shared between packages, reclaimable by gc now."""
    target = open_registry(registry)
    from flare.registry.gc import collect

    usage = {**target.usage(), "reclaimable": collect(target, 0.0, dry_run=True).freed_bytes}
    if as_json:
        print_json(usage)
        return
    print_table("", ("total", "shared", "reclaimable"), [tuple(decimal(v) for v in usage.values())])


@registry_app.command("reindex")
def registry_reindex(registry: RegistryOption = None, as_json: JsonOption = False) -> None:
    """Rebuild the index DB from the store (after a corrupt or lost DB). Exit 14 if bad ref
    files were left out."""
    report = open_registry(registry, set_aside_corrupt=True).reindex()
    if as_json:
        print_json({"packages": report.packages, "bad_refs": _bad_ref_fields(report.bad)})
    else:
        out.print(f"indexed {report.packages} package records")
        _print_bad_refs(report.bad, "left out: ")
    if report.bad:
        raise typer.Exit(BadRefError.exit_code)


def _bad_ref_fields(bad: list[BadRef]) -> list[dict[str, str]]:
    return [{"file": ref.key, "problem": ref.problem} for ref in bad]


def _print_bad_refs(bad: list[BadRef], prefix: str = "") -> None:
    for ref in bad:
        out.print(f"{prefix}bad ref file {ref}", markup=False)


@registry_app.command("migrate")
def registry_migrate(registry: RegistryOption = None, as_json: JsonOption = False) -> None:
    """Apply the index DB's schema migrations (also done whenever the registry is opened)."""
    head = open_registry(registry).db.migrate()
    print_done(as_json, {"schema": head}, f"index DB schema at {head}")


@registry_app.command("gc")
def registry_gc(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would go; change nothing.")
    ] = False,
    grace: Annotated[str, typer.Option(help="Keep blobs touched this recently.")] = "1h",
    registry: RegistryOption = None,
    as_json: JsonOption = False,
) -> None:
    """Remove blobs no tag, pin or live lease reaches and untouched for the grace period."""
    from flare.registry.gc import collect

    report = collect(open_registry(registry), parse_duration(grace), dry_run)
    if as_json:
        print_json(asdict(report))
        return
    verb = "would free" if dry_run else "freed"
    out.print(
        f"{verb} {decimal(report.freed_bytes)} in {len(report.deleted)} blobs; kept "
        f"{report.marked} reachable from {report.roots} roots, {report.kept_recent} recent"
    )
    for forgotten in report.forgotten:
        out.print(f"forgot {forgotten}")
    for digest in report.put_back:
        out.print(f"put back {digest} from the trash (in use again)")
    if report.in_trash:
        out.print(f"{decimal(report.in_trash)} of swept blobs wait in trash/ for a later gc")


@registry_app.command("verify")
def registry_verify(
    ref: Annotated[str | None, typer.Argument(help="Package (default: every package).")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=MAX_WORKERS, help="Blobs hashed at once.")
    ] = None,
    signatures: Annotated[
        bool,
        typer.Option("--signatures", help="Also check each package's signature against trust."),
    ] = False,
    dry_run: VerifyDryRunOption = False,
    restore: RestoreOption = False,
    registry: RegistryOption = None,
    as_json: JsonOption = False,
) -> None:
    """Re-hash packages' blobs in parallel; check every ref file. Exit 6 if a blob is corrupt,
    else 14 if a ref file is bad, else 3 if a blob is missing, else 11.

    11: with --signatures, a package is unsigned or signed by no trusted publisher."""
    target = open_registry(registry)
    refused = _refused_packages(target, ref) if signatures else []
    if not as_json:
        for refusal in refused:
            out.print(f"untrusted: {refusal}", markup=False)
    report = target.verify(ref, workers, dry_run=dry_run, restore=restore)
    bad = [] if ref else target.bad_refs()
    damage = _index_damage(target)
    if as_json:
        ok = report.ok and not refused and not bad and damage is None
        fields = {**verify_fields(report), "bad_refs": _bad_ref_fields(bad)}
        print_json({**fields, "index_db": damage, "untrusted": refused, "ok": ok})
    else:
        _print_bad_refs(bad)
        if damage is not None:
            out.print(damage, markup=False)
        print_verify(report, "flare registry verify --restore", ok=not bad and damage is None)
    if report.corrupt:
        raise typer.Exit(IntegrityError.exit_code)
    if damage is not None:
        raise typer.Exit(UnusableIndexError.exit_code)
    if bad:
        raise typer.Exit(BadRefError.exit_code)
    exit_for(report)
    if refused:
        raise typer.Exit(UntrustedError.exit_code)


def _index_damage(registry: Registry) -> str | None:
    """The line that says the index DB is damaged, if SQLite's quick check finds it so: the
    blobs verify hashes are found through the ref files, so a damaged DB would go unseen."""
    problem = registry.db.check()
    return None if problem is None else str(registry.db.damaged(problem))


def _refused_packages(registry: Registry, ref: str | None) -> list[str]:
    """One line per package whose signatures this host's trust policy refuses."""
    policy = trust.load_policy(load_config())
    refused = []
    for digest in registry.packages(ref):
        if not (registry.store.has(digest) and registry.holds_index(digest)):
            continue  # reported missing, or as a bad ref file
        manifest = registry.manifest(digest.hex)[2]
        verdict = signature_verdict(registry, digest, manifest, policy, None)
        if isinstance(verdict, UntrustedError):
            refused.append(str(verdict))
    return refused


@registry_app.command("copy")
def registry_copy(
    ref: str,
    to: Annotated[str, typer.Option("--to", help="Destination registry location.")],
    source: Annotated[str | None, typer.Option("--from", help="Source registry.")] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=MAX_WORKERS, help="Blobs copied at once.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Copy a package (blobs, index, tags, pins) to another registry; resumable, verified.

    A tag of the destination that named another package is moved, and said so on stderr."""
    check_location(to, "name the registry to copy to")  # before the source is opened
    origin, dest = open_registry(source), open_registry(to, create=True)
    _, _, manifest = origin.manifest(ref)
    with progress_bar("copy", manifest.total_size()) as advance:
        from flare.registry.copy import copy_package

        report = copy_package(origin, dest, ref, workers, advance)
    print_moves(report.moved)
    if as_json:
        fields = {**asdict(report), "digest": str(report.digest)}
        print_json(fields | {"moved": move_fields(report.moved)})
        return
    how = ", ".join(f"{count} {method}" for method, count in sorted(report.methods.items()))
    out.print(
        f"copied {report.name or ''}@{report.digest} to {dest.location} "
        f"({decimal(report.bytes)}; {how})"
    )
