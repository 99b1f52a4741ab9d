"""What every component's commands share: the consoles, the JSON and table printers, the
progress bar, and the options several command groups take with the same meaning.

A shared module at the top of the package, like errors.py: the `commands` module of each
component imports it, and it imports nothing of flare, so a listing command loads no more
than typer and rich through it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from flare.progress import PlainProgress

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
RegistryOption = Annotated[
    str | None, typer.Option("--registry", help="Registry location (default: the config's).")
]
AcceptOption = Annotated[
    str | None,
    typer.Option(
        "--dangerously-accept-publisher",
        metavar="NAME",
        help="Also accept a valid signature by NAME's untrusted (never a revoked) key, this once.",
    ),
]
VerifyDryRunOption = Annotated[
    bool, typer.Option("--dry-run", help="Report corrupt blobs; move nothing, sweep nothing.")
]
RestoreOption = Annotated[
    bool,
    typer.Option("--restore", help="First put back quarantined blobs that now hash right."),
]


def print_json(data: Any) -> None:
    """JSON on stdout: indented on a terminal, one compact line for scripts (json's C encoder
    runs only without indentation: 10,000 packages print in a tenth of the time)."""
    indent = 2 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(data, indent=indent, sort_keys=True, default=str) + "\n")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table for people."""
    table = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for column in columns:
        table.add_column(column, no_wrap=column == "digest", overflow="fold")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    out.print(table)


def print_done(as_json: bool, data: dict[str, Any], message: str) -> None:
    """What a command that changes one thing prints: its fields as JSON, or one line."""
    if as_json:
        print_json(data)
    else:
        out.print(message)


def bar_columns(description: str) -> tuple[ProgressColumn, ...]:
    """A bytes bar's columns: what, how far, rate, time left."""
    return (
        TextColumn(description),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )


@contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A bytes progress bar on stderr (rate, time left); yields the advance callback."""
    if not err.is_terminal:  # a log or a pipe: a plain line every few seconds instead
        yield PlainProgress(description, total, note).advance
        return
    columns = bar_columns("{task.description}")
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def note(line: str) -> None:
    """One plain line on stderr (no markup)."""
    err.print(line, markup=False)
