"""What a training process and its machine's worker agent say to each other.

The agent starts each rank with its contract in the environment (where the rank's slots live, where to
announce commits, which iteration the recovery plan restores, which plan generation this run is); the
training process answers with datagrams on the agent's notify socket (a commit, a skipped save, a clean
finish). `worker_lib/agent/launcher.py` writes the environment, `worker_lib/agent/services.py` reads the
datagrams.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
from pathlib import Path
from typing import Literal

from worker_lib.agent.stacks import install_stack_dump
from worker_lib.store.manifest import JsonValue

SHM_DIR_ENV = "CASTOR_SHM_DIR"
NOTIFY_ENV = "CASTOR_AGENT_NOTIFY"
RESTORE_ITERATION_ENV = "CASTOR_RESTORE_ITERATION"
GENERATION_ENV = "CASTOR_GENERATION"

# "restored": the process restored a checkpoint (its iteration) or started fresh (FRESH_START), see
# Checkpointer.restore.
Event = Literal["commit", "skip", "finished", "restored"]
FRESH_START = -1  # the iteration of a "restored" notice when the process had nothing to restore
# The notices beyond commit, skip and finished that the agent takes, as its training processes' environment
# says: an agent from before "restored" counts any other notice as a commit.
NOTICES_ENV = "CASTOR_AGENT_NOTICES"
AGENT_NOTICES = "restored"


NOTIFY_SOCKET = "agent.sock"
# The longest path a Unix socket address holds (sun_path is 108 bytes on Linux, with its terminating NUL).
UNIX_PATH_MAX = 107


def notify_socket_path(machine_root: Path) -> Path:
    """Where the agent of the machine directory `machine_root` listens for its training processes' notices:
    `machine_root/agent.sock`, or, where that path is longer than a socket address holds (a deep shm base, a
    long instance id: a 64-character hostname in embedded mode does it), a short one in the user's private
    directory under /tmp, named after `machine_root` (binding the long one failed with "AF_UNIX path too
    long", and the agent never started)."""
    path = machine_root / NOTIFY_SOCKET
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        return path
    digest = hashlib.sha256(os.fsencode(machine_root.absolute())).hexdigest()[:32]
    return Path("/tmp") / f"castor-{os.getuid()}" / f"{digest}.sock"


def prepare_notify_socket(path: Path) -> None:
    """Make the directory a short notify socket lives in (see notify_socket_path): created private (0700),
    and, if it exists, refused unless it is a real directory of this user that no one else can write to
    (another user could otherwise put a socket of theirs, or a link, where training sends its notices)."""
    directory = path.parent
    if path.name == NOTIFY_SOCKET:
        directory.mkdir(parents=True, exist_ok=True)
        return
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    status = os.lstat(directory)
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise PermissionError(
            f"{directory} (where the agent's notify socket goes, its machine directory's path being too "
            "long for a socket) must be a directory of this user that others cannot write to"
        )


def default_directory() -> Path:
    """$CASTOR_SHM_DIR (set by the worker agent), else /dev/shm/castor-<uid>/<$CASTOR_JOB>/rank-<$RANK>."""
    configured = os.environ.get(SHM_DIR_ENV)
    if configured:
        return Path(configured)
    job = os.environ.get("CASTOR_JOB") or "default"
    return Path("/dev/shm") / f"castor-{os.getuid()}" / job / f"rank-{os.environ.get('RANK') or 0}"


def manifest_meta(rank: int) -> dict[str, JsonValue]:
    """What every manifest of this process records about where it was made: its rank, the world size and
    the recovery-plan generation the agent started it in (checkpoints made before a rollback to an older
    iteration belong to another history, and the planner must tell them apart)."""
    meta: dict[str, JsonValue] = {"rank": rank}
    if "WORLD_SIZE" in os.environ:
        meta["world_size"] = int(os.environ["WORLD_SIZE"])
    if os.environ.get(GENERATION_ENV, "").isdigit():
        meta["generation"] = int(os.environ[GENERATION_ENV])
    return meta


class AgentNotifier:
    """Announces checkpoint events to the worker agent, if there is one ($CASTOR_AGENT_NOTIFY): one
    datagram each, never blocking, and any failure ignored (the agent may be down; training must not
    notice)."""

    def __init__(self, path: str | None, rank: int, directory: Path, takes: str = AGENT_NOTICES) -> None:
        self._path = path
        self._takes = {event.strip() for event in takes.split(",")}
        self._rank = rank
        self._directory = directory
        self._socket: socket.socket | None = None

    def takes(self, event: Event) -> bool:
        """Whether a notice of `event` goes anywhere: there is an agent, and it takes such notices."""
        return bool(self._path) and (event != "restored" or event in self._takes)

    @classmethod
    def from_environment(cls, rank: int, directory: Path) -> AgentNotifier:
        # A process the agent started cold (not from a warm spare) lets its hang watchdog ask for its stacks
        # from here on.
        install_stack_dump()
        return cls(os.environ.get(NOTIFY_ENV), rank, directory, os.environ.get(NOTICES_ENV, ""))

    def notify(
        self,
        event: Event,
        iteration: int,
        slot: int | None,
        *,
        stalled_s: float,
        save_calls: int,
        newest: int | None = None,
    ) -> None:
        """`newest`: with "restored", the newest iteration the process's store held then (FRESH_START:
        none), which the restore may have rolled back from."""
        if not self._path or not self.takes(event):
            return
        message: dict[str, object] = {
            "event": event,
            "rank": self._rank,
            "iteration": iteration,
            "slot": slot,
            "dir": str(self._directory),
            # The stall so far (cumulative, this process): the agent adds up its training processes' figures
            # (a restarted process starts again from 0, told apart by its pid).
            "pid": os.getpid(),
            "stalled_s": stalled_s,
            "save_calls": save_calls,
        }
        if newest is not None:
            message["newest"] = newest
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(json.dumps(message).encode(), self._path)
        except OSError:
            pass

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
