"""Training processes left over by a previous agent of the same machine, and the pid files that find them.

The agent writes `pids/rank-<global rank>` in the machine's shared-memory directory for each training
process it starts: "<pid> <start time>", the start time in clock ticks since boot as /proc/<pid>/stat gives
it. Training processes die with their agent (`die_with_parent`), but a process the signal missed (started
by an older agent, stuck in the kernel, a grandchild of its own) must not keep training beside the ranks a
restarted agent launches. At start the agent kills what the pid files name, after checking each process
really is that machine's training process: the same start time (a recycled pid has another), and the
machine's mark on it (CASTOR_SHM_DIR under the machine's directory in its environment, or a warm spare's
`--machine <directory>` on its command line). Whatever else a pid file names is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcStat:
    pid: int
    session: int
    start_ticks: int


def proc_stat(pid: int) -> ProcStat | None:
    """What /proc says of a live process (None: gone, or a zombie, which is as good as gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3 of stat(5)
    if fields[0] in ("Z", "X"):
        return None
    return ProcStat(pid, session=int(fields[3]), start_ticks=int(fields[19]))


def record_pid(pid_file: Path, pid: int) -> None:
    stat = proc_stat(pid)
    pid_file.write_text(f"{pid} {stat.start_ticks if stat else ''}".strip() + "\n")


def read_pid_file(pid_file: Path) -> tuple[int, int | None] | None:
    """(pid, start time or None for a file written before start times were recorded)."""
    try:
        parts = pid_file.read_text().split()
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else None
    except (OSError, ValueError, IndexError):
        return None


def carries_mark(pid: int, machine_dir: Path) -> bool:
    """Whether the process was started for this machine: a cold start's CASTOR_SHM_DIR, or a warm
    spare's --machine argument (inherited by the data-loader workers it forks)."""
    local = f"CASTOR_SHM_DIR={machine_dir}/local/".encode()
    spare = f"\0--machine\0{machine_dir}\0".encode()
    with contextlib.suppress(OSError):
        if local in Path(f"/proc/{pid}/environ").read_bytes():
            return True
    with contextlib.suppress(OSError):
        return spare in Path(f"/proc/{pid}/cmdline").read_bytes() + b"\0"
    return False


def _all_processes() -> list[ProcStat]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := proc_stat(int(name))) is not None:
            found.append(stat)
    return found


def stale_processes(pid_dir: Path, machine_dir: Path) -> list[int]:
    """The live processes of the training sessions the pid files name, each checked to be this machine's.
    A training process leads its own session (its data-loader workers are in it): a session id is not
    reused while any member lives, so members of a recorded session that started no earlier than it,
    carrying the machine's mark, are what remains of it even when its leader is gone."""
    recorded = [r for f in sorted(pid_dir.glob("rank-*")) if (r := read_pid_file(f)) is not None]
    if not recorded:
        return []
    processes = _all_processes()
    doomed = set()
    me = os.getpid()
    for pid, started in recorded:
        for process in processes:
            if process.pid == me or (process.session != pid and process.pid != pid):
                continue
            if process.pid == pid and started is not None and process.start_ticks != started:
                continue  # a recycled pid: another process now
            if started is not None and process.start_ticks < started:
                continue
            if carries_mark(process.pid, machine_dir):
                doomed.add(process.pid)
    return sorted(doomed)


def kill_stale(pid_dir: Path, machine_dir: Path) -> list[int]:
    """Kill what a previous agent of this machine left running (see the module's doc); the pid files go."""
    doomed = stale_processes(pid_dir, machine_dir)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if doomed:
        log.warning("killed %d training process(es) left over by a previous agent: %s", len(doomed), doomed)
    for pid_file in pid_dir.glob("rank-*"):
        pid_file.unlink(missing_ok=True)
    return doomed
