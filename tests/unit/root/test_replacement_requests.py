"""Which failed machines get a (new) replacement request: none yet, the last one failed and its pause
passed, a request no one carries out (its leader died: continued at once, from the intent its tries
recorded), or the machine it launched never registered within replacement_timeout_s (that instance is
then replaced in turn)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.root.db.models import FailureEvent, FailureKind, Job, Machine, MachineState
from services.root.flows.recovery import _replacements
from services.root.settings import Settings

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)
SETTINGS = Settings(replacement_timeout_s=600)


def failed_machine(replacement: dict[str, Any] | None) -> tuple[Job, Machine, FailureEvent]:
    job = Job(id=uuid.uuid4(), name="j", num_machines=2, launch=None)
    machine = Machine(id=7, job_id=job.id, rank=1, instance_id="i-1", address="10.0.0.1")
    machine.state = MachineState.FAILED
    details = {} if replacement is None else {"replacement": replacement}
    event = FailureEvent(id=3, job_id=job.id, machine_id=7, kind=FailureKind.HARDWARE, details=details)
    return job, machine, event


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).isoformat()


@pytest.mark.parametrize(
    ("replacement", "asked"),
    [
        (None, True),
        ({"status": "requested", "at": ago(5)}, False),
        ({"status": "launched", "at": ago(300), "attempts": 1}, False),
        ({"status": "requested", "at": ago(601)}, True),  # the leader that asked died mid-request
        ({"status": "launched", "at": ago(601), "attempts": 1}, True),  # the machine never came
        ({"status": "error", "retry_at": (NOW + timedelta(seconds=5)).isoformat(), "attempts": 1}, False),
        ({"status": "error", "retry_at": ago(1), "attempts": 1}, True),
    ],
)
def test_replacement_requests(replacement: dict[str, Any] | None, asked: bool) -> None:
    job, machine, event = failed_machine(replacement)
    actions = _replacements(job, [machine], [event], NOW, SETTINGS)
    assert [a.machine.rank for a in actions] == ([1] if asked else [])
    if asked:
        request = event.details["replacement"]
        assert request["status"] == "requested" and request["at"] == NOW.isoformat()
        assert request["attempts"] == (replacement or {}).get("attempts", 0), "attempts are kept"


INTENT = {"replacing": "i-1", "terminate_at": ago(30)}


@pytest.mark.parametrize(
    ("replacement", "in_flight", "asked"),
    [
        # This leader runs it: under way however long it takes (the operator's own timeout ends it).
        ({"status": "requested", "at": ago(5), "intent": INTENT}, {3}, False),
        ({"status": "requested", "at": ago(601), "intent": INTENT}, {3}, False),
        # No one runs it (its leader died, or a try ended without an outcome): continued at once.
        ({"status": "requested", "at": ago(5), "intent": INTENT}, set(), True),
        ({"status": "requested", "at": ago(5)}, {4}, True),
        # A launched machine still has until the timeout to register.
        ({"status": "launched", "at": ago(5), "instance": "i-2", "intent": INTENT}, set(), False),
    ],
)
def test_a_request_no_one_carries_out_is_continued_at_once(
    replacement: dict[str, Any], in_flight: set[int], asked: bool
) -> None:
    job, machine, event = failed_machine(replacement)
    actions = _replacements(job, [machine], [event], NOW, SETTINGS, in_flight)
    assert [a.event_id for a in actions] == ([3] if asked else [])
    if asked:
        # The tries before recorded what they asked of the cloud: continued from there, not asked again.
        assert actions[0].intent == replacement.get("intent", {})
        assert event.details["replacement"].get("intent") == replacement.get("intent")


def test_a_retry_after_an_error_keeps_the_recorded_intent() -> None:
    failure = {"status": "error", "retry_at": ago(1), "attempts": 1, "intent": INTENT}
    job, machine, event = failed_machine(failure)
    (action,) = _replacements(job, [machine], [event], NOW, SETTINGS, set())
    assert action.intent == INTENT
    assert event.details["replacement"] == {
        "status": "requested",
        "at": NOW.isoformat(),
        "attempts": 1,
        "intent": INTENT,
    }


def test_a_launched_machine_that_never_registered_is_itself_replaced() -> None:
    launched = {"status": "launched", "at": ago(601), "attempts": 1, "instance": "i-2", "intent": INTENT}
    job, machine, event = failed_machine(launched)
    (action,) = _replacements(job, [machine], [event], NOW, SETTINGS, set())
    assert action.intent == {"replacing": "i-2"}
    assert action.machine.instance_id == "i-1", "for the failed machine's rank"
