"""A local cluster for end-to-end tests: root service(s) and N agents ("machines") as real processes on
this host, each machine with its own shared-memory directory, talking over loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services import local_faults
from tests.harness import free_port, stop_process, wait_for_port

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
# What `castor agent` writes when a thread held it past its exit deadline (stacks.exit_after).
HELD_PAST_EXIT = "after it stopped: exiting"
WORKLOAD = REPO / "tests" / "e2e" / "workloads" / "train_ddp.py"


def wait_until(condition: Callable[[], Any], timeout: float, message: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {message}")


class PortTaken(RuntimeError):
    """The root could not bind its port: another process took it after free_port() found it free."""


@dataclass
class Root:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self) -> None:
        stop_process(self.process)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@dataclass
class Machine:
    index: int
    instance_id: str
    shm_dir: Path
    process: Any  # subprocess.Popen, or _Adopted for the machines the root started
    log_path: Path


@dataclass
class LocalCluster:
    workdir: Path
    admin_token: str = "castor-admin.e2e"
    roots: list[Root] = field(default_factory=list)
    machines: list[Machine] = field(default_factory=list)
    job: dict[str, Any] = field(default_factory=dict)
    shm_base: Path = field(default_factory=lambda: Path("/dev/shm") / f"castor-e2e-{uuid.uuid4().hex[:8]}")

    # -- root ------------------------------------------------------------------------------------------

    def start_root(self, port: int | None = None, **settings: str) -> Root:
        """A root on `port`, or on a free one. free_port() only finds a port free: until the root binds it,
        seconds later (imports, migrations), another process on the host may bind it too, and the root
        exits with EADDRINUSE. Then a harness-chosen port is chosen again (a given one is the test's)."""
        for attempt in range(3):
            try:
                return self._start_root(port or free_port(), settings)
            except PortTaken:
                if port is not None or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start_root(self, port: int, settings: dict[str, str]) -> Root:
        env = {
            **os.environ,
            "CASTOR_STATE_DIR": str(self.workdir / "root-state"),
            "CASTOR_ADMIN_TOKEN": self.admin_token,
            "CASTOR_PORT": str(port),
            "CASTOR_LOCAL_SHM_BASE": str(self.shm_base),
            "CASTOR_HEARTBEAT_TIMEOUT_S": "3",
            "CASTOR_HEARTBEAT_INTERVAL_S": "0.5",
            **{f"CASTOR_{k.upper()}": v for k, v in settings.items()},
        }
        log_path = self.workdir / f"root-{len(self.roots)}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve"],
            cwd=REPO,
            env=env,
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_port(port, process, timeout=60)
        except (RuntimeError, TimeoutError) as exc:
            # Not in self.roots yet: close() would leave a root that is merely slow running. And the root's
            # own words (an import error, a taken port, a failed migration) belong in the test's failure.
            stop_process(process)
            tail = log_path.read_text(errors="replace")[-4000:]
            problem = PortTaken if "address already in use" in tail else RuntimeError
            raise problem(f"{exc}; {log_path.name} ends with:\n{tail}") from exc
        root = Root(process, f"http://127.0.0.1:{port}", log_path)
        self.roots.append(root)
        return root

    @property
    def root_urls(self) -> str:
        return ",".join(root.url for root in self.roots)

    def api(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> Any:
        """The answer of the first live root (as admin, or with `token`)."""
        last: Exception | None = None
        for root in self.roots:
            if root.process.poll() is not None:
                continue
            try:
                response = httpx.request(
                    method,
                    root.url + path,
                    headers={"Authorization": f"Bearer {token or self.admin_token}"},
                    timeout=30,
                    **kwargs,
                )
                response.raise_for_status()
                return response.json() if response.content else None
            except httpx.TransportError as exc:
                last = exc
        raise RuntimeError(f"no root answered {method} {path}: {last}")

    def create_job(self, **fields: Any) -> dict[str, Any]:
        body = {"name": f"e2e-{uuid.uuid4().hex[:8]}", **fields}
        self.job = self.api("POST", "/api/v1/jobs", json=body)
        return self.job

    def launch_job(self, command: list[str], **fields: Any) -> dict[str, Any]:
        """A job whose machines the root's local cloud operator starts (and replaces)."""
        return self.create_job(launch={"command": command, "cwd": str(REPO)}, **fields)

    def failures(self) -> list[dict[str, Any]]:
        return list(self.api("GET", f"/api/v1/jobs/{self.job['id']}/failures"))

    def job_state(self) -> dict[str, Any]:
        return dict(self.api("GET", f"/api/v1/jobs/{self.job['id']}"))

    def directive(self) -> dict[str, Any]:
        """The job's directive as its agents read it (with the job's worker token)."""
        path = f"/api/v1/worker/jobs/{self.job['id']}/directive"
        return dict(self.api("GET", path, token=self.job["worker_token"]))

    def persist_target(self) -> int | None:
        """The iteration the root has told every rank to persist next."""
        return (self.directive().get("persist") or {}).get("iteration")

    def wait_for_recoveries(self, count: int, timeout: float = 120) -> list[dict[str, Any]]:
        """The job's failure events once `count` of them are recovered (newest first)."""

        def recovered() -> list[dict[str, Any]] | None:
            events = self.failures()
            return events if sum(e["state"] == "recovered" for e in events) >= count else None

        try:
            return wait_until(recovered, timeout, f"{count} recovered failure(s)", interval=0.25)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\nfailures: {self.failures()}\n{self.logs()}") from exc

    def wait_for_job(self, state: str, timeout: float = 300) -> dict[str, Any]:
        try:
            return wait_until(
                lambda: (j := self.job_state())["state"] == state and j, timeout, f"job {state}", 0.5
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {self.job_state()}\n{self.logs()}") from exc

    def wait_until_warm(self, timeout: float = 120) -> None:
        """Every machine has its warm spares ready: a restart now measures recovery, not Python imports."""
        procs = int(self.job.get("procs_per_machine", 1))

        def warm() -> bool:
            machines = self.api("GET", f"/api/v1/jobs/{self.job['id']}/machines")
            return len(machines) == self.job["machines"] and all(
                (m["summary"].get("warm_spares") or 0) >= procs for m in machines
            )

        wait_until(warm, timeout, "warm spares on every machine", interval=0.5)

    def root_machine(self, rank: int) -> Machine:
        """The live machine of `rank` in a job the root launched: its agent process and shared memory."""
        machines = self.api("GET", f"/api/v1/jobs/{self.job['id']}/machines")
        instance = next(m["instance_id"] for m in machines if m["rank"] == rank)
        pid = _pid_with_argument("--instance-id", instance, "")
        shm_dir = self.shm_base / uuid.UUID(self.job["id"]).hex / instance
        log_path = (
            self.workdir / "root-state" / "jobs" / uuid.UUID(self.job["id"]).hex / "logs" / f"{instance}.log"
        )
        return Machine(rank, instance, shm_dir, _Adopted(pid), log_path)

    # -- machines --------------------------------------------------------------------------------------

    def start_machine(
        self,
        index: int,
        command: list[str],
        *,
        instance_id: str | None = None,
        rank: int | None = None,
        keep_shm: bool = True,
        extra_args: list[str] | None = None,
    ) -> Machine:
        # Unique to this cluster: losing a machine kills every process with its --instance-id on the host,
        # so two clusters on one host (parallel runs) must never share one.
        instance_id = instance_id or f"machine-{index}-{self.shm_base.name.rsplit('-', 1)[-1]}"
        shm_dir = self.shm_base / instance_id
        log_path = self.workdir / f"{instance_id}.log"
        # As an operator would: in a private file, never on the command line.
        token_file = self.workdir / f"worker-token-{self.job['id']}"
        token_file.touch(mode=0o600)
        token_file.write_text(self.job["worker_token"])
        args = [
            sys.executable,
            "-m",
            "services.cli",
            "agent",
            "--root",
            self.root_urls,
            "--job",
            self.job["id"],
            "--token-file",
            str(token_file),
            "--instance-id",
            instance_id,
            "--shm-dir",
            str(shm_dir),
            *(["--machine-rank", str(rank)] if rank is not None else []),
            *(["--keep-shm"] if keep_shm else []),
            *(extra_args or []),
            "--",
            *command,
        ]
        process = subprocess.Popen(
            args, cwd=REPO, stdout=log_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
        machine = Machine(index, instance_id, shm_dir, process, log_path)
        self.machines.append(machine)
        return machine

    def training_command(self, log_dir: Path, iterations: int, **options: Any) -> list[str]:
        extra = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        return [sys.executable, str(WORKLOAD), f"--iterations={iterations}", f"--log-dir={log_dir}", *extra]

    def wait_for_machines(self, timeout: float = 300) -> list[int]:
        """Every agent's exit code once all of them ended."""
        deadline = time.monotonic() + timeout
        codes = []
        for machine in self.machines:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                codes.append(machine.process.wait(remaining))
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(
                    f"{machine.instance_id} still running after {timeout}s\n{self.logs()}"
                ) from exc
        return codes

    def kill_machine(self, machine: Machine) -> None:
        """A hardware failure: the agent and every training process die at once; memory is lost too."""
        local_faults.lose_machine(machine.shm_dir, machine.instance_id)
        machine.process.wait()

    # -- inspection ------------------------------------------------------------------------------------

    def logs(self, tail: int = 60) -> str:
        parts = []
        for path in sorted([*self.workdir.glob("*.log"), *self.workdir.glob("root-state/jobs/*/logs/*.log")]):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"---- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def close(self) -> None:
        for root in self.roots:
            root.stop()  # first, so that it replaces nothing while its machines go away
        for machine in self.machines:
            local_faults.lose_machine(machine.shm_dir, machine.instance_id)
        # Machines the root started (and their warm spares, which carry no CASTOR_SHM_DIR yet).
        local_faults.kill(local_faults.pids_with_arguments("--shm-dir", str(self.shm_base)))
        local_faults.kill(local_faults.pids_with_environ(f"CASTOR_SHM_DIR={self.shm_base}"))
        shutil.rmtree(self.shm_base, ignore_errors=True)


def read_events(log_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's events so far, from its complete lines only. A rank whose log holds no complete line yet
    is left out: a workload opens its log before its first event, and a test that looks between the two
    must see that rank as not started, not as a rank with an empty history (stop 22's CI failure)."""
    events: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(log_dir.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        complete, _, _partial = path.read_text().rpartition("\n")
        rank_events = [json.loads(line) for line in complete.splitlines() if line.strip()]
        if rank_events:
            events[rank] = rank_events
    return events


def _pid_with_argument(*arguments: str) -> int:
    pids = local_faults.pids_with_arguments(*arguments)
    if len(pids) != 1:
        raise LookupError(f"expected one process with {arguments} in its command line, found {pids}")
    return pids[0]


class _Adopted:
    """A process this test did not start (the root's local operator did): enough of Popen to kill it."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if Path(f"/proc/{self.pid}").exists() else 0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        wait_until(
            lambda: self.poll() is not None or _is_zombie(self.pid), timeout or 30, f"pid {self.pid} to exit"
        )
        return -9


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def keep_logs(request: Any, logs: str) -> None:
    """A cluster fixture's teardown: the processes' logs go to test-artifacts/ where CI finds them when the
    test failed, or when an agent was held past its exit deadline (the test passes: the agent exited, but
    the stacks it wrote are the evidence of a thread that never returned, a bug to find)."""
    failed = getattr(request.node, "rep_call", None)
    held = HELD_PAST_EXIT in logs
    if (failed is not None and failed.failed) or held:
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"{request.node.name}.log").write_text(logs)
    if held:
        warnings.warn(
            f"an agent was held past its exit deadline: its threads' stacks are in "
            f"test-artifacts/{request.node.name}.log",
            stacklevel=2,
        )
