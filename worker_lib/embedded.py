"""Embedded mode, for training launched by plain torchrun instead of `castor agent`.

Each training process calls `attach(root_url, job_id, token)` once, before creating its Checkpointer.
Local rank 0 of each machine then runs the machine's Castor services (registration, heartbeats,
replication to placement peers, serving checkpoints) on a background thread; every local rank's
checkpoints go to the machine's shared memory, so torchrun's restart of a crashed worker group finds them.

What this mode gives up compared with `castor agent`: a crashed process is noticed only through torchrun's
restart and a missed heartbeat (the agent reports the exit at once), the services restart with local rank
0, and the root's recovery directives (stop, restore a planned iteration, replace a machine) are not
followed: torchrun restarts the workers and every rank restores the newest iteration all ranks hold.
When training ends cleanly (every Checkpointer closed without an exception), each machine replicates its
last checkpoints and reports that it finished, and the job completes once all have.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import threading
import time
from pathlib import Path

from worker_lib.agent.address import default_address
from worker_lib.agent.heartbeat import Replaced
from worker_lib.agent.priority import NICE_ENV, replication_nice
from worker_lib.agent.services import MachineIdentity, MachineServices
from worker_lib.agent_ipc import AGENT_NOTICES, NOTICES_ENV, notify_socket_path
from worker_lib.client import RootClient

log = logging.getLogger(__name__)

OWN_NOTICE_WAIT_S = 2.0  # for this process's own "finished" notice to cross the notify socket


class EmbeddedServices:
    """The machine services on a daemon thread with its own event loop (local rank 0 only)."""

    def __init__(self, services: MachineServices, *, finish_timeout_s: float = 60.0):
        self.services = services
        self.finish_timeout_s = finish_timeout_s
        self.loop = asyncio.new_event_loop()
        self.registered = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="castor-embedded-agent", daemon=True)
        self._stop: asyncio.Event | None = None

    def start(self, timeout_s: float) -> None:
        self._thread.start()
        if not self.registered.wait(timeout_s):
            raise TimeoutError(f"the root did not register this machine within {timeout_s}s")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        try:
            await self.services.start()
        except BaseException as exc:  # reported to the caller of start()
            self.error = exc
            self.registered.set()
            return
        self.registered.set()
        heartbeats = asyncio.create_task(self.services.heartbeats())
        stop = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait({heartbeats, stop}, return_when=asyncio.FIRST_COMPLETED)
        if heartbeats in done and (error := heartbeats.exception()) is not None:
            if isinstance(error, Replaced):
                log.error("the root gave this machine's rank to another machine: %s", error)
            else:  # the services stop: training goes on without replication, which must not go unsaid
                log.error("this machine's Castor services stopped: %r", error, exc_info=error)
        heartbeats.cancel()
        stop.cancel()
        await self.services.close()

    def close(self) -> None:
        """Stop the services (at exit). When every local rank finished cleanly, first see the job through:
        replicate the last checkpoints to the peers, tell the root this machine finished, and keep serving
        the peers' last replicas until the job completes (or `finish_timeout_s`). Otherwise, stop at once:
        torchrun restarts the workers, and replicas in flight are simply not committed."""
        if self._stop is None or not self._thread.is_alive():
            return
        deadline = time.monotonic() + self.finish_timeout_s
        try:
            if self._finished_cleanly(deadline):
                self._see_the_job_through(deadline)
        except Exception as exc:  # at exit: say why, never hang or raise
            log.warning("could not see the job through to its completion: %s", exc)
        finally:
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=15)

    def _finished_cleanly(self, deadline: float) -> bool:
        """Whether every local rank's Checkpointer said it finished. This process's own notice is on its way
        if it finished; the other local ranks get until the deadline, as they may end a little later."""
        own_rank = int(os.environ.get("RANK", "0"))
        waited_for_own = time.monotonic() + OWN_NOTICE_WAIT_S
        local = set(self.services.local_ranks())
        while not local <= self.services.finished_ranks:
            now = time.monotonic()
            if now > deadline or (own_rank not in self.services.finished_ranks and now > waited_for_own):
                return False
            time.sleep(0.02)
        return True

    def _see_the_job_through(self, deadline: float) -> None:
        services = self.services
        # In this thread: at exit, executors refuse new work, so the flush cannot go through to_thread.
        if services.replicator is not None and not services.replicator.flush(
            services.local_ranks(), timeout_s=max(0.0, deadline - time.monotonic())
        ):
            log.warning("the last checkpoints did not reach every peer in time")
            return
        job_state = asyncio.run_coroutine_threadsafe(self._report_finished(deadline), self.loop).result(
            timeout=max(0.0, deadline - time.monotonic()) + 15
        )
        if job_state != "completed":
            log.warning(
                "the job is %s, not completed (waited up to %.0fs for the other machines to finish)",
                job_state,
                self.finish_timeout_s,
            )

    async def _report_finished(self, deadline: float) -> str:
        """Report this machine finished, then wait for the job to complete: every machine reports only after
        its replicas reached this one, so this machine's data plane must serve until then."""
        client = self.services.client
        machine = self.services.machine_rank
        directive = await client.directive(after=-1, wait_s=0, machine=machine)
        await self.services.report_progress(directive.generation, "finished")
        while directive.status != "finished" and (left := deadline - time.monotonic()) > 0:
            directive = await client.directive(
                after=directive.revision, wait_s=min(left, 10.0), machine=machine
            )
        return directive.job_state


def attach(
    root_url: str,
    job_id: str,
    token: str,
    *,
    instance_id: str | None = None,
    address: str | None = None,
    shm_root: str | os.PathLike[str] | None = None,
    timeout_s: float = 60.0,
    finish_timeout_s: float = 60.0,
) -> EmbeddedServices | None:
    """Connect this torchrun-launched training process to Castor.

    Points this process's Checkpointer at the machine's shared memory (CASTOR_SHM_DIR) and at the
    machine services (CASTOR_AGENT_NOTIFY). On local rank 0 it also starts the services and returns
    them (they stop at exit); other local ranks get None.

    When every rank's Checkpointer closes without an exception (the end of its `with` block), the machine
    replicates its last checkpoints, reports that it finished, and at exit waits up to `finish_timeout_s`
    for the other machines to do the same: the job then completes instead of losing its heartbeats.
    """
    env = os.environ
    rank, local_rank = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0"))
    machine_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", "0")))
    instance = instance_id or env.get("CASTOR_INSTANCE_ID") or socket.gethostname()
    root = Path(shm_root or env.get("CASTOR_AGENT_SHM_DIR") or Path("/dev/shm/castor") / job_id / instance)
    env["CASTOR_JOB"] = job_id
    env["CASTOR_SHM_DIR"] = str(root / "local" / f"rank-{rank}")
    env["CASTOR_AGENT_NOTIFY"] = str(notify_socket_path(root))
    env[NOTICES_ENV] = AGENT_NOTICES
    if local_rank != 0:
        return None
    identity = MachineIdentity(
        instance_id=instance,
        address=address or env.get("CASTOR_ADDRESS") or default_address(root_url),
        data_port=int(env.get("CASTOR_DATA_PORT", "0")),
        machine_rank=machine_rank,
        embedded=True,
        # 0 unless asked: here replication's threads share the training process's interpreter lock, and a
        # lowered thread preempted while it holds the lock would hold up training's own thread.
        replication_nice=replication_nice(env.get(NICE_ENV), default=0),
    )
    embedded = EmbeddedServices(
        MachineServices(RootClient(root_url, job_id, token), token, identity, root),
        finish_timeout_s=finish_timeout_s,
    )
    embedded.start(timeout_s)
    atexit.register(embedded.close)
    return embedded
