"""Interleaving checkpoint traffic with training's own communication (GEMINI's Algorithm 2), pure functions.

The training process records when its collectives are on the wire (worker_lib.comm_timing); from those busy
spans, relative to each iteration's start, follow the idle spans of an iteration. The agent's sender sends a
checkpoint chunk only inside an idle span, sized so that it drains before the span ends: a chunk of s bytes
takes f(s) = alpha + s / B on the link (B measured by the sender), and only mu of a span is used (its length
varies between iterations). A checkpoint that does not fit into one iteration's idle time is spread over
several iterations. Nothing here reads a clock or a socket: the sender (worker_lib/agent/replication.py)
and the training side (worker_lib/comm_timing.py) pass times in.

Time is in seconds, sizes in bytes. A span is (start, end) relative to an iteration's start.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[float, float]

MU = 0.8  # the paper's coefficient for the variance of idle spans across iterations
ALPHA_S = 0.002  # startup time of one chunk (a send call and the first segment's round trip)
CHUNK_MAX = 32 << 20  # the paper's R / p: 128 MB reserved, 4 sub-buffers
CHUNK_MIN = 256 << 10  # below this a chunk is not worth its startup time
# The share of a window's iterations whose collectives a busy span of the profile must outlast (see
# profile): 6 of 8, 8 of 10. The union of every iteration's busy spans (1.0) left a quarter of an
# iteration idle where each iteration had half of one, under the jitter of a loaded host (docs/training.md).
COVERAGE = 0.75


@dataclass(frozen=True)
class IterationComm:
    """One iteration as the training process saw it: its length (start to the next start) and the spans
    its collectives were on the wire, relative to its start."""

    duration: float
    busy: tuple[Span, ...]


@dataclass(frozen=True)
class CommProfile:
    """What the sender schedules by: the typical iteration length and the busy spans (merged, relative to
    the iteration's start) of training's communication; and, anchored to the communication's end rather
    than to the iteration's start, how many collectives an iteration has (`collectives`) and how long the
    wire then stays idle until the next iteration's first collective (`gap`: the quiet time that all but
    1 - coverage of the window's iterations had; 0 when unknown)."""

    period: float
    busy: tuple[Span, ...]
    collectives: int = 0
    gap: float = 0.0

    def idle(self) -> list[Span]:
        return idle_spans(self.busy, self.period)

    @property
    def idle_fraction(self) -> float:
        return sum(e - s for s, e in self.idle()) / self.period if self.period > 0 else 0.0


def merge(spans: Sequence[Span]) -> list[Span]:
    """Overlapping or touching spans merged, in order; empty and reversed spans dropped."""
    merged: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def idle_spans(busy: Sequence[Span], period: float) -> list[Span]:
    """The idle spans of an iteration of `period` seconds whose communication is `busy`. The last one runs
    past the iteration's end up to the first busy span of the next iteration (the same pattern repeats):
    the optimizer step and the next forward pass are one idle span. Without any communication, the whole
    iteration is one span."""
    spans = [(max(0.0, s), min(period, e)) for s, e in merge(busy) if e > 0 and s < period]
    spans = [s for s in spans if s[1] > s[0]]
    if not spans:
        return [(0.0, period)] if period > 0 else []
    idle: list[Span] = []
    cursor = 0.0
    first = spans[0][0]
    for start, end in spans:
        if start > cursor and cursor > 0.0:
            idle.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < period + first:  # the tail, joined with the next iteration's head
        idle.append((cursor, period + first))
    return idle


def profile(iterations: Sequence[IterationComm], coverage: float = COVERAGE) -> CommProfile | None:
    """The profile of a window of iterations: the median length, and busy spans that begin where the
    earliest iteration began communicating and end where at least `coverage` of the iterations had stopped.

    The two ends are treated differently because the sender is guarded differently at each. A collective
    that ends later than the profile says is the sender's in-flight check's (next_grant: nothing is
    granted while training's collectives are on the wire), so a busy span ends at about the `coverage`
    quantile of the iterations' ends: one late iteration in a window does not erase the idle span every
    other iteration had. A collective that starts earlier than the profile says meets a chunk already
    granted and queued on the socket, which no check can call back, so a busy span starts where the union
    of the iterations' spans starts. Precisely: an instant is quantile-busy when more than 1 - `coverage`
    of the iterations communicated then; each span of the union that holds quantile-busy instants is busy
    from its start to its last quantile-busy instant, and a span of the union that holds none (a
    collective seen in too few iterations) is left out. `coverage` 1.0 is the union of every iteration's
    busy spans. None without iterations.

    The collectives' durations vary far more than what separates them (on a loaded link one all-reduce
    takes twice as long as the next), and a busy span that ends at the `coverage` quantile of the ends
    leaves the quiet time after an early end unused. So the profile also measures that quiet time from
    the other anchor: the gap from an iteration's last collective's end to the next one's first start
    (the optimizer step, the next forward, the backward up to its first bucket: compute, steadier),
    counted only between consecutive iterations that had the usual number of collectives."""
    usable = [it for it in iterations if it.duration > 0]
    if not usable:
        return None
    period = statistics.median(it.duration for it in usable)
    collectives = int(statistics.median_low(len(it.busy) for it in usable))
    # Quantile-busy: at least `needed` of the iterations busy at that instant (1: the union).
    needed = max(1, math.floor((1.0 - coverage) * len(usable) + 1e-9) + 1)
    # A sweep over every iteration's merged spans: +1 where one starts, -1 where one ends (ends first at
    # a tie, so two iterations' touching spans leave a point gap, which merge() closes again).
    events = sorted((t, delta) for it in usable for s, e in merge(it.busy) for t, delta in ((s, 1), (e, -1)))
    quantile: list[Span] = []
    count, opened = 0, 0.0
    for at, delta in events:
        if delta > 0 and count + 1 == needed:
            opened = at
        elif delta < 0 and count == needed:
            quantile.append((opened, at))
        count += delta
    quantile = merge(quantile)
    busy: list[Span] = []
    for start, end in merge([span for it in usable for span in it.busy]):
        inside = [e for s, e in quantile if start <= s and e <= end]
        if inside:
            busy.append((start, max(inside)))
    gaps = sorted(
        current.duration - max(e for _, e in current.busy) + min(s for s, _ in following.busy)
        for current, following in itertools.pairwise(usable)
        if collectives and len(current.busy) == collectives and len(following.busy) == collectives
    )
    gap = max(0.0, gaps[min(len(gaps) - 1, math.floor((1.0 - coverage) * len(gaps)))]) if gaps else 0.0
    return CommProfile(period, tuple((s, min(e, period)) for s, e in busy if s < period), collectives, gap)


def idle_left(profile: CommProfile, phase: float) -> float:
    """Seconds of idle time left at `phase` seconds after the latest iteration start (0: training is
    communicating, or about to). Past the period, the iteration is late: the next one's first busy span
    is taken to begin where the profile says, counted from the period."""
    for start, end in profile.idle():
        # A phase before the first busy span is in the span that began in the previous iteration.
        for at in (phase, phase + profile.period):
            if start <= at < end:
                return end - at
    return 0.0


def chunk_size(
    idle_s: float,
    bandwidth: float,
    *,
    mu: float = MU,
    alpha: float = ALPHA_S,
    chunk_max: int = CHUNK_MAX,
    chunk_min: int = CHUNK_MIN,
) -> int:
    """Bytes that fit in mu of `idle_s` at `bandwidth` bytes/s after the startup time (Algorithm 2's line
    12, capped at R/p); 0 when less than `chunk_min` fits."""
    return _fitting(mu * idle_s, bandwidth, alpha=alpha, chunk_max=chunk_max, chunk_min=chunk_min)


def _fitting(usable_s: float, bandwidth: float, *, alpha: float, chunk_max: int, chunk_min: int) -> int:
    """Bytes that cross the link in `usable_s` seconds after the startup time, capped at `chunk_max`; 0
    when less than `chunk_min` fits."""
    if bandwidth <= 0 or usable_s <= 0:
        return 0
    size = min(int(max(0.0, usable_s - alpha) * bandwidth), chunk_max)
    return size if size >= chunk_min else 0


@dataclass(frozen=True)
class Grant:
    """What the sender may do now: wait `wait_s` and ask again (size 0), or send `size` bytes."""

    size: int
    wait_s: float = 0.0


def next_grant(
    profile: CommProfile | None,
    phase: float,
    in_flight: int,
    wanted: int,
    bandwidth: float,
    *,
    mu: float = MU,
    alpha: float = ALPHA_S,
    chunk_max: int = CHUNK_MAX,
    chunk_min: int = CHUNK_MIN,
    poll_s: float = 0.002,
    quiet_for: float | None = None,
) -> Grant:
    """The interleaved sender's decision at `phase` seconds after the latest iteration start, with
    `in_flight` collectives of training on the wire right now: send a chunk that drains inside the current
    idle span, else wait until the next one opens. Without a profile (training not measured yet, or not
    communicating through a timed model) nothing is known to protect: the chunk is sent whole.
    `quiet_for`: seconds since the latest iteration's collectives all ended (as many as the profile's
    `collectives`; None while some are still to come): the idle span then lasts until mu of the profile's
    `gap` after that end, when this is longer than what the phase alone says (a collective that ended
    early)."""
    if wanted <= 0:
        return Grant(0)
    if profile is None:
        return Grant(min(wanted, chunk_max))
    if in_flight > 0:
        return Grant(0, poll_s)  # training is on the wire: whatever the profile says
    # The two estimates of the idle span's end are guarded differently. The phase's span ends where the
    # earliest iteration of the profile's window began communicating (profile: a busy span it keeps starts
    # at the union's start), so mu of what is left of it is margin enough. The gap after the collectives'
    # end is the value 3/4 of the iterations reached, so a quarter had a shorter one: it is used only up to
    # mu of its whole length, as Algorithm 2 plans a span, and its last (1 - mu) is a guard against an
    # early next collective (what filling it to its end cost: docs/figures.md, A guard at the end of the
    # quiet gap).
    usable = mu * idle_left(profile, phase)
    if quiet_for is not None and profile.gap > 0:
        usable = max(usable, mu * profile.gap - quiet_for)
    size = _fitting(usable, bandwidth, alpha=alpha, chunk_max=chunk_max, chunk_min=chunk_min)
    if size > 0:
        return Grant(min(size, wanted))
    # Wait for the next idle span of this iteration that can carry a chunk; past the last one, poll (the
    # next iteration's start resets the phase).
    start = next(
        (
            s
            for s, e in profile.idle()
            if s > phase
            and chunk_size(e - s, bandwidth, mu=mu, alpha=alpha, chunk_max=chunk_max, chunk_min=chunk_min)
        ),
        None,
    )
    return Grant(0, poll_s if start is None else max(poll_s, start - phase))


def partition(
    idle: Sequence[float],
    size: int,
    copies: int,
    bandwidth: float,
    *,
    mu: float = MU,
    alpha: float = ALPHA_S,
    chunk_max: int = CHUNK_MAX,
) -> list[list[int]]:
    """GEMINI's Algorithm 2 (with the fixes of its known typos: f(size) subtracted, a chunk too small to send
    ends the span): the chunk sizes sent in each idle span of `idle` (lengths) for `copies` replicas of a
    checkpoint of `size` bytes. The last span is infinite (leftover traffic goes there), so the result
    always carries everything."""
    spans = [*idle[:-1], math.inf] if idle else [math.inf]
    result: list[list[int]] = []
    left, copy = size, 0
    for span in spans:
        chunks: list[int] = []
        result.append(chunks)
        remain = mu * span
        while remain > 0 and copy < copies:
            if remain >= alpha + chunk_max / bandwidth:
                piece = chunk_max
            else:
                piece = int(max(0.0, (remain - alpha) * bandwidth))
            piece = min(left, piece)
            if piece <= 0:
                break
            left -= piece
            remain -= alpha + piece / bandwidth
            chunks.append(piece)
            if left == 0:
                copy += 1
                left = size
        if copy >= copies:
            break
    return result


def interval_bound(checkpoint_bytes: int, idle_fraction: float, bandwidth: float, iteration_s: float) -> int:
    """The fewest iterations one checkpoint can take to cross the link in idle time only: its bytes over
    what the idle fraction of an iteration carries at `bandwidth` bytes/s, rounded up."""
    capacity = idle_fraction * bandwidth * iteration_s
    return math.ceil(checkpoint_bytes / capacity) if capacity > 0 else 0
