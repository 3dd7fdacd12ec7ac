"""The agent's heartbeat summary counts saves skipped and replicas skipped apart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from worker_lib.agent.services import MachineIdentity, MachineServices


def test_saves_skipped_and_replicas_skipped_are_reported_apart(tmp_path: Path) -> None:
    client: Any = SimpleNamespace(job_id="job")
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")
    services.on_notice(b'{"event": "skip", "rank": 0, "iteration": 4}')  # a save the training skipped
    services.replicator = SimpleNamespace(  # type: ignore[assignment]
        stats=SimpleNamespace(skipped=7, sent=3, last_lag_s=None)
    )
    summary = services.summary()
    assert summary["skipped"] == 1 and summary["replicas_skipped"] == 7
