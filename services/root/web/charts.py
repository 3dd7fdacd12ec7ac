"""Geometry of the pages' inline SVG charts, computed here so the templates only draw.

Bars are drawn in a 0..1000 wide viewBox stretched to the page width (rectangles only, no text inside the
SVG, so stretching distorts nothing); the iteration chart has a fixed aspect ratio and its own axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from services.root.domain.phases import Phase

BAR_WIDTH = 1000.0


@dataclass(frozen=True)
class Segment:
    """One phase of a recovery on a bar: x and width in 0..1000."""

    phase: str
    seconds: float
    x: float
    width: float
    under_way: bool


def phase_segments(phases: Sequence[Phase], scale_s: float) -> list[Segment]:
    """The phases laid end to end, `scale_s` seconds being the whole bar."""
    scale = max(scale_s, 1e-9)
    segments, x = [], 0.0
    for phase in phases:
        width = min(BAR_WIDTH - x, BAR_WIDTH * phase.seconds / scale)
        segments.append(
            Segment(phase.name, phase.seconds, round(x, 2), round(max(width, 0.0), 2), phase.end is None)
        )
        x += max(width, 0.0)
    return segments


def nice_step(span: float, target: int = 5, multiples: Sequence[float] = (1, 2, 2.5, 5)) -> float:
    """A round step (one of `multiples` times a power of ten) giving about `target` ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / target
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for multiple in multiples:
        if multiple * magnitude >= raw:
            return float(multiple * magnitude)
    return 10.0 * magnitude


@dataclass(frozen=True)
class Point:
    x: float
    y: float


@dataclass(frozen=True)
class Tick:
    at: float  # x or y in the chart's coordinates
    label: str


@dataclass(frozen=True)
class FailureMark:
    """A failure on the chart: a line where it was detected, a band until training resumed."""

    failure_id: int
    kind: str
    x: float
    band_x: float
    band_width: float
    label: str
    href: str
    label_y: float = 0.0  # baseline of the label: failures close together get their labels stacked


# The failure labels' size in chart units (11 px bold text): enough to keep neighbours from overlapping.
LABEL_CHAR_WIDTH = 7.0
LABEL_ROW_HEIGHT = 13.0


def _label_rows(lefts_and_widths: list[tuple[float, float]]) -> list[int]:
    """A row for each label (given in x order) such that labels in one row do not overlap: the first row
    with room, greedily. Simultaneous failures (a lost group, a crash cascade) stack instead of printing
    over each other."""
    ends: list[float] = []  # right edge of the last label in each row
    rows = []
    for left, width in lefts_and_widths:
        row = next((r for r, end in enumerate(ends) if end + 3 <= left), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = left + width
        rows.append(row)
    return rows


@dataclass(frozen=True)
class ResumeMark:
    """Where a recovery plan put every rank back: (plan ready, the iteration resumed from)."""

    x: float
    y: float
    label: str


@dataclass(frozen=True)
class ChartFailure:
    failure_id: int
    kind: str
    start: datetime  # when it failed
    end: datetime | None  # training resumed; None: not yet
    href: str
    number: int | None = None  # within the job, the label's number (ids are global)


@dataclass(frozen=True)
class ChartResume:
    at: datetime
    iteration: int
    generation: int


@dataclass
class IterationChart:
    width: int = 760
    height: int = 240
    left: int = 64
    right: int = 16
    top: int = 24
    bottom: int = 30
    points: str = ""
    last: Point | None = None
    x_ticks: list[Tick] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    failures: list[FailureMark] = field(default_factory=list)
    resumes: list[ResumeMark] = field(default_factory=list)
    samples: int = 0
    since: datetime | None = None
    until: datetime | None = None
    outside: int = 0  # failures of the job outside the sampled window
    empty: bool = True

    @property
    def plot_right(self) -> int:
        return self.width - self.right

    @property
    def plot_bottom(self) -> int:
        return self.height - self.bottom

    @property
    def plot_width(self) -> int:
        return self.width - self.left - self.right

    @property
    def plot_height(self) -> int:
        return self.height - self.top - self.bottom


MAX_POINTS = 600
TIME_STEPS = (
    1.0,
    2.0,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    900.0,
    1800.0,
    3600.0,
    7200.0,
    10800.0,
    21600.0,
    43200.0,
    86400.0,
)


def iteration_chart(
    samples: Sequence[tuple[datetime, int]],
    failures: Sequence[ChartFailure],
    resumes: Sequence[ChartResume],
    *,
    now: datetime,
    live: bool,
) -> IterationChart:
    chart = IterationChart(samples=len(samples))
    if not samples:
        chart.outside = len(failures)
        return chart
    start = samples[0][0]
    end = max(samples[-1][0], now) if live else samples[-1][0]
    if (end - start).total_seconds() < 10:
        end = start + timedelta(seconds=10)
    chart.since, chart.until, chart.empty = start, end, False
    span = (end - start).total_seconds()

    in_window = [r for r in resumes if start <= r.at <= end]
    values = [i for _, i in samples] + [r.iteration for r in in_window]
    step = max(1.0, nice_step(max(max(values) - min(values), 1), 4, (1, 2, 5)))  # whole iterations
    low: float = math.floor(min(values) / step) * step
    high: float = max(math.ceil(max(values) / step) * step, low + step)

    def x_of(at: datetime) -> float:
        return round(chart.left + chart.plot_width * (at - start).total_seconds() / span, 1)

    def y_of(iteration: float) -> float:
        return round(chart.plot_bottom - chart.plot_height * (iteration - low) / (high - low), 1)

    stride = max(1, math.ceil(len(samples) / MAX_POINTS))
    kept = list(samples[::stride])
    if kept[-1] is not samples[-1]:
        kept.append(samples[-1])
    chart.points = " ".join(f"{x_of(at)},{y_of(i)}" for at, i in kept)
    chart.last = Point(x_of(samples[-1][0]), y_of(samples[-1][1]))

    value = low
    while value <= high + 1e-9:
        chart.y_ticks.append(Tick(y_of(value), f"{value:,.0f}"))
        value += step
    # About six time ticks, on round clock values.
    t_step = next((n for n in TIME_STEPS if n >= span / 6), span / 6)
    first = math.ceil(start.timestamp() / t_step) * t_step
    tick = first
    while tick <= end.timestamp():
        at = datetime.fromtimestamp(tick, tz=start.tzinfo)
        chart.x_ticks.append(Tick(x_of(at), at.strftime("%H:%M:%S")))
        tick += t_step

    shown = []
    for failure in failures:
        if not start <= failure.start <= end:
            chart.outside += 1
            continue
        shown.append(failure)
    shown.sort(key=lambda f: (f.start, f.failure_id))
    labels = [f"#{f.number if f.number is not None else f.failure_id}" for f in shown]
    rows = _label_rows(
        [(x_of(f.start) + 4, LABEL_CHAR_WIDTH * len(label)) for f, label in zip(shown, labels, strict=True)]
    )
    for failure, label, row in zip(shown, labels, rows, strict=True):
        band_end = min(failure.end or end, end)
        chart.failures.append(
            FailureMark(
                failure_id=failure.failure_id,
                kind=failure.kind,
                x=x_of(failure.start),
                band_x=x_of(failure.start),
                band_width=max(0.0, round(x_of(band_end) - x_of(failure.start), 1)),
                label=label,
                href=failure.href,
                label_y=chart.top + 12 + LABEL_ROW_HEIGHT * row,
            )
        )
    chart.resumes = [
        ResumeMark(
            x_of(r.at), y_of(r.iteration), f"generation {r.generation} resumed from iteration {r.iteration}"
        )
        for r in in_window
    ]
    return chart
