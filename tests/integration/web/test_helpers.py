"""The pure pieces behind the pages (no app, no database): phases from event timestamps, chart geometry,
the iteration ring buffer, safe redirects, formatting."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.root.domain import phases
from services.root.web import charts, formatting
from services.root.web.auth import login_url, safe_next
from services.root.web.sampler import IterationHistory

T0 = datetime(2026, 1, 1, 3, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@dataclass
class Event:
    kind: str
    detected_at: datetime
    classified_at: datetime | None = None
    replaced_at: datetime | None = None
    restored_at: datetime | None = None
    resumed_at: datetime | None = None
    details: dict[str, Any] = field(default_factory=dict)


def test_a_recovered_hardware_failure_has_five_phases_from_its_last_heartbeat() -> None:
    event = Event(
        "hardware",
        detected_at=at(2),
        classified_at=at(3),
        replaced_at=at(9),
        restored_at=at(10),
        resumed_at=at(15),
        details={"last_heartbeat_at": at(0).isoformat()},
    )
    steps = phases.phases(event, at(100), finished=True)
    assert [(p.name, p.seconds) for p in steps] == [
        ("detect", 2.0),
        ("classify", 1.0),
        ("replace", 6.0),
        ("restore", 1.0),
        ("resume", 5.0),
    ]
    assert phases.recovery_seconds(event) == 13.0, "from detection, not from the last heartbeat"
    segments = charts.phase_segments(steps, 30.0)
    assert [(s.x, s.width) for s in segments] == [
        (0.0, 66.67),
        (66.67, 33.33),
        (100.0, 200.0),
        (300.0, 33.33),
        (333.33, 166.67),
    ]


def test_a_software_failure_in_progress_has_no_replace_phase_and_one_under_way() -> None:
    event = Event("software", detected_at=at(0), classified_at=at(0))
    steps = phases.phases(event, at(4))
    assert [(p.name, p.seconds, p.end is None) for p in steps] == [
        ("detect", 0.0, False),
        ("classify", 0.0, False),
        ("restore", 4.0, True),
    ]
    assert phases.recovery_seconds(event) is None
    assert phases.phases(event, at(4), finished=True)[-1].name == "classify", "nothing under way once over"


def test_iteration_chart_marks_failures_in_its_window_and_counts_the_others() -> None:
    samples = [(at(s), s * 2) for s in range(0, 61)]
    failures = [
        charts.ChartFailure(7, "hardware", at(20), at(30), "/jobs/x/failures/7"),
        charts.ChartFailure(3, "software", at(-600), at(-590), "/jobs/x/failures/3"),
    ]
    chart = charts.iteration_chart(
        samples, failures, [charts.ChartResume(at(28), 38, 2)], now=at(60), live=False
    )
    assert not chart.empty and chart.samples == 61 and chart.outside == 1
    (mark,) = chart.failures
    assert mark.label == "#7" and chart.left < mark.x < chart.plot_right
    assert mark.band_width == pytest.approx(chart.plot_width * 10 / 60, abs=0.2)
    assert [t.label for t in chart.y_ticks] == ["0", "50", "100", "150"]
    assert chart.x_ticks[0].label == "03:00:00" and len(chart.x_ticks) >= 4
    first, *_, last = chart.points.split()
    assert first == f"{chart.left}.0,{chart.plot_bottom}.0"
    assert last.startswith(f"{chart.plot_right}.0,")
    assert chart.resumes[0].label == "generation 2 resumed from iteration 38"
    assert charts.iteration_chart([], failures, [], now=at(0), live=True).empty


def test_labels_of_simultaneous_failures_stack_instead_of_overlapping() -> None:
    samples = [(at(s), s) for s in range(0, 601)]
    failures = [  # a lost group: two failures a second apart; a third much later
        charts.ChartFailure(41, "hardware", at(300), at(320), "/jobs/x/failures/41"),
        charts.ChartFailure(42, "hardware", at(301), at(320), "/jobs/x/failures/42"),
        charts.ChartFailure(43, "software", at(302), at(310), "/jobs/x/failures/43"),
        charts.ChartFailure(44, "software", at(500), at(505), "/jobs/x/failures/44"),
    ]
    chart = charts.iteration_chart(samples, failures, [], now=at(600), live=False)
    marks = {m.label: m for m in chart.failures}
    close = [marks["#41"], marks["#42"], marks["#43"]]
    assert len({m.label_y for m in close}) == 3, "each label of the cluster on its own line"
    assert marks["#44"].label_y == marks["#41"].label_y, "a failure far away uses the first line again"
    for a, b in itertools.pairwise(close):
        assert abs(a.x - b.x) < charts.LABEL_CHAR_WIDTH * 3, "they would have overlapped on one line"
        assert b.label_y - a.label_y == charts.LABEL_ROW_HEIGHT


def test_the_ring_buffer_compresses_flat_stretches_and_drops_the_oldest() -> None:
    history = IterationHistory(capacity=4, max_jobs=2)
    job = uuid.uuid4()
    for second, iteration in enumerate([1, 2, 2, 2, 2, 3]):
        history.record(job, iteration, at(second))
    assert [(s.at, s.iteration) for s in history.samples(job)] == [
        (at(0), 1),
        (at(1), 2),
        (at(4), 2),
        (at(5), 3),
    ]
    history.record(job, 4, at(6))
    assert [s.iteration for s in history.samples(job)] == [2, 2, 3, 4]
    others = [uuid.uuid4(), uuid.uuid4()]
    for other in others:
        history.record(other, 1)
    assert history.samples(job) == [], "the job sampled least recently goes first"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/jobs/1?x=2", "/jobs/1?x=2"),
        ("/", "/"),
        (None, "/"),
        ("", "/"),
        ("//evil.example", "/"),
        ("/\\evil.example", "/"),
        ("https://evil.example/", "/"),
        ("javascript:alert(1)", "/"),
        ("/a\nb", "/"),
        ("/login?next=/x", "/"),
        ("/" + "a" * 3000, "/"),
    ],
)
def test_safe_next(value: str | None, expected: str) -> None:
    assert safe_next(value) == expected


def test_login_url_quotes_next() -> None:
    assert login_url("/") == "/login"
    assert login_url("/?state=running&page=2") == "/login?next=/%3Fstate%3Drunning%26page%3D2"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (0.004, "0.00 s"),
        (4.25, "4.2 s"),
        (42, "42 s"),
        (125, "2 min 05 s"),
        (7300, "2 h 01 min"),
    ],
)
def test_duration(seconds: float | None, text: str) -> None:
    assert formatting.duration(seconds) == text


def test_formatting() -> None:
    assert formatting.percent(0.9333) == "93.3 %" and formatting.percent(0.99991) == "99.99 %"
    # A ratio under 1 never shows as 100 %: a 10-hour job that lost 15 s is not a job that lost nothing.
    assert formatting.percent(0.99996) == "99.99 %" and formatting.percent(0.94) == "94.0 %"
    assert formatting.percent(0.99949) == "99.9 %" and formatting.percent(1.0) == "100.0 %"
    assert formatting.percent(2 / 3) == "66.7 %", "rounded as usual where it cannot reach 100 %"
    assert formatting.frequency(59.0) == "59.0 /min" and formatting.interval(30.0) == "every 2.0 s"
    assert formatting.size(1536) == "1.5 KiB" and formatting.number(12345) == "12,345"
    assert formatting.ago(at(0), at(30)) == "30 s ago" and formatting.ago(at(5), at(0)) == "just now"


def test_the_cli_never_shows_an_ettr_under_1_as_1() -> None:
    from services.cli.jobs import ettr_text

    assert ettr_text({"ettr": 0.99996, "wall_s": 36000.0, "restore_s": 15.0}).startswith("0.9999 of")
    assert ettr_text({"ettr": 0.94, "wall_s": 1000.0}).startswith("0.9400 of")
