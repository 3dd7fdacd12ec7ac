"""Which failed machines get a (new) replacement request: none yet, the last one failed and its pause
passed, or the last one has been under way for longer than replacement_timeout_s (its leader died, or
the machine it launched never registered)."""

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
