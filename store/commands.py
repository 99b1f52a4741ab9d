"""`flare store`: put, get, list, measure and verify blobs; and the verify report's printers,
which `flare registry verify` and `flare verify` share."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.filesize import decimal

from flare.cli_common import (
    MAX_WORKERS,
    JsonOption,
    NoTruncOption,
    RestoreOption,
    VerifyDryRunOption,
    out,
    print_json,
    print_table,
    progress_bar,
)
from flare.config import load_config
from flare.errors import IntegrityError, InvalidInputError, NotFoundError
from flare.store.blobs import BlobStore, PutResult
from flare.store.digest import Digest, parse_prefix
from flare.store.reports import VerifyReport

store_app = typer.Typer(help="The content-addressed blob store.", no_args_is_help=True)

StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="Store location (path or URL). Default: the registry's."),
]


def open_store(location: str | None, existing: bool = False) -> BlobStore:
    """The store a command acts on: --store, else the configured registry's."""
    config = load_config()
    store = BlobStore(location or config.registry, config.store_encoding, config.zstd_level)
    if existing:
        store.require_existing()
    return store


def input_bytes(paths: Sequence[Path]) -> int:
    """Total size of the files under the given paths, for a progress bar's total."""
    total = 0
    for path in paths:
        if path.is_dir():
            total += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        elif path.exists():
            total += path.stat().st_size
    return total


@store_app.command("put")
def store_put(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders to store.")],
    no_link: Annotated[
        bool, typer.Option("--no-link", help="Copy even where linking works.")
    ] = False,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Store files (folders recursively); linked where the filesystem allows, always hashed."""
    blobs = open_store(store)
    rows = []
    with progress_bar("put", input_bytes(paths)) as advance:
        for path in paths:
            if path.is_dir():
                results = blobs.put_tree(path, link=not no_link, progress=advance)
                rows += [(str(path / rel), r) for rel, r in results.items()]
            else:
                rows.append((str(path), blobs.put_file(path, link=not no_link, progress=advance)))
    if as_json:
        print_json([{"path": p, **_put_fields(r)} for p, r in rows])
        return
    print_table(
        f"stored in {blobs.location}",
        ("digest", "size", "method", "path"),
        [(r.digest.short(16), decimal(r.size), r.method, p) for p, r in rows],
    )


def _put_fields(result: PutResult) -> dict[str, Any]:
    return {"digest": str(result.digest), "size": result.size, "method": result.method}


@store_app.command("get")
def store_get(
    digest: Annotated[str, typer.Argument(help="Digest or unique prefix (8+ hex digits).")],
    dest: Annotated[
        Path, typer.Argument(help="File to write (or a folder to write into); - for stdout.")
    ],
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Write a blob's content to a file (or stdout), verified against its digest."""
    parse_prefix(digest)  # a malformed digest is the first thing to report
    to_stdout = str(dest) == "-"
    if to_stdout and as_json:
        raise InvalidInputError("--json and - both want stdout", "write to a file, or drop --json")
    blobs = open_store(store, existing=True)
    resolved = blobs.resolve(digest)
    info = blobs.require(resolved)
    with progress_bar("get", blobs.plain_size(info)) as advance:
        if to_stdout:
            blobs.stream(resolved, sys.stdout.buffer, progress=advance)
            return
        written, size = blobs.get(resolved, dest, progress=advance)
    if as_json:
        print_json({"digest": str(resolved), "dest": str(written), "size": size})
    else:
        out.print(f"wrote {written} ({decimal(size)}, verified {resolved.short()})")


@store_app.command("ls")
def store_ls(
    store: StoreOption = None, as_json: JsonOption = False, _no_trunc: NoTruncOption = False
) -> None:
    """List the blobs in the store."""
    blobs = open_store(store, existing=True)
    infos = sorted(blobs.iter_blobs(), key=lambda i: i.digest)
    if as_json:
        print_json([{**asdict(i), "digest": str(i.digest)} for i in infos])
        return
    print_table(
        f"{len(infos)} blobs in {blobs.location}",
        ("digest", "encoding", "stored"),
        [(i.digest, i.encoding, decimal(i.stored_size)) for i in infos],
    )


@store_app.command("du")
def store_du(store: StoreOption = None, as_json: JsonOption = False) -> None:
    """Show what the store holds and the free space beside it."""
    blobs = open_store(store, existing=True)
    usage = blobs.usage()
    if as_json:
        print_json({"location": blobs.location, **asdict(usage)})
        return
    free = "unknown" if usage.free_bytes is None else decimal(usage.free_bytes)
    print_table(
        f"usage of {blobs.location}",
        ("blobs", "stored", "temp", "quarantine", "trash", "free"),
        [
            (
                usage.blobs,
                decimal(usage.stored_bytes),
                decimal(usage.temp_bytes),
                decimal(usage.quarantine_bytes),
                decimal(usage.trash_bytes),
                free,
            )
        ],
    )


@store_app.command("verify")
def store_verify(
    digests: Annotated[
        list[str] | None, typer.Argument(help="Digests to check (default: every blob).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, max=MAX_WORKERS, help="Blobs hashed at once.")
    ] = None,
    dry_run: VerifyDryRunOption = False,
    restore: RestoreOption = False,
    store: StoreOption = None,
    as_json: JsonOption = False,
) -> None:
    """Re-hash blobs in parallel; quarantine corrupt ones. Exit 6 if corrupt, 3 if missing."""
    blobs = open_store(store, existing=True)
    wanted = [_verify_target(blobs, d) for d in digests] if digests else None
    infos = [blobs.locate(d) for d in wanted] if wanted else list(blobs.iter_blobs())
    total = sum(i.stored_size for i in infos if i)
    with progress_bar("verify", total) as advance:
        report = blobs.verify(wanted, workers, advance, dry_run=dry_run, restore=restore)
    if as_json:
        print_json({**verify_fields(report), "ok": report.ok})
    else:
        print_verify(report, "flare store verify --restore")
    exit_for(report)


def _verify_target(blobs: BlobStore, text: str) -> Digest:
    """A full digest is checked even when absent (reported missing); a prefix must resolve."""
    return Digest.parse(text) if len(text.removeprefix("blake3:")) == 64 else blobs.resolve(text)


def verify_fields(report: VerifyReport) -> dict[str, Any]:
    """A verify report as JSON fields."""
    return {
        **asdict(report),
        "corrupt": [str(d) for d in report.corrupt],
        "missing": [str(d) for d in report.missing],
        "reread": [str(d) for d in report.reread],
    }


def exit_for(report: VerifyReport) -> None:
    """Exit 6 if anything is corrupt, else 3 if anything is missing."""
    if report.corrupt:
        raise typer.Exit(IntegrityError.exit_code)
    if report.missing:
        raise typer.Exit(NotFoundError.exit_code)


def print_verify(report: VerifyReport, restore_command: str, ok: bool = True) -> None:
    """The report's lines, then `ok`, or `FAILED` if the report (or the caller: `ok`) says so."""
    for key in report.restored:
        out.print(f"restored: {key} (it hashes right again)")
    out.print(f"checked {report.checked} blobs ({decimal(report.checked_bytes)})")
    for digest in report.reread:
        out.print(f"intact on a second read (the first read was stale): {digest}")
    moved = report.quarantined or ["--dry-run: left in place"] * len(report.corrupt)
    for digest, where in zip(report.corrupt, moved, strict=True):
        out.print(f"corrupt: {digest} ({where if report.dry_run else f'moved to {where}'})")
    if report.quarantined:
        out.print(f"quarantined blobs that hash right later are put back by `{restore_command}`")
    for digest in report.missing:
        out.print(f"missing: {digest}")
    for key in report.stray:
        out.print(f"not a blob name (left in place): {key}")
    out.print("ok" if report.ok and ok else "FAILED")
