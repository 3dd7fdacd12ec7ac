"""One computation of a failure's phases (domain.phases): the CLI's, from the API's failure JSON
(`failure_phases`), is the pages' and /metrics', from the failure event row (`phases`)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from services.root import schemas
from services.root.db.models import FailureEvent, FailureKind, FailureState
from services.root.domain import phases
from services.root.web.formatting import duration

T0 = datetime(2026, 1, 1, 3, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def event(kind: str, state: str, **stamps: datetime) -> FailureEvent:
    return FailureEvent(
        id=7,
        job_id=uuid.uuid4(),
        rank=1,
        kind=kind,
        state=state,
        cause="machine 1 stopped heartbeating",
        detected_at=at(2),
        classified_at=stamps.get("classified_at"),
        replaced_at=stamps.get("replaced_at"),
        restored_at=stamps.get("restored_at"),
        resumed_at=stamps.get("resumed_at"),
        plan_id=None,
        tier=None,
        iterations_lost=None,
        details={"last_heartbeat_at": at(0).isoformat()},
    )


@pytest.mark.parametrize(
    "row",
    [
        event(
            FailureKind.HARDWARE,
            FailureState.RECOVERED,
            classified_at=at(3),
            replaced_at=at(9),
            restored_at=at(10),
            resumed_at=at(15),
        ),
        event(FailureKind.HARDWARE, FailureState.RECOVERING, classified_at=at(3)),  # replace under way
        event(FailureKind.SOFTWARE, FailureState.RECOVERING, classified_at=at(2), restored_at=at(6)),
        event(FailureKind.SOFTWARE, FailureState.UNRECOVERABLE, classified_at=at(2)),  # given up
    ],
    ids=["recovered", "replacing", "resuming", "unrecoverable"],
)
def test_the_cli_computes_the_phases_the_pages_show(row: FailureEvent) -> None:
    now = at(40)
    api_json = schemas.FailureOut.model_validate(row).model_dump(mode="json")  # what the CLI receives
    pages = phases.phases(row, now, finished=row.state not in ("detected", "recovering"))
    cli = phases.failure_phases(api_json, now)
    assert [(p.name, p.start, p.end, p.seconds) for p in cli] == [
        (p.name, p.start, p.end, p.seconds) for p in pages
    ]
    # A lost machine's detect phase starts at its last heartbeat (in the details the API returns).
    assert cli[0].start == (at(0) if row.kind == FailureKind.HARDWARE else at(2))


def test_a_failure_without_a_detection_time_has_no_phases() -> None:
    assert phases.failure_phases({"kind": "software", "state": "detected"}) == []


def test_the_api_reports_the_phase_durations_the_pages_show() -> None:
    """The API's phase seconds are the pages' float, not a copy rounded first: a resume phase of 0.1052 s
    read 'resume 0.10 s' from the API (0.105 after rounding to ms, then to 2 decimals) while the failure
    page, formatting the same phase once, showed 'resume 0.11 s' (CI saw that mismatch once)."""
    row = event(
        FailureKind.SOFTWARE,
        FailureState.RECOVERED,
        classified_at=at(2.5),
        restored_at=at(7.25),
        resumed_at=at(7.3552),
    )
    pages = phases.phases(row, at(40), finished=True)
    api = schemas.FailureOut.model_validate(row).phases
    assert [(p.name, p.seconds) for p in api] == [(p.name, p.seconds) for p in pages]
    assert [duration(p.seconds) for p in api] == [duration(p.seconds) for p in pages]
    assert duration(api[-1].seconds) == "0.11 s"


def test_a_reinstated_loss_keeps_its_restore_and_resume_phases() -> None:
    """A machine declared lost and reinstated before any replacement: its recovery still restored and
    resumed. Before, the missing replacement mark ended the phases there: 120 s of downtime dropped from the
    pages, /metrics and the ETTR, and while open the replacement showed as under way the whole time."""
    row = event(
        FailureKind.HARDWARE,
        FailureState.RECOVERED,
        classified_at=at(10),
        restored_at=at(100),
        resumed_at=at(120),
    )
    row.details = {**row.details, "reinstated": {"at": at(20).isoformat(), "why": "heartbeats resumed"}}
    steps = phases.phases(row, at(200), finished=True)
    assert [(p.name, p.seconds) for p in steps] == [
        ("detect", 2.0),
        ("classify", 8.0),
        ("restore", 90.0),
        ("resume", 20.0),
    ]
    row.state, row.restored_at, row.resumed_at = FailureState.RECOVERING, None, None
    under_way = phases.phases(row, at(50), finished=False)
    assert [(p.name, p.end) for p in under_way][-1] == ("restore", None)
