"""What a training process tells its worker agent (worker_lib/agent_ipc.py), as the agent reads it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from worker_lib.agent_ipc import (
    AGENT_NOTICES,
    FRESH_START,
    NOTICES_ENV,
    NOTIFY_ENV,
    AgentNotifier,
    prepare_notify_socket,
)
from worker_lib.checkpointer import Checkpointer
from worker_lib.errors import SlotsOnDiskWarning
from worker_lib.store.slots import storage_filesystem


@pytest.fixture
def agent_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.settimeout(10)
    yield listener, path
    listener.close()


def test_a_commit_and_a_clean_finish_reach_the_agent_with_the_stall_so_far(
    agent_socket: tuple[socket.socket, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listener, path = agent_socket
    monkeypatch.setenv(NOTIFY_ENV, path)
    monkeypatch.setenv("RANK", "3")
    # tmp_path is on disk here: the store says so (a warning), which is not what this test is about.
    with (
        pytest.warns(SlotsOnDiskWarning) if storage_filesystem(tmp_path) else nullcontext(),
        Checkpointer(tmp_path / "slots", blocking=True) as checkpointer,
    ):
        checkpointer.save(5, {"w": torch.ones(4)})
    commit, finished = (json.loads(listener.recv(65536)) for _ in range(2))
    assert commit["event"] == "commit" and commit["iteration"] == 5 and commit["slot"] is not None
    assert commit["rank"] == 3 and commit["pid"] == os.getpid() and commit["dir"] == str(tmp_path / "slots")
    assert finished["event"] == "finished" and finished["iteration"] == 5 and finished["slot"] is None
    # A blocking save commits inside its call: the stall is counted once it returned.
    assert commit["save_calls"] == 0 and finished["save_calls"] == 1 and finished["stalled_s"] > 0


@pytest.mark.filterwarnings("ignore::worker_lib.errors.SlotsOnDiskWarning")  # tmp_path may be on disk
def test_a_restore_and_a_fresh_start_tell_the_agent_what_was_restored(
    agent_socket: tuple[socket.socket, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's heartbeats carry it: the root takes the iterations an embedded-mode relaunch lost from
    it (domain.embedded)."""
    listener, path = agent_socket
    monkeypatch.setenv(NOTIFY_ENV, path)
    monkeypatch.setenv(NOTICES_ENV, AGENT_NOTICES)  # as the agent and attach() set it
    with Checkpointer(tmp_path / "slots", blocking=True) as checkpointer:
        assert checkpointer.restore() is None
        checkpointer.save(5, {"w": torch.ones(4)})
        restored = checkpointer.restore(into={"w": torch.zeros(4)})
        assert restored is not None and restored.iteration == 5
        checkpointer.save(6, {"w": torch.ones(4)})
        checkpointer.restore(into={"w": torch.zeros(4)}, iteration=5)  # a rollback from 6
    notices = [json.loads(listener.recv(65536)) for _ in range(6)]
    assert [(n["event"], n["iteration"], n.get("newest")) for n in notices] == [
        ("restored", FRESH_START, FRESH_START),
        ("commit", 5, None),
        ("restored", 5, 5),
        ("commit", 6, None),
        ("restored", 5, 6),
        ("finished", 6, None),
    ]


def test_an_agent_that_does_not_take_restored_notices_gets_none(
    agent_socket: tuple[socket.socket, str], tmp_path: Path
) -> None:
    """An agent from before them counts every notice but skip and finished as a commit."""
    listener, path = agent_socket
    older = AgentNotifier(path, 0, tmp_path, takes="")
    older.notify("restored", 5, None, stalled_s=0.0, save_calls=0, newest=6)
    older.notify("commit", 6, 0, stalled_s=0.0, save_calls=1)
    assert json.loads(listener.recv(65536))["event"] == "commit"
    older.close()


def test_no_agent_or_a_gone_one_is_never_trainings_problem(tmp_path: Path) -> None:
    AgentNotifier(None, 0, tmp_path).notify("commit", 1, 0, stalled_s=0.0, save_calls=1)
    gone = AgentNotifier(str(tmp_path / "no-agent.sock"), 0, tmp_path)
    gone.notify("commit", 1, 0, stalled_s=0.0, save_calls=1)  # ENOENT, swallowed
    gone.close()


async def test_an_agent_whose_machine_directory_is_too_deep_for_a_socket_address_hears_its_ranks(
    tmp_path: Path,
) -> None:
    """A socket address holds 107 bytes of path. Before, an agent whose machine directory was deeper (a
    deep shm base, or a long instance id: a 64-character hostname in embedded mode) failed to start with
    "AF_UNIX path too long"; its notify socket now lives at a short path in a private directory."""
    from types import SimpleNamespace
    from typing import Any

    from worker_lib.agent.services import MachineIdentity, MachineServices

    machine_root = tmp_path / ("deep-" * 20) / "i-0"
    machine_root.mkdir(parents=True)

    async def close() -> None:
        pass

    client: Any = SimpleNamespace(job_id="job", close=close)
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), machine_root)
    path = services.notify_socket
    assert len(os.fsencode(machine_root / "agent.sock")) > 107 >= len(os.fsencode(path))
    services._notices = await services._listen_for_commits()
    assert path.is_socket() and (os.stat(path.parent).st_mode & 0o777) == 0o700
    AgentNotifier(str(path), 0, machine_root).notify("skip", 4, None, stalled_s=0.5, save_calls=2)
    for _ in range(500):
        if services.skipped:
            break
        await asyncio.sleep(0.01)
    assert services.skipped == 1 and services.summary()["stalled_s"] == {"0": 0.5}
    await services.close()
    assert not path.exists(), "the agent removes the socket it made outside its machine directory"

    # An agent closing after another of the same machine directory bound the path leaves that one's socket.
    first = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), machine_root)
    first._notices = await first._listen_for_commits()
    second = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), machine_root)
    second._notices = await second._listen_for_commits()
    await first.close()
    assert path.is_socket(), "the newer agent's socket stays"
    await second.close()
    assert not path.exists()


def test_a_short_notify_socket_is_refused_a_directory_others_can_write_to(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="others cannot write to"):
        prepare_notify_socket(shared / "0123.sock")
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="a directory of this user"):
        prepare_notify_socket(link / "0123.sock")
