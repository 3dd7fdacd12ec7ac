"""The worker agent (`castor agent`): one per machine. On top of the machine services (registration,
data plane, replication, heartbeats) it runs the training processes as the root's directives say: train
from an iteration, stop, exit. A crashed process is reported to the root at once, while its checkpoints
stay in the agent's shared memory.

Its states and their transition table are explicit (`worker_lib/agent/states.py`): monitors turn the
root's directives, process exits, commits, heartbeat losses and signals into facts; a pure `decide` returns
the next state and the actions; `Agent._invoke_run` performs them (torch.distributed.elastic's
`_invoke_run` shape)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Collection, Coroutine, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar, cast

from worker_lib.agent import stacks
from worker_lib.agent.address import default_address
from worker_lib.agent.dataplane import fetch
from worker_lib.agent.heartbeat import REPLACED_CODES, Replaced
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.launcher import LaunchSpec, ProcessExit, WorkerGroup
from worker_lib.agent.priority import REPLICATION_NICE
from worker_lib.agent.services import MachineIdentity, MachineServices, free_port
from worker_lib.agent.stale import kill_stale
from worker_lib.agent.states import (
    Action,
    AgentState,
    AgentStatus,
    Committed,
    DirectiveSeen,
    Exit,
    ExitAfterWorkers,
    Fact,
    ForwardSignal,
    HeartbeatReplaced,
    Hung,
    JobDeleted,
    PauseReplication,
    Prewarm,
    ProcessExited,
    Registered,
    ReportExit,
    ReportFinished,
    ReportInventory,
    ReportProgress,
    Restore,
    RestoreDone,
    RestoreFailed,
    ResumeReplication,
    Signalled,
    StartDone,
    StartFailed,
    StartWorkers,
    StopHung,
    StopWorkers,
    UpdateAddresses,
    check_transition,
    decide,
)
from worker_lib.agent.watchdog import HangPolicy, HangWatch
from worker_lib.api.shared import PlanSource
from worker_lib.api.worker import DirectiveOut
from worker_lib.client import RootClient, RootError, RootRejected, RootUnavailable, UnexpectedAnswer
from worker_lib.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from worker_lib.persistent import object_store

# For tests only: no background check, so that a plan names a corrupt copy and its restore is the check.
NO_BACKGROUND_CHECK_ENV = "CASTOR_TEST_NO_BACKGROUND_CHECK"

# How long the directive loop waits before asking again after an answer that was not the root's API (a
# proxy's error page with a 200): the client retries only transport errors and 5xx by itself.
UNEXPECTED_ANSWER_RETRY_S = 1.0

# How long a stopping agent waits for its own loops to end once cancelled.
STOPPING_LOOPS_S = 5.0

log = logging.getLogger(__name__)

T = TypeVar("T")


class RestoreFailure(CheckpointError):
    """A plan's restore failed; `unusable_persisted` names the persisted shards the object store served but
    that failed their checks (checksums, or another checkpoint than the plan's), reported with the failure
    so that the root's next plan passes them over."""

    def __init__(self, message: str, unusable_persisted: list[dict[str, Any]]):
        super().__init__(message)
        self.unusable_persisted = unusable_persisted


async def all_settled(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """asyncio.gather that returns or raises (the first error, by position) only once every awaitable has
    ended: a restore's fetches run in threads that cannot be cancelled, and one still writing a local store
    when the next plan's restore starts would share its slot with that restore's writer."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return cast(list[T], results)


async def cancel_and_wait(tasks: Collection[asyncio.Task[Any]], timeout_s: float) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait for them to end, at most `timeout_s`; returns those still running. Bounded: a
    loop that outlives its cancellation (Python 3.11's wait_for can swallow one) must not keep the agent from
    stopping its training processes and giving the machine's memory back."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return set()
    _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
    if stuck:
        names = ", ".join(sorted(task.get_name() for task in stuck))
        log.error(
            "the agent's loops %s did not stop within %.0f s of their cancellation; going on",
            names,
            timeout_s,
        )
    return stuck


@dataclass
class AgentConfig:
    root_urls: list[str]
    job_id: str
    token: str
    command: list[str]
    instance_id: str = field(default_factory=socket.gethostname)
    # None: the local address this host uses to reach the root (worker_lib.agent.address)
    address: str | None = None
    bind: str = "0.0.0.0"
    data_port: int = 0
    machine_rank: int | None = None
    procs_per_machine: int | None = None
    shm_root: Path | None = None
    stop_grace_s: float = 5.0
    # Once stopped, the process exits this long later even if a thread never returns (stacks.exit_after):
    # set by `castor agent`, whose process is the agent's alone; None in processes that host an agent.
    exit_deadline_s: float | None = None
    keep_shm: bool = False  # keep the checkpoints in shared memory after the job completed or was stopped
    warm_start: bool = True  # keep warm interpreters (torch imported) ready for (re)starts
    extra_env: dict[str, str] = field(default_factory=dict)
    # A training process that commits no checkpoint for this long is stopped (watchdog.py): auto by default.
    hang: HangPolicy = field(default_factory=HangPolicy)
    # Replication's threads run this many steps below the agent's CPU priority (priority.py); 0: the same.
    replication_nice: int = REPLICATION_NICE

    def resolved_shm_root(self) -> Path:
        return self.shm_root or Path("/dev/shm/castor") / self.job_id / self.instance_id


def free_shared_memory(holdings: Holdings, job_id: str) -> None:
    """Remove the machine's shared-memory directory, and the job's directory above it once it is empty
    (the last of the job's machines on this host removes it): named after the job, as the default
    /dev/shm/castor/<job>/<instance> and the local operator's <base>/<job hex>/<instance> are. A directory
    the user chose (--shm-dir) is left alone above the machine's own."""
    holdings.remove()
    parent = holdings.root.parent
    names = {job_id}
    with contextlib.suppress(ValueError):
        names.add(uuid.UUID(job_id).hex)
    if parent.name in names:
        with contextlib.suppress(OSError):  # not empty: another machine of the job still uses it
            parent.rmdir()


def exit_status(codes: list[int]) -> int:
    """One exit code for the machine: 0 when every process succeeded, else the first failure's code
    (a signal as 128 + its number, like a shell)."""
    failed = next((code for code in codes if code != 0), 0)
    return 128 - failed if failed < 0 else failed


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        identity = MachineIdentity(
            instance_id=config.instance_id,
            address=config.address or default_address(config.root_urls),
            bind=config.bind,
            data_port=config.data_port,
            machine_rank=config.machine_rank,
            replication_nice=config.replication_nice,
        )
        self.client = RootClient(config.root_urls, config.job_id, config.token, spread_key=config.instance_id)
        self.machine = MachineServices(self.client, config.token, identity, config.resolved_shm_root())
        self.exits: asyncio.Queue[ProcessExit] = asyncio.Queue()
        self.workers = WorkerGroup(
            self.exits, warm=config.warm_start, pid_dir=self.machine.holdings.root / "pids"
        )
        # The agent's state machine (states.py): its state, plan generation, the last generation it
        # collected for, the ranks yet to commit after a restore. Only _decide and _finish change it.
        self.status = AgentStatus()
        self._facts: asyncio.Queue[Fact] = asyncio.Queue()  # what the monitors saw, for _invoke_run
        self.machine.on_commit = self._on_commit
        self.machine.extra_summary = lambda: {"warm_spares": self.workers.warm_spares}
        self.job_over = False  # completed or stopped: nothing will ever restore from this memory again
        self.done: asyncio.Future[int] | None = None
        self._background: set[asyncio.Task[None]] = set()
        # The running generation's commits, for the hang watchdog; None while no training runs here.
        self._hang_watch: HangWatch | None = None
        # The revision of the directive being acted on, and the inventory report in flight, which is also
        # the next directive long poll (_report_inventory): the watcher takes its answer instead of polling.
        self._directive_revision = -1
        self._inventory_answer: asyncio.Task[DirectiveOut | None] | None = None
        # Set to stop the background check of the copies held here (_check_holdings).
        self._checks_stop: threading.Event | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        try:
            # Training processes a previous agent of this machine left running (it was killed, and they
            # missed their parent-death signal) would train on beside the ones this agent starts.
            machine_dir = self.machine.holdings.root
            await asyncio.to_thread(kill_stale, machine_dir / "pids", machine_dir)
            await self.machine.start()
            expected = self.config.procs_per_machine
            if expected is not None and expected != self.machine.procs:
                raise SystemExit(
                    f"--nproc-per-node {expected} does not match the job's {self.machine.procs} processes "
                    "per machine"
                )
            await self.workers.prewarm(self.machine.procs)
            self._decide(Registered(frozenset(self.machine.local_ranks())))
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self._on_signal, signum)
            tasks = [
                asyncio.create_task(self._invoke_run(), name="decisions"),
                asyncio.create_task(self._heartbeats(), name="heartbeats"),
                asyncio.create_task(self._watch_directives(), name="directives"),
                asyncio.create_task(self._watch_exits(), name="exits"),
                asyncio.create_task(self._watch_hangs(), name="hangs"),
            ]
            try:
                watched: set[asyncio.Future[Any]] = {self.done, *tasks}
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if not self.done.done():
                    # One of the agent's loops ended on a bug: heartbeats alone would keep a machine that
                    # does nothing looking healthy, so the agent stops and the root sees it go.
                    crashed = next(task for task in tasks if task.done())
                    error = None if crashed.cancelled() else crashed.exception()
                    log.error("the agent's %s loop failed; stopping", crashed.get_name(), exc_info=error)
                    return 1
                return self.done.result()
            finally:
                if self.config.exit_deadline_s is not None:
                    # done holds the exit code once decided (only _finish sets it); otherwise a loop failed.
                    code = self.done.result() if self.done.done() else 1
                    stacks.exit_after(self.config.exit_deadline_s, code, "the agent")
                self._stop_checks()
                stopping: list[asyncio.Task[Any]] = [*tasks]
                if self._inventory_answer is not None:
                    stopping.append(self._inventory_answer)  # a report still waiting for its answer
                await cancel_and_wait(stopping, STOPPING_LOOPS_S)
                await self.workers.stop(self.config.stop_grace_s)
                await self.workers.discard_spares()
        finally:
            await self.machine.close()
            if self.job_over and not self.config.keep_shm:
                # Give the memory back (a failed job's stays, to salvage).
                free_shared_memory(self.machine.holdings, self.config.job_id)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    def _stop_if_replaced(self, exc: Exception) -> None:
        """The root gave this machine's rank to another instance (it was declared failed while unreachable):
        stop, rather than train on as a second copy of the rank."""
        if isinstance(exc, RootRejected) and exc.code in REPLACED_CODES:
            log.error("this machine was replaced (%s); stopping", exc)
            self._finish(1)

    def _finish(self, code: int) -> None:
        """The agent stops (STOPPED) with this exit code: run() returns it."""
        if self.status.state is not AgentState.STOPPED:
            self._enter(replace(self.status, state=check_transition(self.status.state, AgentState.STOPPED)))
        if self.done is not None and not self.done.done():
            self.done.set_result(code)

    # -- the loop: monitor -> decide -> act ---------------------------------------------------------------

    async def _invoke_run(self) -> None:
        """Decide on each fact the monitors saw, in order, and perform the actions. An action's outcome (a
        restore's, a start's) is decided on at once, before any other fact, as one step of the plan."""
        while True:
            fact: Fact | None = await self._facts.get()
            try:
                while fact is not None:
                    actions, fact = self._decide(fact), None
                    for action in actions:
                        if (fact := await self._act(action)) is not None:
                            break
            finally:
                self._facts.task_done()

    def _decide(self, fact: Fact) -> tuple[Action, ...]:
        decision = decide(self.status, fact)
        self._enter(decision.status)
        return decision.actions

    def _enter(self, status: AgentStatus) -> None:
        if status.state is not self.status.state:
            log.info("agent: %s -> %s", self.status.state.name, status.state.name)
        self.status = status

    def _decide_now(self, fact: Fact) -> None:
        """Decide on a fact that cannot wait for the loop's current action (a signal, this machine replaced,
        the job deleted): its actions are immediate ones."""
        for action in self._decide(fact):
            self._act_now(action)

    def _act_now(self, action: Action) -> bool:
        """Perform an action that takes no waiting; False: it is not one."""
        match action:
            case Exit(code=code, reason=reason, job_over=job_over):
                if code != 0 and not job_over:
                    log.error("%s; stopping", reason)
                self.job_over = self.job_over or job_over
                self._finish(code)
            case ForwardSignal(signum=signum):
                log.info("received %s: stopping training", signal.Signals(signum).name)
                self.workers.signal(signum)
            case ExitAfterWorkers():
                self._in_background(self._exit_after_workers())
            case UpdateAddresses(machines=machines):
                self.machine.update_addresses(machines)
            case PauseReplication():
                if self.machine.replicator is not None:
                    self.machine.replicator.pause()
            case ResumeReplication(iteration=iteration, directive=directive):
                if self.machine.replicator is not None:
                    plan = directive if isinstance(directive, DirectiveOut) else None
                    self.machine.replicator.resume(
                        restored=iteration,
                        digests={source.rank: source.digest for source in plan.sources} if plan else {},
                        generation=plan.generation if plan else None,
                    )
            case ReportExit(exit=ended, global_rank=rank, exit_code=code):
                log.log(
                    logging.INFO if code == 0 else logging.WARNING,
                    "training process rank %d exited with %d",
                    rank,
                    code,
                )
                self._in_background(self._report_exit(ended))
            case ReportFinished(generation=generation):
                self._in_background(self._report_finished(generation))
            case ReportProgress(generation=generation, event=event, details=details, background=True):
                self._in_background(self._progress(generation, event, details))
            case Prewarm():
                self._in_background(self.workers.prewarm(self.machine.procs))
            case StopHung(rank=rank, reason=reason):
                log.error("%s; collecting its stacks, then killing it", reason)
                self._in_background(self._stop_hung(rank, reason))
            case _:
                return False
        return True

    async def _act(self, action: Action) -> Fact | None:
        """Perform an action; a restore or a start returns its outcome, for the next decision."""
        if self._act_now(action):
            return None
        match action:
            case StopWorkers():
                self._hang_watch = None
                await self.workers.stop(self.config.stop_grace_s)
            case ReportInventory(generation=generation):
                await self._report_inventory(generation)
            case ReportProgress(generation=generation, event=event, details=details):
                await self._progress(generation, event, details)
            case Restore(generation=generation, iteration=iteration, directive=directive):
                self._stop_checks()  # the restore verifies what it reads; leave it the memory bandwidth
                if iteration is not None and self.machine.server is not None:
                    # From now on, not once restored: a faster peer's restored iteration may come first.
                    self.machine.server.learn_rollback((generation, iteration))
                try:
                    restored = await self._restore(directive)
                except Exception as exc:
                    log.error("restoring generation %d failed: %s", generation, exc)
                    unusable = exc.unusable_persisted if isinstance(exc, RestoreFailure) else []
                    return RestoreFailed(
                        generation, str(exc), {"unusable_persisted": unusable} if unusable else {}
                    )
                return RestoreDone(generation, iteration, restored, directive)
            case StartWorkers(generation=generation, directive=directive, restored=restored):
                self._hang_watch = HangWatch(self.config.hang, generation)
                try:
                    await self.workers.start(self._launch_spec(directive))
                except Exception as exc:  # e.g. the training command does not exist
                    log.error("starting the training processes of generation %d failed: %s", generation, exc)
                    return StartFailed(generation, str(exc))
                return StartDone(generation, restored)
            case _:
                raise TypeError(f"not an action: {action!r}")
        return None

    # -- monitors ------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int) -> None:
        """Forward SIGINT/SIGTERM to the training processes; the agent exits with their exit status."""
        self._decide_now(Signalled(signum))

    async def _exit_after_workers(self) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation.
        try:
            async with asyncio.timeout(self.config.stop_grace_s):
                codes = await self.workers.wait()
        except TimeoutError:
            self.workers.signal(signal.SIGKILL)
            try:  # bounded too: a start that hangs launching a process must not keep the agent alive
                async with asyncio.timeout(self.config.stop_grace_s):
                    codes = await self.workers.wait()
            except TimeoutError:
                log.error("training processes did not end after SIGKILL; exiting without them")
                codes = [128 + signal.SIGKILL]
        self._finish(exit_status(codes) if codes else 128 + signal.SIGTERM)

    async def _heartbeats(self) -> None:
        try:
            await self.machine.heartbeats()
        except Replaced as exc:
            self._decide_now(HeartbeatReplaced(str(exc)))

    async def _watch_directives(self) -> None:
        """Each new revision of the root's directive, as a fact; the next is polled for once the loop acted
        on it (a directive that changed meanwhile is seen at its newest). Every answer, an unchanged one
        when the wait the root asked for is up included, refreshes the peers' addresses."""
        revision = -1
        while True:
            try:
                directive = await self._inventory_directive()
                if directive is None:
                    directive = await self.client.directive(
                        after=revision,
                        wait_s=self.machine.registered.directive_wait_s,
                        machine=self.machine.machine_rank,
                    )
            except RootUnavailable as exc:
                log.warning("no directive from the root (%s); training continues", exc)
                continue
            except UnexpectedAnswer as exc:  # not the root's API (a proxy's page): asked again, not fatal
                log.warning("the directive poll got something else than the root's API (%s); retrying", exc)
                await asyncio.sleep(UNEXPECTED_ANSWER_RETRY_S)
                continue
            except RootRejected as exc:
                if exc.code == "job_not_found":
                    self._decide_now(JobDeleted())
                    return
                raise
            # The peers' addresses, and the iteration every rank persists next (the root bumps the revision
            # to announce a new one).
            self.machine.directive_answered(directive)
            if directive.revision <= revision:
                continue
            revision = directive.revision
            holder = next((m for m in directive.machines if m.rank == self.machine.machine_rank), None)
            replaced_by = None
            if holder is not None and holder.instance_id not in (None, self.config.instance_id):
                replaced_by = f"{holder.instance_id} (machine {self.machine.machine_rank})"
            fact = DirectiveSeen(
                status=directive.status,
                generation=directive.generation,
                iteration=directive.iteration,
                job_state=directive.job_state,
                replaced_by=replaced_by,
                machines=directive.machines,
                directive=directive,
            )
            if replaced_by is not None:
                self._decide_now(fact)
                return
            self._directive_revision = revision
            self._facts.put_nowait(fact)
            await self._facts.join()

    async def _inventory_directive(self) -> DirectiveOut | None:
        """The answer to the inventory report that the decisions on the last directive sent, if they sent
        one (it doubles as the next long poll); None: no report, or no answer to it (poll instead)."""
        report, self._inventory_answer = self._inventory_answer, None
        return None if report is None else await report

    # -- the actions' work ---------------------------------------------------------------------------------

    async def _report_inventory(self, generation: int) -> None:
        # Reported at once, no byte read (a machine may hold hundreds of GB: hashing it all would put
        # minutes on every recovery's critical path); the copies are checked in the background meanwhile,
        # and whichever copy the plan chooses is verified stripe by stripe as it is restored.
        holdings = await asyncio.to_thread(self.machine.holdings.inventory)
        body = {
            "instance_id": self.config.instance_id,
            "generation": generation,
            "holdings": [h.to_json() for h in holdings],
            "rendezvous_port": free_port(),  # the old store's port may linger in TIME_WAIT
        }
        body = self._with_uploads(body)
        # The report is also this machine's next directive long poll, sent without waiting for its answer
        # (the directive watcher takes it): in a recovery every agent reports at once, and one request each
        # instead of two is a thousand fewer for the root at 1,000 machines while the plan waits for the
        # last report.
        self._inventory_answer = asyncio.create_task(self._send_inventory(generation, body))
        self._stop_checks()
        self._checks_stop = threading.Event()
        self._in_background(self._check_holdings(generation, body, self._checks_stop))

    def _with_uploads(self, body: dict[str, Any]) -> dict[str, Any]:
        """The inventory `body` naming the uploads in flight now. Only when there are some: without them the
        report is one an older root accepts too."""
        body = {key: value for key, value in body.items() if key != "uploading"}
        if uploading := self.machine.uploads.in_flight():
            body["uploading"] = uploading
        return body

    async def _check_holdings(self, generation: int, body: dict[str, Any], stop: threading.Event) -> None:
        """Verify the copies the report could not vouch for, newest first, until the plan arrives (Restore
        sets `stop`: then the restore is the check). Copies found corrupt are condemned where they lie and
        the inventory reported again, so a plan not yet made passes them over (one already made sees
        them fail their restore, and the next plan passes them over)."""
        holdings = self.machine.holdings
        if os.environ.get(NO_BACKGROUND_CHECK_ENV) == "1":
            return
        try:
            corrupt = await asyncio.to_thread(holdings.check_unverified, stop)
        except Exception as exc:  # e.g. the agent closed its holdings while stopping: the restore checks
            log.warning("the background check of the checkpoints held here stopped: %r", exc)
            return
        if not corrupt or stop.is_set():
            return
        for found in corrupt:
            log.warning(
                "rank %d's checkpoint of iteration %d (%s) is corrupt: %s",
                found.rank,
                found.iteration,
                found.tier,
                found.problem,
            )
        again = {**body, "holdings": [h.to_json() for h in await asyncio.to_thread(holdings.inventory)]}
        again = self._with_uploads(again)
        try:
            await self._report(again)
        except RootError as exc:
            log.error("could not report the inventory of generation %d again: %s", generation, exc)

    def _stop_checks(self) -> None:
        if self._checks_stop is not None:
            self._checks_stop.set()

    async def _send_inventory(self, generation: int, body: dict[str, Any]) -> DirectiveOut | None:
        try:
            return await self._report(
                body, after=self._directive_revision, wait_s=self.machine.registered.directive_wait_s
            )
        except RootError as exc:
            log.error("could not report the inventory of generation %d: %s", generation, exc)
            self._stop_if_replaced(exc)
            return None

    async def _report(self, body: dict[str, Any], **poll: Any) -> DirectiveOut | None:
        """Send the inventory `body` (`poll`: as the next directive long poll). A root older than the uploads
        in flight refuses a report naming them (422): it gets the report without them (its plan then does not
        wait for them), where otherwise this machine would be declared lost for not reporting."""
        try:
            return await self.client.report_inventory(self.machine.machine_rank, body, **poll)
        except RootRejected as exc:
            if exc.status != 422 or "uploading" not in body or "uploading" not in exc.message:
                raise
            log.warning("the root refused the uploads in flight in the inventory; reporting without them")
            without = {key: value for key, value in body.items() if key != "uploading"}
            return await self.client.report_inventory(self.machine.machine_rank, without, **poll)

    async def _restore(self, directive: DirectiveOut) -> dict[str, Any]:
        """Make the plan's iteration present in each local rank's store: it is there (local), or comes from
        a peer's memory, or from the persistent tier; verified on arrival either way."""
        iteration = directive.iteration
        if iteration is None:
            return {"from_scratch": True}
        sources = {source.rank: source for source in directive.sources}
        unusable: list[dict[str, Any]] = []

        async def restore_rank(rank: int) -> tuple[str, dict[str, Any]]:
            source, started = sources[rank], time.monotonic()
            holdings = self.machine.holdings
            if source.tier == "local":
                # The plan's digest too: the same iteration number of another history is not this one.
                if (problem := holdings.local_copy_problem(rank, iteration, source.digest)) is not None:
                    raise CheckpointNotFoundError(problem)
            elif source.tier == "peer":
                await asyncio.to_thread(self._fetch_from_peer, rank, iteration, source)
            else:
                if source.location is None:
                    raise CheckpointNotFoundError(f"the plan names no object for rank {rank}")
                store = object_store(self.machine.registered.persistent.model_dump())
                destination = holdings.local_store(rank)
                try:
                    try:
                        await store.get(source.location, destination, iteration, source.digest)
                    except CheckpointCorruptError as exc:
                        # The root condemns a shard reported unusable for good, and retention may then
                        # delete its checkpoint: not on one read, which a fault of this machine's own
                        # (memory, a damaged transfer) can fail. A shard corrupt at rest fails again.
                        log.warning("rank %d: %s; reading the persisted shard once more", rank, exc)
                        await store.get(source.location, destination, iteration, source.digest)
                except CheckpointCorruptError as exc:
                    # Only bytes the tier served and that failed their checks: a shard this machine
                    # cannot find may be there for the others (a directory not mounted here, another
                    # endpoint), and condemning it could send the job back to scratch.
                    problem = str(exc)[:400]
                    unusable.append(
                        {"rank": rank, "iteration": iteration, "digest": source.digest, "problem": problem}
                    )
                    raise
            seconds = time.monotonic() - started
            log.info("rank %d: iteration %d ready (%s, %.2fs)", rank, iteration, source.tier, seconds)
            details = {"tier": source.tier, "seconds": round(seconds, 3), "source": source.source_rank}
            return str(rank), details

        try:
            return dict(await all_settled(restore_rank(r) for r in self.machine.local_ranks()))
        except Exception as exc:
            if unusable:
                raise RestoreFailure(str(exc), unusable) from exc
            raise

    def _fetch_from_peer(self, rank: int, iteration: int, source: PlanSource) -> None:
        if source.address is None or source.data_port is None:
            raise CheckpointNotFoundError(f"the plan names no data plane to fetch rank {rank} from")
        # Tried again on a new connection when the transport failed (a handshake the peer dropped: slow).
        fetch(
            source.address,
            source.data_port,
            self.machine.key,
            self.config.job_id,
            rank,
            self.machine.holdings.local_store(rank),
            iteration,
            digest=source.digest,
            max_bytes=self.machine.capacity,
        )

    def _on_commit(self, rank: int, iteration: int) -> None:
        """A local rank committed a checkpoint (the machine services' notify socket)."""
        if self._hang_watch is not None:
            self._hang_watch.committed(rank, iteration, time.monotonic())
        self._facts.put_nowait(Committed(rank, iteration))

    async def _watch_hangs(self) -> None:
        """The hang watchdog: each local rank silent past its limit, as a fact (once per stall)."""
        while True:
            watch = self._hang_watch
            await asyncio.sleep(1.0 if watch is None else watch.next_check_in(time.monotonic()))
            if watch is not None and watch is self._hang_watch:
                for overdue in watch.overdue(time.monotonic()):
                    self._facts.put_nowait(Hung(watch.generation, overdue.rank, overdue.describe()))

    async def _stop_hung(self, rank: int, reason: str) -> None:
        if not await self.workers.stop_hung(rank, reason):
            log.info("rank %d ended before the hang watchdog stopped it", rank)

    async def _progress(self, generation: int, event: str, details: dict[str, Any]) -> None:
        try:
            await self.machine.report_progress(generation, event, details)
        except RootError as exc:
            log.error("could not report %s for generation %d: %s", event, generation, exc)
            self._stop_if_replaced(exc)

    def _launch_spec(self, directive: DirectiveOut) -> LaunchSpec:
        rendezvous = directive.rendezvous
        if rendezvous is None or rendezvous.master_port is None:
            raise ValueError(f"the directive of generation {directive.generation} names no rendezvous")
        holdings = self.machine.holdings
        return LaunchSpec(
            command=self.config.command,
            machine_rank=self.machine.machine_rank,
            procs_per_machine=self.machine.procs,
            world_size=directive.world_size,
            master_addr=rendezvous.master_addr,
            master_port=rendezvous.master_port,
            generation=directive.generation,
            restore_iteration=directive.iteration,
            shm_dir_of={rank: str(holdings.directory("local", rank)) for rank in self.machine.local_ranks()},
            notify_socket=str(self.machine.notify_socket),
            job_id=self.config.job_id,
            extra_env=self.config.extra_env,
        )

    async def _watch_exits(self) -> None:
        while True:
            ended = await self.exits.get()
            self._facts.put_nowait(
                ProcessExited(
                    generation=ended.generation,
                    global_rank=ended.global_rank,
                    exit_code=ended.exit_code,
                    expected=ended.expected,
                    running=self.status.generation,  # as the exit was seen, not once the loop gets to it
                    exit=ended,
                )
            )

    async def _report_exit(self, ended: ProcessExit) -> None:
        try:
            await self.client.report_exit(
                self.machine.machine_rank,
                self.config.instance_id,
                local_rank=ended.local_rank,
                global_rank=ended.global_rank,
                exit_code=ended.exit_code,
                error=ended.error,
                generation=ended.generation,
            )
        except RootError as exc:
            log.error("could not report the exit of rank %d: %s", ended.global_rank, exc)
            self._stop_if_replaced(exc)

    async def _report_finished(self, generation: int) -> None:
        # Peers must hold the last checkpoints before the job may complete (and the agents exit).
        replicator = self.machine.replicator
        if replicator is not None and not await asyncio.to_thread(
            replicator.flush, self.machine.local_ranks()
        ):
            log.warning("the last checkpoints did not reach every peer in time")
        try:
            await self.machine.report_progress(generation, "finished")
        except RootError as exc:
            log.error("could not report that training finished: %s; exiting", exc)
            self._finish(0)
