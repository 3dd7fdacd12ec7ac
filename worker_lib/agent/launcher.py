"""Launches and watches a machine's training processes, the way torchrun does.

Each process gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, ...) so training code written for torchrun runs unchanged, plus Castor's own:
CASTOR_SHM_DIR (the rank's checkpoint store, owned by the agent so it outlives the process),
CASTOR_AGENT_NOTIFY (where commits are announced) and CASTOR_RESTORE_ITERATION (the iteration the
recovery plan chose for every rank). Each process leads its own process group, so stopping it also stops
its children (data loader workers). It never gets the worker token, and dies with the agent (a parent-death
signal, see die_with_parent); pids/rank-<r> names it with its start time, so a restarted agent can find
what a previous one left running (see stale).

Like torchrun, each process gets TORCHELASTIC_ERROR_FILE, a file of its own: an uncaught exception in a
process whose entry point is wrapped in torch.distributed.elastic's `@record` (or any process started from
a warm spare, which wraps the script itself) is written there as JSON (type and message, the traceback),
and the exit report carries it to the root (see read_error_file).

Each process also gets CASTOR_STACKS_FILE (see stacks.py): where it writes its threads' stacks on SIGUSR1,
which the hang watchdog asks for before it kills a process that stopped committing (see stop_hung).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_lib.agent import die_with_parent
from worker_lib.agent.stacks import STACKS_FILE_ENV, STACKS_SIGNAL
from worker_lib.agent.stale import record_pid
from worker_lib.agent.warm import READY_FD_ENV, STDIN_FD_ENV
from worker_lib.agent_ipc import AGENT_NOTICES, NOTICES_ENV
from worker_lib.api.worker import HANG_ERROR_TYPE

log = logging.getLogger(__name__)

# Secrets never handed to training processes: experiment trackers and crash reporters record a process's
# environment, and whoever reads the worker token could act as any machine of the job (the admin token:
# as the operator, should a shell that runs an agent have it set).
SECRET_VARIABLES = frozenset({"CASTOR_WORKER_TOKEN", "CASTOR_WORKER_TOKEN_FILE", "CASTOR_ADMIN_TOKEN"})


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in SECRET_VARIABLES}


@dataclass(frozen=True)
class LaunchSpec:
    command: Sequence[str]
    machine_rank: int
    procs_per_machine: int
    world_size: int
    master_addr: str
    master_port: int
    generation: int
    restore_iteration: int | None
    shm_dir_of: Mapping[int, str]  # global rank -> CASTOR_SHM_DIR
    notify_socket: str
    job_id: str
    extra_env: Mapping[str, str]

    def environment(self, local_rank: int) -> dict[str, str]:
        rank = self.machine_rank * self.procs_per_machine + local_rank
        env = {
            **without_secrets({**os.environ, **self.extra_env}),
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.procs_per_machine),
            "GROUP_RANK": str(self.machine_rank),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.generation - 1),
            "TORCHELASTIC_RUN_ID": self.job_id,
            "CASTOR_JOB": self.job_id,
            "CASTOR_SHM_DIR": self.shm_dir_of[rank],
            "CASTOR_AGENT_NOTIFY": self.notify_socket,
            NOTICES_ENV: AGENT_NOTICES,
            "CASTOR_GENERATION": str(self.generation),
            "CASTOR_RESTORE_ITERATION": "none"
            if self.restore_iteration is None
            else str(self.restore_iteration),
        }
        return env

    def global_rank(self, local_rank: int) -> int:
        return self.machine_rank * self.procs_per_machine + local_rank


@dataclass(frozen=True)
class ProcessExit:
    generation: int
    local_rank: int
    global_rank: int
    exit_code: int  # negative: killed by that signal (subprocess convention)
    expected: bool  # the agent stopped it on purpose
    # The uncaught exception the process wrote to its error file: {"type", "message", "traceback"}.
    error: dict[str, str] | None = None


ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# What an exit report carries of an error file: the message's start and the traceback's end (its last
# frames, where the exception was raised), within what the root's API accepts.
ERROR_MESSAGE_CHARS = 2000
ERROR_TRACEBACK_CHARS = 8000


def hang_error(reason: str, stacks: Path) -> dict[str, str]:
    """The exit report's error for a process the hang watchdog stopped: why, and where each thread was."""
    try:
        dump = stacks.read_text(errors="replace")
    except OSError:
        dump = ""
    # faulthandler lists the most recent call first: the head is where the process is stuck.
    return {
        "type": HANG_ERROR_TYPE,
        "message": f"{HANG_ERROR_TYPE}: {reason}"[:ERROR_MESSAGE_CHARS],
        "traceback": dump[:ERROR_TRACEBACK_CHARS] or "(no stacks: the process did not answer SIGUSR1)",
    }


async def _until_written(path: Path, timeout_s: float) -> None:
    """Until `path` is non-empty and stopped growing (faulthandler's dump is done), or `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline, size = loop.time() + timeout_s, -1
    while loop.time() < deadline:
        try:
            current = os.stat(path).st_size  # a local stat: no need for a thread
        except OSError:
            current = 0
        if current > 0 and current == size:
            return
        size = current
        await asyncio.sleep(0.1)


def written_before(path: Path, moment: float) -> bool:
    """Whether the file at `path` was last written before `moment` (time.time()); False if it is missing."""
    try:
        return path.stat().st_mtime < moment
    except OSError:
        return False


def read_error_file(path: Path) -> dict[str, str] | None:
    """The exception in a torchelastic error file (`ErrorHandler.record_exception`'s format:
    {"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback ..."}}}; the
    message may also be a plain string). None when there is none or it cannot be read."""
    try:
        data: Any = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    message: Any = data.get("message") if isinstance(data, dict) else None
    extra: Any = {}
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        message = message.get("message")
    if not isinstance(message, str) or not message:
        return None
    kind, _, rest = message.partition(": ")
    is_type = kind.replace(".", "").replace("_", "").isalnum() and " " not in kind and bool(rest)
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    traceback = stack if isinstance(stack, str) else ""
    if len(traceback) > ERROR_TRACEBACK_CHARS:
        traceback = "...\n" + traceback[-ERROR_TRACEBACK_CHARS:]
    return {
        "type": kind if is_type else "",
        "message": message[:ERROR_MESSAGE_CHARS],
        "traceback": traceback,
    }


def script_arguments(command: Sequence[str]) -> list[str] | None:
    """What a warm interpreter needs to run `command` when it is `python` plus a script or module and no
    interpreter options: `python train.py ...` -> ["train.py", ...], `python -m pkg ...` -> ["-m", "pkg",
    ...]; None otherwise."""
    rest = list(command[1:])
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return rest
    if rest and not rest[0].startswith("-"):
        return rest
    return None


# Variables an interpreter reads when it starts (search path, prefix, loader) or that the warm spare's
# preloaded modules read when imported: a spare started with the agent's values cannot stand in for a
# process that would start with other ones.
STARTUP_VARIABLES = ("PYTHON", "VIRTUAL_ENV", "LD_", "CASTOR_PRELOAD")

# What makes two interpreters interchangeable: the binary, the prefixes (a venv is a prefix over the same
# binary, with its own site-packages) and the module search path they start with (sys.path[0] is the
# script's directory, set per command).
_IDENTITY_QUERY = (
    "import json, os, sys; "
    "print(json.dumps([os.path.realpath(sys.executable), sys.prefix, sys.exec_prefix, sys.path[1:]]))"
)


def _startup_environment(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_VARIABLES) or k == "HOME"))


def _same_binary(program: str, env: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """`program` as a cold start finds it (on the PATH of `env`) and `env`'s startup variables, when it is
    this agent's Python binary started with the agent's startup environment; None when it is not."""
    executable = shutil.which(program, path=env.get("PATH", os.defpath))
    if executable is None or os.path.realpath(executable) != os.path.realpath(sys.executable):
        return None
    startup = _startup_environment(env)
    if startup != _startup_environment(os.environ):
        return None
    return os.path.abspath(executable), startup


async def interpreter_identity(executable: str, env: Mapping[str, str]) -> str | None:
    """The identity of `executable` started with `env`, as the interpreter itself reports it (None when it
    cannot say: not a Python, or it failed)."""
    try:
        process = await asyncio.create_subprocess_exec(
            executable,
            "-c",
            _IDENTITY_QUERY,
            # Castor's own variables play no part in an interpreter's identity, and secrets among them
            # (a worker token in the agent's environment) have no business in this process.
            env={k: v for k, v in env.items() if not k.startswith("CASTOR_")},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        async with asyncio.timeout(60):  # not wait_for: on Python 3.11 it can swallow a cancellation
            output, _ = await process.communicate()
    except (TimeoutError, OSError):
        return None
    return output.decode(errors="replace").strip() if process.returncode == 0 else None


class WorkerGroup:
    """The training processes of one generation on this machine, started from warm spares when it can."""

    def __init__(self, exits: asyncio.Queue[ProcessExit], *, warm: bool = True, pid_dir: Path | None = None):
        self.exits = exits
        self.warm = warm
        # pids/rank-<global rank> holds each running training process's pid: for operators and for
        # failure injection (a warm-started process's /proc environ is its spare's, not its rank's).
        self.pid_dir = pid_dir
        self.spec: LaunchSpec | None = None
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._spares: list[asyncio.subprocess.Process] = []
        self._stopping = False
        self._stopping_since = 0.0  # time.time() when stop() began (error files' clock)
        self._warm_starts = 0
        self._warm: set[int] = set()  # pids of spares whose imports are done
        # Whether a command's interpreter is the spares' (by its executable and startup environment): it
        # is asked once, not at every restart.
        self._same_interpreter: dict[tuple[str, tuple[tuple[str, str], ...]], bool] = {}
        # Each process's TORCHELASTIC_ERROR_FILE lies here: beside pids/, or (no machine directory, as in
        # some tests) a temporary directory made at the first launch.
        self._error_dir = pid_dir.parent / "errors" if pid_dir else None
        # Processes the hang watchdog stopped (local rank -> the reason): their exit reports say so.
        self._hung: dict[int, str] = {}
        # The signal the agent forwarded (signal(): it is stopping for good): start() launches no rank after
        # it, and gives it at once to the one it was launching when it came.
        self._forwarded: int | None = None
        # Set while no start() is launching processes: wait() waits for those it launches too.
        self._launched = asyncio.Event()
        self._launched.set()

    @property
    def error_dir(self) -> Path:
        if self._error_dir is None:
            self._error_dir = Path(tempfile.mkdtemp(prefix="castor-errors-"))
        return self._error_dir

    def error_file(self, spec: LaunchSpec, local_rank: int) -> Path:
        return self.error_dir / f"generation-{spec.generation}-rank-{spec.global_rank(local_rank)}.json"

    def stacks_file(self, spec: LaunchSpec, local_rank: int) -> Path:
        return self.error_dir / f"generation-{spec.generation}-rank-{spec.global_rank(local_rank)}.stacks"

    @property
    def warm_spares(self) -> int:
        """Spares whose imports are done."""
        return sum(1 for p in self._spares if p.returncode is None and p.pid in self._warm)

    async def prewarm(self, count: int) -> None:
        """Keep `count` warm interpreters ready for the next start."""
        if not self.warm:
            return
        self._spares = [p for p in self._spares if p.returncode is None]
        while len(self._spares) < count:
            ready_read, ready_write = os.pipe()
            # The spare's stdin carries its order; the script it runs gets the agent's stdin, as a cold
            # start inherits it (none when the agent has none, or its fd 0 is not inheritable).
            try:
                agent_stdin: int | None = os.dup(0) if os.get_inheritable(0) else None
            except OSError:
                agent_stdin = None
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "worker_lib.agent.warm",
                    *(["--machine", str(self.pid_dir.parent)] if self.pid_dir else []),
                    stdin=asyncio.subprocess.PIPE,
                    start_new_session=True,
                    pass_fds=(ready_write,) if agent_stdin is None else (ready_write, agent_stdin),
                    env={
                        **without_secrets(os.environ),
                        READY_FD_ENV: str(ready_write),
                        STDIN_FD_ENV: "-1" if agent_stdin is None else str(agent_stdin),
                        die_with_parent.PARENT_PID_ENV: str(os.getpid()),
                    },
                )
            except BaseException:
                os.close(ready_read)
                raise
            finally:
                os.close(ready_write)
                if agent_stdin is not None:
                    os.close(agent_stdin)
            self._spares.append(process)
            asyncio.get_running_loop().add_reader(ready_read, self._on_warm, ready_read, process.pid)

    def _on_warm(self, ready_read: int, pid: int) -> None:
        asyncio.get_running_loop().remove_reader(ready_read)
        with contextlib.suppress(OSError):
            if os.read(ready_read, 1) == b"1":
                self._warm.add(pid)
        os.close(ready_read)

    async def warm_arguments(self, command: Sequence[str], env: Mapping[str, str]) -> list[str] | None:
        """The arguments for a warm spare when it provably runs `command` as `command` itself would run:
        the command's executable (found on the PATH of `env`, as a cold start finds it) is the spares'
        interpreter with the same prefix and search path, and `env` starts an interpreter the way the
        agent's environment (the spares') does. A venv over the same base Python is another interpreter:
        its own site-packages. None: start the command as given."""
        arguments = script_arguments(command)
        candidate = _same_binary(command[0], env) if arguments is not None else None
        if candidate is None:
            return None
        executable, startup = candidate
        key = (executable, startup)
        if key not in self._same_interpreter:
            ours, theirs = await asyncio.gather(
                interpreter_identity(sys.executable, os.environ), interpreter_identity(executable, env)
            )
            self._same_interpreter[key] = ours is not None and ours == theirs
            if not self._same_interpreter[key]:
                log.info("%s is not the warm interpreter (%s): starting it cold", executable, sys.executable)
        return arguments if self._same_interpreter[key] else None

    async def _launch(self, spec: LaunchSpec, local_rank: int) -> asyncio.subprocess.Process:
        env = spec.environment(local_rank)
        # As torchrun does: one error file per process, set even where the user's environment names one
        # (a shared file would mix the ranks' exceptions). A leftover of an earlier run is not this one's.
        error_file = self.error_file(spec, local_rank)
        self.error_dir.mkdir(parents=True, exist_ok=True)
        error_file.unlink(missing_ok=True)
        env[ERROR_FILE_ENV] = str(error_file)
        env[STACKS_FILE_ENV] = str(self.stacks_file(spec, local_rank))
        spares = [p for p in self._spares if p.returncode is None]
        arguments = await self.warm_arguments(spec.command, env) if spares else None
        if spares and arguments is None:
            # This command never runs in a spare (another interpreter or startup environment, and the
            # command is the same at every restart): let the spares exit and keep none from now on.
            self.warm = False
            for spare in spares:
                if spare.stdin is not None:
                    spare.stdin.close()
        if arguments is not None and spares:
            process = spares[0]
            self._spares = spares[1:]
            assert process.stdin is not None
            order = {"argv": arguments, "env": env, "cwd": os.getcwd()}
            process.stdin.write(json.dumps(order).encode() + b"\n")
            await process.stdin.drain()
            process.stdin.close()
            self._warm_starts += 1
            return process
        if shutil.which(spec.command[0], path=env.get("PATH", os.defpath)) is None:
            # As starting it directly would: the directive fails to start training, said at once.
            raise FileNotFoundError(f"{spec.command[0]!r} not found")
        return await asyncio.create_subprocess_exec(
            *die_with_parent.wrap(spec.command, env), env=env, start_new_session=True
        )

    async def discard_spares(self, grace_s: float = 5.0) -> None:
        """Let the spares go. A warm one exits on its empty order. One still importing reads its order only
        once its imports are done: seconds of torch on a busy machine, never if an import hangs. Waiting for
        it held a stopping agent (Ctrl-C of the demo, a stopped job) until the operator's SIGKILL, so it is
        killed instead."""
        for process in self._spares:
            if process.returncode is not None:
                continue
            if process.stdin is not None:
                process.stdin.close()  # an empty order: the spare exits
            if process.pid not in self._warm:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        waits = [asyncio.ensure_future(p.wait()) for p in self._spares]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=grace_s)
            for process in self._spares:
                if pending and process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending)
        self._spares = []

    @property
    def running(self) -> bool:
        return any(p.returncode is None for p in self._processes.values())

    async def start(self, spec: LaunchSpec) -> None:
        """Start the processes of `spec`, one local rank after the other. A signal forwarded meanwhile
        (signal()) stops the launching: the process launched when it came gets it at once, and no further
        rank is launched."""
        self._launched.clear()
        try:
            await self.stop()
            self.spec, self._stopping, self._warm_starts = spec, False, 0
            self._hung.clear()
            for local_rank in range(spec.procs_per_machine):
                if self._forwarded is not None:
                    break
                process = await self._launch(spec, local_rank)
                self._processes[local_rank] = process
                if self.pid_dir is not None:
                    self.pid_dir.mkdir(parents=True, exist_ok=True)
                    record_pid(self.pid_dir / f"rank-{spec.global_rank(local_rank)}", process.pid)
                self._watchers.append(asyncio.create_task(self._watch(spec, local_rank, process)))
                if self._forwarded is not None:  # it came while this process was being launched
                    _signal_group(process.pid, self._forwarded)
        finally:
            self._launched.set()
        if self._forwarded is not None:
            log.info(
                "a signal came while starting generation %d: %d of %d training processes started, "
                "and given it",
                spec.generation,
                len(self._processes),
                spec.procs_per_machine,
            )
            return
        log.info(
            "started %d training processes (%d warm; generation %d, ranks %d..%d, restore %s)",
            spec.procs_per_machine,
            self._warm_starts,
            spec.generation,
            spec.global_rank(0),
            spec.global_rank(spec.procs_per_machine - 1),
            spec.restore_iteration,
        )

    async def _watch(self, spec: LaunchSpec, local_rank: int, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        error_file = self.error_file(spec, local_rank)
        error = read_error_file(error_file) if code != 0 else None
        # A process that failed on its own just before a stop (the recovery its failure set off, or a peer's,
        # reached this agent before its exit did) is no expected stop: its exit says why, and is reported.
        expected = self._stopping and not (
            error is not None and written_before(error_file, self._stopping_since)
        )
        if local_rank in self._hung and self.spec is spec:
            error = hang_error(self._hung.pop(local_rank), self.stacks_file(spec, local_rank))
        await self.exits.put(
            ProcessExit(spec.generation, local_rank, spec.global_rank(local_rank), code, expected, error)
        )

    async def stop_hung(self, global_rank: int, reason: str, dump_wait_s: float = 3.0) -> bool:
        """Kill the process of `global_rank` that the hang watchdog found silent, after asking it for its
        stacks (SIGUSR1; up to `dump_wait_s` for the dump to be written). Its exit is then reported as a
        failure (not an expected stop) with `reason` and the stacks. False: it is not running."""
        spec = self.spec
        local_rank = None if spec is None else global_rank - spec.machine_rank * spec.procs_per_machine
        process = self._processes.get(local_rank) if local_rank is not None else None
        if spec is None or local_rank is None or process is None or process.returncode is not None:
            return False
        self._hung[local_rank] = reason
        stacks = self.stacks_file(spec, local_rank)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, STACKS_SIGNAL)
        await _until_written(stacks, dump_wait_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return True

    def signal(self, signum: int) -> None:
        """Forward `signum` (the agent stops): to every process group, and to the processes a start() in
        progress launches from now on (it launches no more; see start)."""
        self._forwarded = signum
        self._signal_groups(signum)

    def _signal_groups(self, signum: int) -> None:
        # Every process's group, that of a process that already exited included: what it started (data
        # loader workers, helpers) may live on in its group after it died (an OOM kill), and must not
        # outlive a recovery. Linux keeps a group's id from being handed out as a pid while a member lives;
        # so a reaped leader whose pid another process now has left no group behind, and that pid's group
        # is a stranger's.
        for process in list(self._processes.values()):
            if process.returncode is not None and _pid_in_use(process.pid):
                continue
            _signal_group(process.pid, signum)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop every process: SIGTERM to each process group, SIGKILL after the grace period."""
        if not self._processes:
            return
        if not self._stopping:
            self._stopping, self._stopping_since = True, time.time()
        self._signal_groups(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in self._processes.values()]
        _, pending = await asyncio.wait(waits, timeout=grace_s)
        if pending:
            self._signal_groups(signal.SIGKILL)
            await asyncio.wait(pending)
        # What is left in the groups once every leader ended (a helper that ignores SIGTERM) goes too.
        self._signal_groups(signal.SIGKILL)
        for watcher in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        self._processes.clear()
        self._watchers.clear()

    async def wait(self) -> list[int]:
        """Exit codes of every process once all have ended, those a start() in progress launches included."""
        while True:
            processes = list(self._processes.values())
            codes = [await p.wait() for p in processes]
            await self._launched.wait()
            if list(self._processes.values()) == processes:
                return codes


def _pid_in_use(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    """`signum` to the process group `pgid`; nothing when it is gone (or no longer ours to signal)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
