"""What every component's commands share: the consoles, the JSON and table printers, the
progress bar, and the options several command groups take with the same meaning.

A shared module at the top of the package, like errors.py: the `commands` module of each
component imports it, and it imports nothing of flare, so a listing command loads no more
than typer and rich through it.
"""

from __future__ import annotations

import json
import os
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

out = Console(
    highlight=False,
    soft_wrap=True,
    width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200,
)
_tables = {"whole": False}
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]

MAX_WORKERS = 256
"""The most a `--workers` option takes: each worker is a thread (and its stack), and more than
this only queue on the same disks and network; 0 or fewer is no worker at all."""


def _show_whole(wanted: bool) -> None:
    _tables["whole"] = _tables["whole"] or wanted


NoTruncOption = Annotated[
    bool,
    typer.Option(
        "--no-trunc",
        help="Show long cells whole (default: cut to the terminal's width, ending in …).",
        callback=_show_whole,
        expose_value=False,
    ),
]
"""Read by print_table: commands declare it (as `_no_trunc`) and never use its value."""
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
    """A table for people: one line per row, as docker prints them. Where the rows are wider
    than the terminal (or COLUMNS; 200 when not a terminal), the widest columns are cut first,
    each cut cell ending in an ellipsis; --no-trunc prints every cell whole."""
    cells = [[str(cell) for cell in row] for row in rows]
    natural = [max(len(c) for c in column) for column in zip(columns, *cells, strict=True)]
    gaps = 2 * (len(columns) - 1)
    whole = _tables["whole"]
    widths = natural if whole else _fit(natural, out.width - gaps)
    table = Table(title=title, title_justify="left", box=None, pad_edge=False)
    for column, width in zip(columns, widths, strict=True):
        table.add_column(column, no_wrap=True, overflow="ellipsis", max_width=width)
    for row in cells:
        table.add_row(*row)
    if not whole:
        out.print(table)
        return
    room = out.width
    out.width = max(room, sum(natural) + gaps)  # rich fits any table to the console's width
    try:
        out.print(table)
    finally:
        out.width = room


def _fit(widths: list[int], room: int) -> list[int]:
    """Narrow the widest columns, one character at a time, until they fit `room`: first
    down to 12 characters (a short digest, a date, a size stay whole while long paths and
    texts give way), then, on a narrow terminal, down to 3 (an ellipsis and two more)."""
    fitted = list(widths)
    for floor in (12, 3):
        while sum(fitted) > room:
            widest = max(range(len(fitted)), key=fitted.__getitem__)
            if fitted[widest] <= floor:
                break
            fitted[widest] -= 1
    return fitted


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
