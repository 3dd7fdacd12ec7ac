"""Jinja filters: how numbers, durations and times read on the pages (times in UTC)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from jinja2 import Environment

from services.root.domain.ettr import iteration_seconds

DASH = "—"


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return DASH
    if seconds < 10:
        return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


def timestamp(value: datetime | None, *, seconds: bool = True) -> str:
    if value is None:
        return DASH
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC" if seconds else "%Y-%m-%d %H:%M UTC")


def clock(value: datetime | None) -> str:
    return DASH if value is None else value.astimezone(UTC).strftime("%H:%M:%S")


def ago(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "never"
    seconds = ((now or datetime.now(UTC)) - value).total_seconds()
    if seconds < 1:
        return "just now"
    return duration(seconds if seconds < 10 else round(seconds)) + " ago"


def number(value: Any) -> str:
    if value is None:
        return DASH
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def percent(value: float | None) -> str:
    """A ratio as a percentage; one under 1 never shows as 100 % (rounded down where rounding would reach
    it): an ETTR of 0.99996 is not a job that lost nothing."""
    if value is None:
        return DASH
    digits = 2 if 0.9995 <= value < 1 else 1
    shown = round(100 * value, digits)
    if value < 1 and shown >= 100:
        shown = math.floor(100 * value * 10**digits) / 10**digits
    return f"{shown:.{digits}f} %"


def frequency(per_minute: float | None) -> str:
    if per_minute is None:
        return DASH
    if per_minute <= 0:
        return "0 /min"
    return f"{per_minute:,.1f} /min"


def interval(per_minute: float | None) -> str:
    """The checkpoint interval an effective frequency means."""
    seconds = iteration_seconds(per_minute)
    return "" if seconds is None else "every " + duration(seconds)


def size(nbytes: int | None) -> str:
    if nbytes is None:
        return DASH
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


def short(value: str | None, length: int = 12) -> str:
    if not value:
        return DASH
    return value if len(value) <= length else value[:length] + "…"


def install(env: Environment) -> None:
    env.filters.update(
        duration=duration,
        timestamp=timestamp,
        clock=clock,
        ago=ago,
        number=number,
        percent=percent,
        frequency=frequency,
        interval=interval,
        size=size,
        short=short,
    )
