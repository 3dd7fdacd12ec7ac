"""The local cloud operator (embedded default): "machines" are `castor agent` processes on this host, each
with its own shared-memory directory. Replacing one starts a fresh agent with empty memory, which the
root binds to the failed rank when it registers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from services.root.clients import CloudOperatorError, JobInfo, MachineInfo, Replacement, ReplacementJournal

log = logging.getLogger(__name__)

RELEASE_GRACE_S = 10.0

# The root's own secrets stay out of the agents it starts (and so out of their training processes, which a
# tracker may record): an agent needs only its job's worker token, which it reads from its file.
ROOT_SECRETS = frozenset(
    {"CASTOR_ADMIN_TOKEN", "CASTOR_DATABASE_URL", "CASTOR_WORKER_TOKEN", "CASTOR_WORKER_TOKEN_FILE"}
)


class LocalOperator:
    name = "local"

    def __init__(self, root_url: str, state_dir: Path, shm_base: Path, max_machines: int = 64):
        self.root_url = root_url
        self.state_dir = state_dir
        self.shm_base = shm_base
        self.max_machines = max_machines  # CASTOR_LOCAL_MAX_MACHINES: one host runs every agent
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        # Which job each agent this operator started belongs to. Instance ids come from the agents'
        # registrations (any worker of any job may send any id), so a replacement stops only what this
        # operator started for that same job: another job's machine named as "the failed one" is left alone.
        self._owners: dict[str, uuid.UUID] = {}

    @staticmethod
    def _name(job: JobInfo, rank: int, generation: int = 0) -> str:
        """An agent's instance id, made from the job and rank only: never from an id a worker sent, which
        becomes a log file's and a shared-memory directory's name."""
        base = f"local-{job.id.hex[:8]}-m{rank}"
        return base if generation == 0 else f"{base}~{generation}"

    def _job_dir(self, job: JobInfo) -> Path:
        return self.state_dir / "jobs" / job.id.hex

    async def provision(self, job: JobInfo, worker_token: str) -> None:
        if job.launch is None:
            return  # the machines are started by someone else
        if job.num_machines > self.max_machines:
            # The API refuses such a job (422); never start thousands of processes on one host anyway.
            raise CloudOperatorError(
                f"job {job.name!r} has {job.num_machines} machines; this host starts at most "
                f"{self.max_machines} (CASTOR_LOCAL_MAX_MACHINES)"
            )
        directory = self._job_dir(job)
        directory.mkdir(parents=True, exist_ok=True)
        # Private from its first byte (an existing file keeps its mode through open(), hence the fchmod).
        descriptor = os.open(directory / "worker-token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as token_file:
            os.fchmod(descriptor, 0o600)
            token_file.write(worker_token)
        for rank in range(job.num_machines):
            self._start(job, self._name(job, rank), rank)

    async def replace(
        self,
        job: JobInfo,
        failed: MachineInfo,
        bound_instances: set[str],
        journal: ReplacementJournal | None = None,
    ) -> Replacement:
        """Start a fresh agent for the failed rank, its instance id recorded in `journal` first. A try that
        finds one recorded whose agent this operator still runs returns it instead of starting a second;
        otherwise the recorded agent (never registered, or its start failed) is stopped and a new one
        chosen."""
        if job.launch is None:
            raise CloudOperatorError(
                f"job {job.name!r} has no launch spec: start a machine for rank {failed.rank} yourself "
                "(castor agent --machine-rank ...)"
            )
        journal = journal if journal is not None else ReplacementJournal()
        recorded = journal.intent.get("chosen")
        if recorded and self.instance_gone(str(recorded)) is False:
            return Replacement(str(recorded), f"agent {recorded} for rank {failed.rank} already started")
        # Not to start again: the failed machine, the agent an earlier try chose (whose start failed, or
        # which never registered) and the instance this request replaces in turn.
        stale = {failed.instance_id} | {str(i) for i in (recorded, journal.intent.get("replacing")) if i}
        generation = 1
        while (instance := self._name(job, failed.rank, generation)) in bound_instances | stale:
            generation += 1
        replacing = str(journal.intent.get("replacing") or failed.instance_id)
        await journal.record({"replacing": replacing, "chosen": instance})
        for gone in stale:  # a machine declared failed must not come back as a zombie
            self._stop_instance(gone, job)
        self._start(job, instance, failed.rank)
        return Replacement(instance, f"started agent {instance} for rank {failed.rank}")

    async def release(self, job: JobInfo) -> None:
        """Stop the job's machines: SIGTERM first (an agent forwards it to its training processes and
        exits), SIGKILL after RELEASE_GRACE_S; then free their shared memory."""
        instances = [i for i in self._processes if self._owners.get(i) == job.id]
        for instance in instances:
            with contextlib.suppress(ProcessLookupError):
                self._processes[instance].send_signal(signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + RELEASE_GRACE_S
        while any(self._processes[i].poll() is None for i in instances):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
        for instance in instances:
            self._stop_instance(instance, job)
        shutil.rmtree(self.shm_base / job.id.hex, ignore_errors=True)

    def _start(self, job: JobInfo, instance: str, rank: int) -> None:
        assert job.launch is not None
        logs = self._job_dir(job) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "services.cli",
            "agent",
            "--root",
            self.root_url,
            "--job",
            str(job.id),
            # The token from its file: on the command line every user of the host could read it.
            "--token-file",
            str(self._job_dir(job) / "worker-token"),
            "--instance-id",
            instance,
            "--machine-rank",
            str(rank),
            "--shm-dir",
            str(self.shm_base / job.id.hex / instance),
            *([] if job.launch.get("warm_start", True) else ["--no-warm-start"]),
            "--",
            *job.launch["command"],
        ]
        inherited = {key: value for key, value in os.environ.items() if key not in ROOT_SECRETS}
        env = {**inherited, **job.launch.get("env", {})}
        with open(logs / f"{instance}.log", "ab") as log_file:
            process = subprocess.Popen(
                command,
                cwd=job.launch.get("cwd") or None,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._processes[instance] = process
        self._owners[instance] = job.id
        log.info("started local machine %s (rank %d) as pid %d", instance, rank, process.pid)

    def _stop_instance(self, instance: str, job: JobInfo) -> None:
        """Stop an agent this operator started for `job` (any other id: nothing to do)."""
        if self._owners.get(instance) != job.id:
            return
        del self._owners[instance]
        process = self._processes.pop(instance, None)
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def instance_gone(self, instance_id: str) -> bool | None:
        """Whether the agent process of a machine this operator started has exited (a suspect machine's
        second signal); None for a machine it did not start."""
        process = self._processes.get(instance_id)
        return None if process is None else process.poll() is not None

    def close(self) -> None:
        for instance in list(self._processes):
            process = self._processes[instance]
            if process.poll() is not None:
                self._processes.pop(instance)
                self._owners.pop(instance, None)
