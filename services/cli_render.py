"""The operator CLI's output through rich: tables, state colours, progress bars and the live job view.

Colours follow rich's terminal detection: stdout or stderr that is not a terminal gets plain text with no
escape sequences at all, and so does a terminal when NO_COLOR is set (https://no-color.org) or TERM=dumb.
Tables are laid out at an unlimited width whether or not a terminal shows them, so a pipe (`castor jobs
list | grep`) and a terminal see the same rows, never wrapped or cut at 80 columns; a terminal only adds
colour. `--json` never comes here: it prints the API's documents unchanged.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

# A job's, a machine's and a failure's states, coloured by what they ask of the operator.
STATE_STYLES = {
    "running": "green",
    "healthy": "green",
    "ok": "green",
    "recovered": "green",
    "completed": "bold green",
    "pending": "cyan",
    "registered": "cyan",
    "recovering": "yellow",
    "suspect": "yellow",
    "detected": "yellow",
    "restoring": "yellow",
    "stalled": "bold red",
    "failed": "bold red",
    "lost": "red",
    "stopped": "dim",
    "replaced": "dim",
    "skipped": "dim",
}
STATE_HEADERS = frozenset({"STATE", "REPLICATION"})
UNLIMITED = 100_000  # columns: a table is never wrapped or truncated to fit


def stdout_console() -> Console:
    """Where the commands print: colour only on a terminal without NO_COLOR (rich decides)."""
    return Console(highlight=False, soft_wrap=True)


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def styled(text: str, style: str | None = None) -> Text:
    return Text(text, style=style or STATE_STYLES.get(text, ""))


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def make_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> Table:
    """Columns two spaces apart, no borders; numeric columns right-aligned; STATE cells coloured."""
    raw = [list(row) for row in rows]
    table = Table(
        box=None,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
        header_style="bold",
        expand=False,
    )
    for i, header in enumerate(headers):
        numeric = any(row[i] is not None for row in raw) and all(
            row[i] is None or (isinstance(row[i], int | float) and not isinstance(row[i], bool))
            for row in raw
        )
        table.add_column(header, justify="right" if numeric else "left", no_wrap=True)
    for row in raw:
        cells = []
        for header, value in zip(headers, row, strict=True):
            text = cell(value)
            cells.append(styled(text) if header in STATE_HEADERS else Text(text))
        table.add_row(*cells)
    return table


def to_text(renderable: Any, like: Console | None = None, indent: str = "") -> str:
    """A renderable as text at an unlimited width, with `like`'s colours (none when it is None or not a
    terminal); trailing blanks cut from each line as the hand-aligned tables had them."""
    colour = like is not None and like.is_terminal and not like.no_color and like.color_system is not None
    capture = Console(
        file=io.StringIO(),
        width=UNLIMITED,
        force_terminal=colour,
        color_system=like.color_system if colour and like is not None else None,  # type: ignore[arg-type]
        no_color=not colour,
        highlight=False,
        legacy_windows=False,
    )
    capture.print(renderable, end="")
    text = capture.file.getvalue()  # type: ignore[attr-defined]
    lines = [_rstrip(line) for line in text.split("\n")]
    return "\n".join(indent + line if line else line for line in lines).rstrip("\n")


def _rstrip(line: str) -> str:
    # With colour a line may end in a reset sequence after its padding: cut the padding before it.
    reset = "\x1b[0m"
    if line.endswith(reset):
        return line[: -len(reset)].rstrip() + reset
    return line.rstrip()


def render_table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "", like: Console | None = None
) -> str:
    """The table as text: plain unless `like` is a colour terminal."""
    return to_text(make_table(headers, rows), like, indent)


def wait_progress(console: Console, enabled: bool) -> Progress:
    """`castor jobs wait`: a spinner, the time waited and the job's state line; transient."""
    return Progress(
        SpinnerColumn(),
        TimeElapsedColumn(),  # before the text: a narrow terminal cuts the text, never the time
        TextColumn("{task.description}"),
        console=console,
        transient=True,
        disable=not enabled,
    )


def transfer_progress(console: Console, enabled: bool) -> Progress:
    """Downloads and writes: a bar, the percentage, what is being done and the time spent; transient."""
    return Progress(
        BarColumn(bar_width=30),
        TaskProgressColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )
