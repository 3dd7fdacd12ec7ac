"""`castor demo`: the embedded one-machine setup with a training job that survives three kinds of failure.

The root service runs on the embedded defaults (SQLite in the state directory, REST heartbeats, the local
cloud operator, a local directory as persistent tier). A job of N local machines (m = 2) trains a small
model with a real data-parallel loop (worker_lib.examples.train_mlp: torch.distributed over gloo, a
checkpoint every iteration). At spaced iterations the demo injects a software failure (a training
process is killed), a machine loss (agent, processes and shared memory gone) and the loss of a whole
placement group, while the job page shows it live. It ends with a summary table and keeps serving the
pages until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

import httpx

from services import local_faults
from services.root.clients.local import RELEASE_GRACE_S
from services.root.settings import Settings

PERSIST_EVERY = 10
# A fault that is not injected or recovered within this long means something is broken: say so and stop,
# rather than wait forever.
STEP_TIMEOUT_S = 300.0
# How long the server's shutdown waits for open connections and request tasks before it cancels them: longer
# than the local operator's release of the job's machines (a task of the stop request), which must finish.
SERVER_GRACE_S = int(RELEASE_GRACE_S) + 10
# How long a fault waits past its iteration for every machine's warm spare (see _inject_at).
WARM_WAIT_S = 5.0
# The machine loss is shown restoring the lost rank from its peer's memory. The planner takes the newest
# iteration complete in any tier, and the replicas trail training by a few iterations (while aligned rounds
# agree on the next one), so a loss struck just after an iteration was persisted would restore from the
# persistent tier instead: the demo strikes it in the middle of a persist period, once the job's replicas
# reached the period's persisted iteration, PEER_MARGIN iterations or more before the next one (at most
# PEER_WAIT_S past its iteration; then it strikes anyway).
PEER_MARGIN = 3
PEER_WAIT_S = 60.0
# Ctrl-C stops the job (its machines get RELEASE_GRACE_S to exit), then the server: bounded steps, and past
# this budget a watchdog prints every thread's stack and ends the process, so a Ctrl-C never hangs silently.
STOP_JOB_TIMEOUT_S = RELEASE_GRACE_S + 15
SHUTDOWN_BUDGET_S = STOP_JOB_TIMEOUT_S + SERVER_GRACE_S + 15


@dataclass
class Fault:
    kind: str  # software, machine, group
    at_fraction: float
    description: str


FAULTS = [
    Fault("software", 0.25, "kill -9 of the training process of rank 1"),
    Fault("machine", 0.50, "loss of machine 2 (agent, processes and shared memory)"),
    Fault("group", 0.75, "loss of both machines of placement group 0"),
]


class Demo:
    def __init__(
        self, settings: Settings, machines: int, iterations: int, faults: bool, out: Any = sys.stdout
    ):
        self.settings = settings
        self.machines = machines
        self.iterations = iterations
        self.faults = faults
        self.out = out
        self.url = f"http://{settings.host}:{settings.port}"
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {settings.resolved_admin_token()}"},
            timeout=30,
        )
        self.job: dict[str, Any] = {}

    def say(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    async def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.http.request(method, "/api/v1" + path, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    async def run(self) -> list[dict[str, Any]]:
        await self._wait_for_root()
        command = [
            sys.executable,
            "-m",
            "worker_lib.examples.train_mlp",
            f"--iterations={self.iterations}",
            "--sleep=0.2",
        ]
        self.job = await self.api(
            "POST",
            "/jobs",
            json={
                "name": f"demo-{uuid.uuid4().hex[:6]}",
                "machines": self.machines,
                "replicas": 2,
                "persist_every": PERSIST_EVERY,
                "launch": {"command": command},
            },
        )
        self.say(
            f"Job {self.job['name']}: {self.machines} local machines, m = 2, {self.iterations} iterations."
        )
        self.say(f"  live page: {self.url}/jobs/{self.job['id']}")
        if self.faults:
            for fault in FAULTS:
                await self._inject_at(fault)
        final = await self._wait_for_state({"completed", "failed"}, within_s=600)
        failures = list(reversed(await self.api("GET", f"/jobs/{self.job['id']}/failures")))
        self.say(
            f"\nJob {final['state']} at iteration {final['newest_iteration']}; "
            f"wasted time {final['wasted_time_s']:.1f} s."
        )
        self.say(summary_table(failures))
        return failures

    async def _wait_for_root(self) -> None:
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get("/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the root service did not start at {self.url}")

    async def _job(self) -> dict[str, Any]:
        job: dict[str, Any] = await self.api("GET", f"/jobs/{self.job['id']}")
        return job

    async def _wait_for_state(self, states: set[str], within_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            job = await self._job()
            if job["state"] in states:
                return job
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the job did not reach {states} in {within_s:.0f}s")

    async def _inject_at(self, fault: Fault) -> None:
        target = int(self.iterations * fault.at_fraction)
        if fault.kind == "machine":
            target += PERSIST_EVERY // 2 - target % PERSIST_EVERY

        reached_at: list[float] = []  # when the job first reached the target

        async def ready_or_over() -> dict[str, Any] | None:
            job = await self._job()
            if job["state"] in ("completed", "failed", "stopped"):
                return job
            if not (job["state"] == "running" and (job["newest_iteration"] or 0) >= target):
                return None
            reached_at[:] = reached_at or [time.monotonic()]
            # Warm spares make the recovery the demo shows a fast one; on a loaded host they may take longer
            # to import torch than the job has iterations left, so the fault goes in without them then.
            waited_s = time.monotonic() - reached_at[0]
            if fault.kind == "machine" and not replicas_past_persisted(job) and waited_s < PEER_WAIT_S:
                return None
            warm_enough = await self._all_warm() or waited_s > WARM_WAIT_S
            return job if warm_enough else None

        job = await self._poll(ready_or_over, bool, f"the job to reach iteration {target}")
        if job["state"] != "running":
            return
        recovered_before = await self._recovered_count()
        self.say(f"iteration {job['newest_iteration']}: injecting {fault.description}")
        machines = {m["rank"]: m for m in await self.api("GET", f"/jobs/{self.job['id']}/machines")}
        if fault.kind == "software":
            local_faults.kill_training_process(self._shm_dir(machines[1]["instance_id"]), rank=1)
        else:
            victims = [2] if fault.kind == "machine" else [0, 1]
            for rank in victims:
                instance = machines[rank]["instance_id"]
                local_faults.lose_machine(self._shm_dir(instance), instance)
        await self._poll(
            self._recovered_count,
            lambda count: count > recovered_before,
            f"recovery from the {fault.kind} fault",
        )
        event = next(
            e for e in await self.api("GET", f"/jobs/{self.job['id']}/failures") if e["state"] == "recovered"
        )
        self.say(
            f"  recovered: {event['kind']} failure, tier {event['tier']}, "
            f"{event['iterations_lost']} iteration(s) lost, "
            f"resumed {resume_seconds(event):.1f} s after detection"
        )

    @staticmethod
    async def _poll(read: Any, done: Any, what: str, interval_s: float = 0.25) -> Any:
        """Read the root's view until `done` says so (its state is in the database: nothing to wait on)."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while time.monotonic() < deadline:
            value = await read()
            if done(value):
                return value
            await asyncio.sleep(interval_s)
        raise TimeoutError(f"gave up after {STEP_TIMEOUT_S:.0f} s waiting for {what}")

    async def stop_unfinished_job(self) -> None:
        """Ctrl-C or an error mid-run: stop the job, so that its machines stop too and a later start of
        the root does not take them for failed machines to replace."""
        if not self.job:
            return
        # A client of its own: the demo's was in the middle of a request when Ctrl-C cancelled it.
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.http.headers, timeout=STOP_JOB_TIMEOUT_S
        ) as http:
            try:
                job = (await http.get(f"/api/v1/jobs/{self.job['id']}")).raise_for_status().json()
                if job["state"] not in ("completed", "failed", "stopped"):
                    (await http.post(f"/api/v1/jobs/{self.job['id']}/stop")).raise_for_status()
                    self.say(f"Stopped job {self.job['name']}.")
            except httpx.HTTPError as error:
                self.say(f"Could not stop job {self.job['name']}: {error!r}")

    def stop_machines_now(self) -> None:
        """The last resort of a shutdown past its budget: kill this job's local machines (agents, spares and
        training processes) by what their command lines and environments name."""
        if not self.job:
            return
        shm = self.settings.local_shm_base / uuid.UUID(self.job["id"]).hex
        # Substring matches: agents name their machine's directory under it, training processes and
        # warm spares carry it in CASTOR_SHM_DIR.
        local_faults.kill(
            local_faults.pids_with_arguments(str(shm))
            + local_faults.pids_with_environ(f"CASTOR_SHM_DIR={shm}")
        )

    async def _recovered_count(self) -> int:
        return sum(
            e["state"] == "recovered" for e in await self.api("GET", f"/jobs/{self.job['id']}/failures")
        )

    async def _all_warm(self) -> bool:
        machines = await self.api("GET", f"/jobs/{self.job['id']}/machines")
        return len(machines) == self.machines and all(
            (m["summary"].get("warm_spares") or 0) >= 1 for m in machines
        )

    def _shm_dir(self, instance: str) -> Any:
        return self.settings.local_shm_base / uuid.UUID(self.job["id"]).hex / instance


def replicas_past_persisted(job: dict[str, Any]) -> bool:
    """Whether the job's replicas are as new as its newest persisted iteration, with PEER_MARGIN iterations
    to go before the next (see PEER_MARGIN)."""
    newest, replicated = job.get("newest_iteration"), job.get("replicated_iteration")
    if not isinstance(newest, int) or not isinstance(replicated, int):
        return False
    offset = newest % PERSIST_EVERY
    return replicated >= newest - offset and offset <= PERSIST_EVERY - PEER_MARGIN


def resume_seconds(event: dict[str, Any]) -> float:
    if not event.get("resumed_at"):
        return float("nan")
    return (
        datetime.fromisoformat(event["resumed_at"]) - datetime.fromisoformat(event["detected_at"])
    ).total_seconds()


def summary_table(failures: list[dict[str, Any]]) -> str:
    rows = [("#", "recovery", "kind", "cause", "tier", "resume (s)", "iterations lost", "state")]
    for number, event in enumerate(failures, start=1):
        rows.append(
            (
                str(number),
                str(event["plan_id"]),
                event["kind"],
                event["cause"][:60],
                event["tier"] or "-",
                f"{resume_seconds(event):.1f}",
                str(event["iterations_lost"]),
                event["state"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


async def serve_demo(
    settings: Settings, machines: int, iterations: int, faults: bool, exit_when_done: bool
) -> int:
    import uvicorn

    from services.root.app import create_app

    class EmbeddedServer(uvicorn.Server):
        # Ctrl-C belongs to the demo (asyncio.run cancels it, and it stops its job before the server goes);
        # uvicorn's own handler would close the server under the demo's feet.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = EmbeddedServer(
        uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            # A connection still open at the end (a browser's) must not hold the shutdown: the app's
            # lifespan, which closes the database, runs after it.
            timeout_graceful_shutdown=SERVER_GRACE_S,
        )
    )
    serving = asyncio.create_task(server.serve())
    demo = Demo(settings, machines, iterations, faults)
    watchdog = ShutdownWatchdog(demo)
    _unfinished.append(demo)
    try:
        failures = await demo.run()
        recoveries = {e["plan_id"] for e in failures}  # a group loss is two machine failures, one recovery
        expected = len(FAULTS) if faults else 0
        ok = all(e["state"] == "recovered" for e in failures) and len(recoveries) == expected
        if len(recoveries) < expected:
            demo.say(
                f"Only {len(recoveries)} of {expected} faults went in before the job ended: this host was "
                "too slow for the iterations given (try more --iterations)."
            )
        if exit_when_done:
            return 0 if ok else 1
        demo.say(f"\nThe pages stay up at {demo.url} until Ctrl-C.")
        # Shielded: Ctrl-C cancels this task, and a task cancelled while awaiting another cancels that one
        # too. Cancelled, uvicorn skips its shutdown and the app's lifespan (the database's worker threads
        # stay open); the server is shut down below instead.
        await asyncio.shield(serving)
        return 0
    except asyncio.CancelledError:
        demo.say("\nCtrl-C: stopping the demo (a second Ctrl-C forces it).")
        raise
    finally:
        watchdog.start()
        await asyncio.shield(demo.stop_unfinished_job())  # Ctrl-C cancels this task: finish the stop
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(serving, SERVER_GRACE_S + 5)  # then the lifespan closes the database
        with contextlib.suppress(BaseException):
            await demo.http.aclose()
        _unfinished.remove(demo)


# The demo whose shutdown has not completed: a second Ctrl-C interrupts that shutdown (asyncio raises
# KeyboardInterrupt out of the event loop), and its machines must not outlive the process.
_unfinished: list[Demo] = []


def force_stop() -> None:
    """After a second Ctrl-C: kill the machines of a demo whose shutdown was interrupted."""
    for demo in _unfinished:
        demo.say("Ctrl-C again: killing the job's machines.")
        demo.stop_machines_now()


class ShutdownWatchdog:
    """A thread that ends the demo if its shutdown overruns SHUTDOWN_BUDGET_S: it prints every thread's
    stack (what the shutdown waits on), kills the job's machines and exits with status 1. It needs nothing
    from the event loop, which is what a hang would be blocking."""

    def __init__(self, demo: Demo, budget_s: float = SHUTDOWN_BUDGET_S):
        self.demo = demo
        self.budget_s = budget_s
        self._timer: threading.Timer | None = None

    def start(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.budget_s, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def _give_up(self) -> None:
        print(
            f"castor demo: the shutdown took over {self.budget_s:.0f} s; the stacks of its threads:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with contextlib.suppress(Exception):
            self.demo.stop_machines_now()
        exit_process(1)


def exit_process(code: int) -> NoReturn:
    """End `castor demo` once serve_demo has stopped what it started (the job, its machines, the server and
    its database): the interpreter's teardown has nothing left to release and is slow. This process imports
    torch (the persistent tier comes from worker_lib), and collecting its objects at exit took 8 to 17 s on a
    saturated 2-core host, most of what a Ctrl-C took; a non-daemon thread left behind would hold it
    forever."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
