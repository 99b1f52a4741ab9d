"""`flare cache` (what this host's package cache holds: list, remove, prune) and `flare ps`
(the servers running on a registry's packages, on every host that shares it).

Both read leases: a server holds one in its registry and one in the host cache
(serve/launch.py), so `ps` finds it from any host and the cache never drops what it maps."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated

import typer
from rich.filesize import decimal

from flare.cli_common import JsonOption, NoTruncOption, RegistryOption, out, print_json, print_table
from flare.config import load_config
from flare.registry.commands import open_registry
from flare.registry.leases import live_leases
from flare.serve.cache import CachedPackage, HostCache, Removal

cache_app = typer.Typer(
    help="This host's package cache: list, remove, prune.", no_args_is_help=True
)


def _host_cache() -> HostCache:
    return HostCache(load_config()["paths.package_cache"])


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp).isoformat(sep=" ", timespec="seconds")


def _fields(package: CachedPackage) -> dict[str, object]:
    return {
        "name": package.name,
        "digest": str(package.digest),
        "size": package.size,
        "last_used": _when(package.last_used),
        "servers": package.servers,
    }


@cache_app.command("ls")
def cache_ls(as_json: JsonOption = False, _no_trunc: NoTruncOption = False) -> None:
    """List the packages pulled to this host: size, last pulled or served, live servers."""
    packages = _host_cache().packages()
    if as_json:
        print_json([_fields(p) for p in packages])
        return
    rows = [
        (
            p.name,
            p.digest.short(),
            decimal(p.size),
            _when(p.last_used),
            ", ".join(p.servers) or "",
        )
        for p in packages
    ]
    print_table("", ("name", "digest", "size", "last used", "served by"), rows)


@cache_app.command("rm")
def cache_rm(
    ref: Annotated[str, typer.Argument(help="NAME (each of its digests), NAME@DIGEST or DIGEST.")],
    as_json: JsonOption = False,
) -> None:
    """Remove a package from this host's cache (the registry keeps it; a pull fetches it
    again). Exit 9 if a live server serves it."""
    cache = _host_cache()
    _print_removal(cache.remove(cache.find(ref)), as_json)


@cache_app.command("prune")
def cache_prune(as_json: JsonOption = False) -> None:
    """Remove every cached package no live server on this host serves, and stray blobs."""
    _print_removal(_host_cache().prune(), as_json)


def _print_removal(removal: Removal, as_json: bool) -> None:
    if as_json:
        packages = [_fields(p) for p in removal.packages]
        print_json({"packages": packages, "blobs": removal.blobs, "bytes": removal.bytes})
        return
    for package in removal.packages:
        out.print(f"removed {package.name}@{package.digest} from the cache", markup=False)
    out.print(f"freed {decimal(removal.bytes)} in {removal.blobs} blobs")


def ps_command(
    registry: RegistryOption = None, as_json: JsonOption = False, _no_trunc: NoTruncOption = False
) -> None:
    """List the live servers of a registry's packages, on every host that shares it."""
    leases = live_leases(open_registry(registry).store)
    servers = sorted((s for s in leases if s.purpose == "serve"), key=lambda s: s.started)
    if as_json:
        print_json(
            [
                {
                    "host": s.host(),
                    "pid": s.pid(),
                    "package": s.what,
                    "url": s.url,
                    "since": _when(s.started),
                }
                for s in servers
            ]
        )
        return
    rows = [(s.host(), s.pid(), _short(s.what), s.url, _ago(s.started)) for s in servers]
    print_table("", ("host", "pid", "package", "url", "since"), rows)


def _short(what: str) -> str:
    """NAME@blake3:HEX as NAME@ its first 12 hex digits, as listings show digests."""
    name, _, digest = what.partition("@")
    return f"{name}@{digest.removeprefix('blake3:')[:12]}"


def _ago(started: float) -> str:
    seconds = max(0, int(time.time() - started))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 7200:
        return f"{seconds // 60} min ago"
    return _when(started)
