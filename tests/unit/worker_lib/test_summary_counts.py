"""The agent's heartbeat summary: saves skipped and replicas skipped apart; each rank's checkpoint stall."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker_lib.agent.services import MachineIdentity, MachineServices
from worker_lib.api.worker import CheckpointSummary
from worker_lib.store import slots as slots_module


def test_saves_skipped_and_replicas_skipped_are_reported_apart(tmp_path: Path) -> None:
    client: Any = SimpleNamespace(job_id="job")
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")
    services.on_notice(b'{"event": "skip", "rank": 0, "iteration": 4}')  # a save the training skipped
    services.replicator = SimpleNamespace(  # type: ignore[assignment]
        stats=SimpleNamespace(skipped=7, sent=3, last_lag_s=None), summary=lambda: {"replication_interval": 4}
    )
    summary = services.summary()
    assert summary["skipped"] == 1 and summary["replicas_skipped"] == 7
    assert summary["replication_interval"] == 4, "the replicator's figures travel in the heartbeat"


def test_the_summary_adds_up_each_ranks_stall_over_its_training_processes(tmp_path: Path) -> None:
    """Notices carry a process's cumulative stall; a restarted process (a new pid) starts again from 0."""
    client: Any = SimpleNamespace(job_id="job")
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")

    def notice(event: str, rank: int, pid: int, seconds: float, calls: int) -> bytes:
        body = {"event": event, "rank": rank, "iteration": calls, "pid": pid}
        return json.dumps({**body, "stalled_s": seconds, "save_calls": calls}).encode()

    services.on_notice(notice("commit", 4, 100, 0.5, 10))
    services.on_notice(notice("commit", 4, 100, 0.75, 12))
    services.on_notice(notice("commit", 4, 100, 0.7, 11))  # from the other thread, sent late: no step back
    services.on_notice(notice("commit", 5, 101, 0.25, 12))
    services.on_notice(notice("commit", 4, 200, 0.125, 3))  # rank 4's training restarted
    services.on_notice(notice("skip", 4, 200, 0.25, 4))
    services.on_notice(b'{"event": "commit", "rank": 5, "iteration": 13}')  # an older library: no figure
    summary = services.summary()
    assert summary["stalled_s"] == {"4": 1.0, "5": 0.25}
    assert summary["save_calls"] == {"4": 16, "5": 12}


def test_what_each_ranks_newest_training_process_restored_is_in_the_summary_and_no_commit(
    tmp_path: Path,
) -> None:
    """The root takes the iterations an embedded-mode relaunch lost from it (domain.embedded)."""
    client: Any = SimpleNamespace(job_id="job")
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")

    def restored(rank: int, iteration: int, pid: int, newest: Any) -> bytes:
        body = {"event": "restored", "rank": rank, "iteration": iteration, "pid": pid, "newest": newest}
        return json.dumps(body).encode()

    services.on_notice(restored(0, -1, 100, -1))  # a fresh start, nothing held
    services.on_notice(restored(1, 4, 101, 5))
    services.on_notice(restored(0, 6, 102, 6))  # rank 0 relaunched later
    services.on_notice(restored(1, -7, 101, 5))  # not an iteration
    services.on_notice(restored(2, 3, 103, "5"))  # no newest it can use
    summary = services.summary()
    assert summary["restored"] == {"0": 6, "1": 4, "2": 3}
    assert summary["newest_at_restore"] == {"0": 6, "1": 5}
    assert summary["committed"] == 0 and services.commits == {}, "a restore is no commit"
    sent = CheckpointSummary.model_validate(json.loads(json.dumps(summary)))
    assert sent.restored == {0: 6, 1: 4, 2: 3} and sent.newest_at_restore == {0: 6, 1: 5}


def test_a_checkpoint_directory_on_storage_is_named_in_every_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The training processes warn about it on their own stderr only; the agent's heartbeat takes it to the
    job's page. A directory in memory adds nothing to the heartbeat."""
    memory = tmp_path / "memory"
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 1 8:1 / / rw - xfs /dev/sda1 rw\n25 22 0:21 / {memory.resolve()} rw - tmpfs tmpfs rw\n"
    )
    monkeypatch.setattr(slots_module, "_MOUNTINFO", mountinfo)
    client: Any = SimpleNamespace(job_id="job")
    with caplog.at_level(logging.WARNING, logger="worker_lib.agent.services"):
        on_disk = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")
    assert on_disk.summary()["store_filesystem"] == "xfs"
    assert str(tmp_path / "shm") in caplog.text and "--shm-dir" in caplog.text
    in_memory = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-1"), memory / "i-1")
    assert "store_filesystem" not in in_memory.summary()
    CheckpointSummary.model_validate(on_disk.summary())  # what the root accepts


def test_the_checkpoint_rate_holds_for_iterations_longer_than_a_minute_and_restarts_with_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """90 s iterations had one commit in the last minute: no rate, so the root charged lost iterations
    nothing (the paper's own setting has 62 s iterations). The rate comes from the newest two commits of one
    training process: the time from the last commit before a restart to the first after it is no
    iteration."""
    client: Any = SimpleNamespace(job_id="job")
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")
    clock = [1000.0]
    monkeypatch.setattr("worker_lib.agent.services.time.monotonic", lambda: clock[0])

    def commit(pid: int, iteration: int, at: float) -> None:
        clock[0] = at
        body = {"event": "commit", "rank": 0, "iteration": iteration, "pid": pid}
        services.on_notice(json.dumps({**body, "stalled_s": 0.0, "save_calls": iteration}).encode())

    commit(100, 1, 1000.0)
    assert services.summary()["per_minute"] is None
    commit(100, 2, 1090.0)
    commit(100, 3, 1180.0)
    assert services.summary()["per_minute"] == pytest.approx(60 / 90)
    commit(200, 3, 1800.0)  # the process restarted after a 10-minute recovery
    assert services.summary()["per_minute"] is None
    commit(200, 4, 1890.0)
    assert services.summary()["per_minute"] == pytest.approx(60 / 90)


async def test_an_agent_registers_with_a_root_from_before_agent_sessions(tmp_path: Path) -> None:
    """Such a root refuses the field it does not know (422, extra fields forbidden): the agent registers as
    before, without it, instead of failing to start (agents upgraded before their roots)."""
    from worker_lib.client import RootRejected

    class OlderRoot:
        job_id = "job"

        def __init__(self) -> None:
            self.calls: list[dict[str, Any]] = []

        async def register(self, **fields: Any) -> Any:
            self.calls.append(fields)
            if "agent_session" in fields:
                raise RootRejected(
                    422,
                    "validation_error",
                    "invalid request: body.agent_session: Extra inputs are not permitted",
                )
            raise LookupError("registered")  # enough: what follows a registration is not under test

    root = OlderRoot()
    services = MachineServices(root, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")  # type: ignore[arg-type]
    services.server = SimpleNamespace(port=7000)  # type: ignore[assignment]
    with pytest.raises(LookupError):
        await services.register()
    assert [("agent_session" in call) for call in root.calls] == [True, False]
    assert root.calls[1]["instance_id"] == "i-0"
