"""The local operator acts on one job's agents only, and names what it starts itself. Instance ids come
from registrations, which any worker of any job sends: before, a worker of job A that registered with the
instance id of job B's agent got B's agent SIGKILLed when A's machine was replaced, and an id holding a path
(`/tmp/x`, `../..`) became the replacement's log file and shared-memory directory outside the state dir."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from services.root.clients import JobInfo, MachineInfo, ReplacementJournal, local
from services.root.clients.local import LocalOperator


@pytest.fixture
def operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    real_popen = subprocess.Popen
    started: list[dict[str, Any]] = []

    def popen(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append({"command": command, **kwargs})
        return real_popen(["sleep", "600"], start_new_session=True)  # an agent that stays up

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    operator = LocalOperator("http://127.0.0.1:9", tmp_path / "state", tmp_path / "shm")
    operator.started = started
    yield operator
    for process in list(operator._processes.values()):
        process.kill()
        process.wait()


def job(name: str) -> JobInfo:
    return JobInfo(uuid.uuid4(), name, 2, {"command": ["python", "train.py"]})


async def test_a_replacement_never_stops_another_jobs_agent(operator: Any) -> None:
    victim, attacker = job("victim"), job("attacker")
    await operator.provision(victim, "token-b")
    await operator.provision(attacker, "token-a")
    victims = [i for i, owner in operator._owners.items() if owner == victim.id]
    assert len(victims) == 2
    # The attacker's machine 0 registered under the victim's agent's id and was then declared lost.
    impostor = MachineInfo(rank=0, instance_id=victims[0], address="10.0.0.9")
    replacement = await operator.replace(attacker, impostor, set(), ReplacementJournal())
    assert operator.instance_gone(victims[0]) is False, "the victim's agent still runs"
    assert replacement.instance_id.startswith(f"local-{attacker.id.hex[:8]}-m0~")
    await operator.release(attacker)
    assert all(operator.instance_gone(i) is False for i in victims), "a release stops only its own job"


@pytest.mark.parametrize("planted", ["/tmp/castor-escaped/pwned", "../../../escaped"])
async def test_a_replacement_is_named_from_the_job_and_rank_not_from_the_failed_id(
    operator: Any, tmp_path: Path, planted: str
) -> None:
    attacker = job("attacker")
    failed = MachineInfo(rank=1, instance_id=planted, address="10.0.0.9")
    replacement = await operator.replace(attacker, failed, set(), ReplacementJournal())
    assert replacement.instance_id == f"local-{attacker.id.hex[:8]}-m1~1"
    command = operator.started[-1]["command"]
    shm_dir = Path(command[command.index("--shm-dir") + 1])
    assert shm_dir.resolve().is_relative_to((tmp_path / "shm").resolve())  # noqa: ASYNC240
    logs = list((tmp_path / "state").rglob("*.log"))
    assert [p.name for p in logs] == [f"{replacement.instance_id}.log"]
    assert not Path("/tmp/castor-escaped").exists()  # noqa: ASYNC240
