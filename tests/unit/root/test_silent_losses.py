"""latest_silent_losses: per machine, the newest open loss declared for its silence and not reinstated."""

from __future__ import annotations

import types
from datetime import UTC, datetime, timedelta
from typing import Any

from services.root.db.models import FailureKind
from services.root.flows.failures import latest_silent_losses

T0 = datetime(2026, 11, 27, tzinfo=UTC)


def event(id: int, machine_id: int | None, minute: int, **details: Any) -> Any:
    kind = details.pop("kind", FailureKind.HARDWARE)
    return types.SimpleNamespace(
        id=id,
        machine_id=machine_id,
        kind=kind,
        details=details,
        classified_at=T0 + timedelta(minutes=minute),
        detected_at=T0,
    )


def test_the_newest_silent_loss_not_reinstated_per_machine() -> None:
    events = [
        event(1, 7, 1, silent=True),
        event(2, 7, 3, silent=True, reinstated="2026-11-27T00:04:00"),  # reinstated: no longer counts
        event(3, 7, 2, silent=True),  # the newest of machine 7's that counts
        event(4, 8, 5, silent=True),
        event(5, 8, 6, kind=FailureKind.SOFTWARE, silent=True),  # a process exit: not a silence
        event(6, 9, 7),  # lost for another reason (the cloud said so)
        event(7, None, 8, silent=True),  # no machine
    ]
    assert {m: e.id for m, e in latest_silent_losses(events).items()} == {7: 3, 8: 4}
