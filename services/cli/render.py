"""The operator CLI's output through rich: tables, state colours, progress bars and the live job view.

Colours follow rich's terminal detection: stdout or stderr that is not a terminal gets plain text with no
escape sequences at all, and so does a terminal when NO_COLOR is set (https://no-color.org) or TERM=dumb.
Tables are laid out at an unlimited width whether or not a terminal shows them, so a pipe (`castor jobs
list | grep`) and a terminal see the same rows, never wrapped or cut at 80 columns; a terminal only adds
colour. `--json` never comes here: it prints the API's documents unchanged.

And the plain formatting every command shares: durations, relative and absolute timestamps, field
lists, sizes, JSON documents.
"""

from __future__ import annotations

import functools
import io
import json
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

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
    """The table as text: aligned columns two spaces apart, numeric columns right-aligned, the last column
    not padded (a rich table laid out at an unlimited width); plain unless `like` is a colour terminal."""
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


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_duration(seconds: float | None) -> str:
    """1.2 s, 45 s, 3 min, 3 min 12 s, 2 h 5 min, 3 d 4 h."""
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0 s"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    total = round(seconds)
    if total < 3600:
        minutes, secs = divmod(total, 60)
        return f"{minutes} min {secs} s" if secs and minutes < 10 else f"{minutes} min"
    if total < 86400:
        hours, rest = divmod(total, 3600)
        return f"{hours} h {rest // 60} min" if rest >= 60 else f"{hours} h"
    days, rest = divmod(total, 86400)
    return f"{days} d {rest // 3600} h" if rest >= 3600 else f"{days} d"


def format_ago(value: str | datetime | None, now: datetime | None = None) -> str:
    """A timestamp relative to now: "12 s ago", "3 min ago"; "-" when there is none."""
    moment = parse_time(value) if isinstance(value, str) or value is None else value
    if moment is None:
        return "-"
    delta = ((now or datetime.now(UTC)) - moment).total_seconds()
    if abs(delta) < 1:
        return "just now"
    if delta < 0:
        return "in " + _coarse(-delta)
    return _coarse(delta) + " ago"


def _coarse(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def format_time(value: str | datetime | None, now: datetime | None = None) -> str:
    """An absolute local timestamp, with the relative one after it."""
    moment = parse_time(value) if isinstance(value, str) or value is None else value
    if moment is None:
        return "-"
    local = moment.astimezone()
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or ''} ({format_ago(moment, now)})".replace("  ", " ")


@functools.cache
def _stdout() -> Console:
    return stdout_console()


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "") -> str:
    """render_table for stdout: the same layout, with state colours when stdout is a colour terminal."""
    return render_table(headers, rows, indent, like=_stdout())


def render_fields(pairs: Sequence[tuple[str, object]], indent: str = "  ") -> str:
    width = max(len(key) for key, _ in pairs) + 1
    return "\n".join(f"{indent}{(key + ':').ljust(width)}  {cell(value)}" for key, value in pairs)


def shorten(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_json(document: Any, out: TextIO | None = None) -> None:
    print(json.dumps(document, indent=2, ensure_ascii=False), file=out or sys.stdout)


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def transfer_text(phase: str, done: int, total: int) -> str:
    """What an export's progress bar is doing: "downloading 1/2 ranks", "writing 3.0 MiB / 8.0 MiB"."""
    if phase == "download":
        return f"downloading {done}/{total} ranks"
    return f"writing {format_bytes(done)} / {format_bytes(total)}"
