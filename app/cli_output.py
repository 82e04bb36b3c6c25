"""What the ``outbox`` command prints: tables and colour on a terminal (rich), plain text when
piped or redirected (scripts, ``| grep``, cron logs), and ``--json`` for machines.

A terminal is a stream that ``isatty()`` and is not told otherwise: ``NO_COLOR`` (any value,
https://no-color.org) or ``TERM=dumb`` gives the plain form on a terminal too. Progress of a
long operation (republish ``--all``, purge) goes to stderr: a live bar on a terminal, nothing
but the final summary when stderr is not one.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

#: Colours of the row states and verdict levels (rich styles).
STYLES = {
    "confirmed": "green",
    "pending": "yellow",
    "in_flight": "yellow",
    "skipped": "cyan",
    "returned": "bold red",
    "nacked": "bold red",
    "failed": "bold red",
    "OK": "bold green",
    "WARNING": "bold yellow",
    "CRITICAL": "bold red",
    "alive": "green",
    "blocked": "bold red",
    "silent": "bold red",
    "stopped": "dim",
    "bold": "bold",
}


def fancy(stream: TextIO | None = None) -> bool:
    """Rich output on ``stream`` (stdout by default)?"""
    stream = stream or sys.stdout
    if "NO_COLOR" in os.environ or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table; numbers right-aligned."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [_numeric(rows, i) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def _numeric(rows: Sequence[Sequence[Any]], i: int) -> bool:
    return bool(rows) and all(isinstance(row[i], int | float) for row in rows)


def show_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None
) -> None:
    """Print a table: rich with coloured states on a terminal, :func:`plain_table` otherwise."""
    if not fancy():
        if title:
            print(title)
        print(plain_table(headers, rows))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if title:
        say(title, level="bold")
    table = Table(box=box.SIMPLE_HEAD, header_style="bold")
    for i, header in enumerate(headers):
        table.add_column(header, justify="right" if _numeric(rows, i) else "left")
    for row in rows:
        table.add_row(*(Text(cell(v), style=STYLES.get(cell(v), "")) for v in row))
    Console().print(table)


def say(text: str, *, level: str | None = None, stream: TextIO | None = None) -> None:
    """A line, coloured by ``level`` (a verdict level or a row state) on a terminal."""
    stream = stream or sys.stdout
    if level is None or not fancy(stream):
        print(text, file=stream)
        return
    from rich.console import Console
    from rich.text import Text

    Console(file=stream).print(Text(text, style=STYLES.get(level, "")))


class Progress:
    """Rows done out of a total, shown as a live bar on a terminal's stderr."""

    def __init__(self, bar: Any, task: Any) -> None:
        self._bar = bar
        self._task = task

    def advance(self, rows: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, rows)

    def total(self, rows: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, total=rows)


@contextmanager
def progress(what: str, total: int | None) -> Iterator[Progress]:
    if not fancy(sys.stderr):
        yield Progress(None, None)
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import (
        Progress as RichProgress,
    )

    bar = RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with bar:
        yield Progress(bar, bar.add_task(what, total=total))
