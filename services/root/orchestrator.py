"""The leader's background work: failure detection the agents cannot do themselves (a machine that stopped
heartbeating, an etcd lease that expired, an instance the cloud reports unhealthy) and driving every open
recovery forward (flows.recovery.advance), executing the cloud actions it decides.

Leadership: with etcd, root replicas campaign for a leader key (clients.etcd); without etcd, on Postgres,
for a session-level advisory lock; on SQLite the single process leads. A new leader raises the fencing epoch
(models.LeaderEpoch) and every orchestrator transaction reads it first (FOR SHARE, so the raise waits for
transactions in flight): a deposed leader's writes are refused, whatever it believes. With etcd a leader
also stops acting when its lease deadline passes by its own clock.

Failure detection suspects before it replaces (domain.suspicion): a machine whose heartbeats lapse (REST
timeout, etcd lease expiry) becomes suspect, and is declared lost on a second signal or after
CASTOR_SUSPECT_GRACE_S; its heartbeats resuming reinstate it. Each job is handled on its own: a job whose
step raises is logged and counted, and the other jobs go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import timedelta
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from services.root.clients import CloudOperator, CloudOperatorError
from services.root.clients.etcd import CoordinatorUnavailable, EtcdCoordinator, MachineKey
from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.models import (
    FailureKind,
    Job,
    JobState,
    LeaderEpoch,
    Machine,
    MachineState,
    utcnow,
)
from services.root.domain import suspicion
from services.root.flows import recovery
from services.root.flows.failures import joinable_failures, machine_lost, reinstate
from services.root.flows.machines import record_summary
from services.root.settings import Settings

log = logging.getLogger(__name__)

TICK_S = 0.2
CLOUD_CHECK_S = 10.0
SUMMARY_WRITE_S = 2.0  # etcd mode: how often a heartbeat's summary is copied into the database
SWEEP_S = 5.0  # etcd mode: how often the leader compares the machines with the live keys
# Postgres without etcd: the advisory lock whose session holds the leadership (per database).
ADVISORY_LOCK_KEY = 0x63617374_6F72  # "castor"
ADVISORY_CHECK_S = 1.0
ACTIVE = (JobState.RUNNING, JobState.RECOVERING)


class Deposed(Exception):
    """This replica is no longer the leader: another raised the epoch, or its lease deadline passed."""


class Orchestrator:
    def __init__(
        self,
        database: Database,
        settings: Settings,
        operator: CloudOperator,
        coordinator: EtcdCoordinator | None,
    ):
        self.database = database
        self.settings = settings
        self.operator = operator
        self.coordinator = coordinator
        self.candidate = f"{socket.gethostname()}:{settings.port}:{os.getpid()}"
        self.is_leader = False
        self.leader_since = 0.0
        self.epoch: int | None = None  # the fencing epoch this replica leads with
        # Orchestration steps that raised (the job's own failure; the others went on), and reinstatements.
        self.step_failures = 0
        self.reinstated = 0
        self._deposed = asyncio.Event()
        self._replacing: set[int] = set()  # failure events whose replacement is under way here
        self._tasks: set[asyncio.Task[Any]] = set()
        self._summaries_written: dict[tuple[str, int], float] = {}
        self._silent_keys: set[MachineKey] = set()  # etcd keys whose lease expired, until they come back

    async def run(self) -> None:
        while True:
            lost, elected = asyncio.Event(), asyncio.Event()
            campaign = asyncio.create_task(self._campaign(elected, lost), name="campaign")
            waiting = asyncio.create_task(elected.wait())
            await asyncio.wait({campaign, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if elected.is_set():
                try:
                    await self._claim_epoch(self.coordinator.epoch if self.coordinator else None)
                except Exception as exc:  # the database is unreachable: nothing can be done as leader
                    log.error("could not raise the leadership epoch (%s); campaigning again", exc)
                    elected.clear()
            if not elected.is_set():
                campaign.cancel()
                await asyncio.gather(campaign, return_exceptions=True)
                await asyncio.sleep(1.0)  # etcd or the database unreachable, or another leads: again
                continue
            self._deposed = lost
            self.is_leader, self.leader_since = True, time.monotonic()
            work = [
                asyncio.create_task(self._drive(), name="drive"),
                asyncio.create_task(self._suspicion(), name="suspicion"),
            ]
            if self.coordinator is not None:
                work.append(asyncio.create_task(self._watch_leases(), name="leases"))
            if self.settings.cloud == "aws":
                work.append(asyncio.create_task(self._cloud_health(), name="cloud"))
            try:
                await lost.wait()
            finally:
                self.is_leader, self.epoch = False, None
                for task in [*work, campaign]:
                    task.cancel()
                await asyncio.gather(*work, campaign, return_exceptions=True)
            log.warning("leadership lost; campaigning again")

    # -- leadership ----------------------------------------------------------------------------------------

    async def _campaign(self, elected: asyncio.Event, lost: asyncio.Event) -> None:
        if self.coordinator is not None:
            await self.coordinator.lead(self.candidate, elected, lost)
        elif not self.database.is_sqlite:
            await self._advisory_lead(elected, lost)
        else:
            elected.set()  # SQLite: one process uses the file; it leads
            await asyncio.Event().wait()

    async def _advisory_lead(self, elected: asyncio.Event, lost: asyncio.Event) -> None:
        """Postgres without etcd: the replica whose session holds the advisory lock leads; every other
        replica (or uvicorn worker) waits for it. The lock goes with its session: a leader whose connection
        breaks loses it at once on the server, and here at its next check (the epoch fences it meanwhile)."""
        connection = await self.database.engine.connect()
        try:
            await connection.execution_options(isolation_level="AUTOCOMMIT")
            query = text("SELECT pg_try_advisory_lock(:key)")
            while True:  # polling: Postgres cannot tell us when the lock frees without blocking the session
                if (await connection.execute(query, {"key": ADVISORY_LOCK_KEY})).scalar():
                    break
                await asyncio.sleep(ADVISORY_CHECK_S)
            log.info("elected leader (%s): holding the database's advisory lock", self.candidate)
            elected.set()
            while True:
                await asyncio.sleep(ADVISORY_CHECK_S)
                await asyncio.wait_for(connection.execute(text("SELECT 1")), 5.0)
        except (OSError, TimeoutError, Exception) as exc:  # whatever broke the session, the lock is gone
            log.error("lost the database session holding the leadership: %s", exc)
        finally:
            lost.set()
            # Closing would return the connection to the pool with the lock still held: drop it instead.
            with contextlib.suppress(Exception):
                await connection.invalidate()
            with contextlib.suppress(Exception):
                await connection.close()

    async def _claim_epoch(self, revision: int | None) -> None:
        """Raise the fencing epoch (to the etcd revision that elected this replica, or one past the last):
        from now on the previous leader's transactions are refused. Waits for those in flight."""
        for _ in range(5):
            try:
                async with self.database.session() as session:
                    query = select(LeaderEpoch).where(LeaderEpoch.id == 1).with_for_update()
                    row = (await session.execute(query)).scalar_one_or_none()
                    if row is None:
                        row = LeaderEpoch(id=1, epoch=0, holder="")
                        session.add(row)
                    epoch = max(row.epoch + 1, revision or 0)
                    row.epoch, row.holder, row.updated_at = epoch, self.candidate, utcnow()
            except IntegrityError:
                continue  # another replica created the row at the same moment
            self.epoch = epoch
            log.info("leading with epoch %d", epoch)
            return
        raise RuntimeError("could not claim the leadership epoch")

    def _depose(self, why: str) -> Deposed:
        if self.is_leader:
            log.error("no longer the leader: %s", why)
        self._deposed.set()
        return Deposed(why)

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[AsyncSession]:
        """An orchestrator transaction: refused unless this replica still holds the newest epoch (and, with
        etcd, its lease by its own clock) when it starts and when it commits."""
        async with self.database.session() as session:
            self._check_clock()
            query = select(LeaderEpoch.epoch).where(LeaderEpoch.id == 1).with_for_update(read=True)
            current = (await session.execute(query)).scalar_one_or_none()
            if self.epoch is None or current != self.epoch:
                raise self._depose(f"the leadership epoch is {current}, this replica's {self.epoch}")
            yield session
            self._check_clock()

    def _check_clock(self) -> None:
        if self.coordinator is not None and not self.coordinator.leading():
            raise self._depose("the leader lease's deadline passed")

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- recoveries ----------------------------------------------------------------------------------------

    async def _drive(self) -> None:
        while True:
            try:
                async with self._session() as session:
                    job_ids = await repo.active_job_ids(session)
                await self._each_job(job_ids, self.step)
            except Deposed:
                return
            except Exception:
                log.exception("orchestration pass failed; retrying")
            await asyncio.sleep(TICK_S)

    async def _each_job(self, job_ids: Any, work: Callable[[uuid.UUID], Coroutine[Any, Any, None]]) -> None:
        """`work` for every job on its own: a job whose step raises is logged and counted, and the jobs
        after it go on (it is tried again at the next pass). Deposed stops them all."""
        for job_id in job_ids:
            try:
                await work(job_id)
            except Deposed:
                raise
            except Exception:
                self.step_failures += 1
                log.exception(
                    "job %s: orchestration step failed (%d so far); the other jobs go on",
                    job_id,
                    self.step_failures,
                )

    async def step(self, job_id: Any) -> None:
        async with self._session() as session:
            job = await repo.get_job(session, job_id, for_update=True)
            if job is None:
                return
            actions = await recovery.advance(session, job, self.settings)
        for action in actions:
            if action.event_id not in self._replacing:
                self._replacing.add(action.event_id)
                self._spawn(self._replace(action))

    async def _replace(self, action: recovery.ReplaceMachine) -> None:
        try:
            async with self._session() as session:
                machines = await repo.all_machines(session, action.job.id)
                bound = {m.instance_id for m in machines}
                failed = next((m for m in machines if m.instance_id == action.machine.instance_id), None)
            if failed is not None and failed.state != MachineState.FAILED:
                log.info("machine %d was reinstated: not replacing it", action.machine.rank)
                self._replacing.discard(action.event_id)
                return
            replacement = await self.operator.replace(action.job, action.machine, bound)
            outcome: dict[str, Any] = {
                "instance_id": replacement.instance_id,
                "detail": replacement.detail,
                "error": None,
            }
            log.info("replacing machine %d: %s", action.machine.rank, replacement.detail)
        except Deposed:
            self._replacing.discard(action.event_id)
            return
        except Exception as exc:  # recorded and retried after a pause, whatever it was
            expected = isinstance(exc, CloudOperatorError | OSError)
            log.error(
                "replacing machine %d failed: %s",
                action.machine.rank,
                exc,
                exc_info=None if expected else exc,
            )
            outcome = {"instance_id": None, "detail": "", "error": str(exc) or type(exc).__name__}
        finally:
            self._replacing.discard(action.event_id)
        with contextlib.suppress(Deposed):  # the new leader reconciles from the event's request
            async with self._session() as session:
                await recovery.record_replacement(session, action.event_id, **outcome)

    # -- failure detection ---------------------------------------------------------------------------------

    async def _lost(self, machine_filter: Any, cause: str) -> None:
        """Declare lost every live machine of an active job that `machine_filter(machine)` selects (an
        authoritative signal: the cloud says the instance is gone)."""
        async with self._session() as session:
            job_ids = await repo.active_job_ids(session)

        async def one_job(job_id: uuid.UUID) -> None:
            async with self._session() as session:
                job = await repo.get_job(session, job_id, for_update=True)
                if job is None:
                    return
                for machine in await repo.live_machines(session, job_id):
                    if machine.state in _ALIVE and machine_filter(machine):
                        log.warning(
                            "job %s: machine %d (%s) %s", job.name, machine.rank, machine.instance_id, cause
                        )
                        await machine_lost(session, job, machine, cause)

        await self._each_job(job_ids, one_job)

    async def _suspicion(self) -> None:
        """Every tick: machines whose heartbeats lapsed become suspect (REST; etcd: on lease expiry),
        suspects are declared lost on a second signal or after the grace, and suspect or failed machines
        whose heartbeats resumed are reinstated."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                job_ids = await self._jobs_to_judge()
                await self._each_job(job_ids, self.judge)
            except Deposed:
                return
            except Exception:
                log.exception("suspicion pass failed; retrying")

    async def _jobs_to_judge(self) -> list[uuid.UUID]:
        """Active jobs with a machine to look at, in one query: a suspect, a failed machine (reinstated if
        it heartbeats), or (REST) a machine silent past the timeout."""
        attention: Any = Machine.state.in_((MachineState.SUSPECT, MachineState.FAILED))
        rest = self.coordinator is None
        # A new leader gives agents one timeout to reach it before it suspects anyone.
        if rest and time.monotonic() - self.leader_since >= self.settings.heartbeat_timeout_s:
            cutoff = utcnow() - timedelta(seconds=self.settings.heartbeat_timeout_s)
            attention = attention | (Machine.state.in_(_ALIVE) & (Machine.last_heartbeat_at < cutoff))
        query = (
            select(Machine.job_id)
            .join(Job, Job.id == Machine.job_id)
            .where(Job.state.in_(ACTIVE), attention)
            .distinct()
        )
        async with self._session() as session:
            return list((await session.execute(query)).scalars().all())

    async def judge(self, job_id: uuid.UUID) -> None:
        """Suspicion for one job's machines (see _suspicion), in one transaction with the job row locked."""
        rest = self.coordinator is None
        watch_lapses = rest and time.monotonic() - self.leader_since >= self.settings.heartbeat_timeout_s
        async with self._session() as session:
            job = await repo.get_job(session, job_id, for_update=True)
            if job is None or job.state not in ACTIVE:
                return
            now = utcnow()
            # The longest silent first: a dead machine takes its peers' exits as its symptoms before a
            # merely slow one (suspect at the same time) could take them for its own second signal.
            machines = sorted(
                await repo.live_machines(session, job_id),
                key=lambda m: m.last_heartbeat_at or m.registered_at,
            )
            events = list(await repo.open_failures(session, job_id))
            for machine in machines:
                seen = _seen(machine)
                if watch_lapses and suspicion.lapsed(seen, now, self.settings.heartbeat_timeout_s):
                    self._suspect(
                        job, machine, now, f"no heartbeat for {self.settings.heartbeat_timeout_s:g}s"
                    )
                    seen = _seen(machine)
                if suspicion.resumed(seen):
                    await self._reinstate(
                        session, job, machine, "its heartbeats resumed while it was suspect"
                    )
                    continue
                if machine.state == MachineState.FAILED:
                    failure = next(
                        (
                            e
                            for e in events
                            if e.machine_id == machine.id
                            and e.kind == FailureKind.HARDWARE
                            and e.details.get("silent")
                        ),
                        None,
                    )
                    if failure is not None and suspicion.reinstatable(
                        machine.state,
                        machine.last_heartbeat_at,
                        failure.classified_at,
                        failure.replaced_at is not None,
                    ):
                        await self._reinstate(
                            session, job, machine, "its heartbeats resumed before a replacement registered"
                        )
                    continue
                if machine.state != MachineState.SUSPECT:
                    continue
                # Exits not yet explained: those a machine lost before folded into its failure are gone.
                exits = [
                    e.detected_at
                    for e in await joinable_failures(session, job)
                    if e.kind == FailureKind.SOFTWARE and e.machine_id != machine.id
                ]
                why = suspicion.verdict(
                    seen,
                    now,
                    self.settings.suspect_grace_s,
                    peer_failures=exits,
                    operator_says_gone=self._operator_says_gone(machine.instance_id),
                )
                if why is not None:
                    log.warning(
                        "job %s: machine %d (%s) %s", job.name, machine.rank, machine.instance_id, why
                    )
                    await machine_lost(
                        session,
                        job,
                        machine,
                        why,
                        details={
                            "suspected_at": seen.suspected_at.isoformat() if seen.suspected_at else None,
                            "silent": True,
                        },
                    )

    def _suspect(self, job: Job, machine: Machine, now: Any, why: str) -> None:
        machine.state, machine.suspected_at = MachineState.SUSPECT, now
        log.warning(
            "job %s: machine %d (%s) is suspect: %s (declared lost on a second signal or after %gs)",
            job.name,
            machine.rank,
            machine.instance_id,
            why,
            self.settings.suspect_grace_s,
        )

    async def _reinstate(self, session: AsyncSession, job: Job, machine: Machine, why: str) -> None:
        was = machine.state
        event = await reinstate(session, job, machine, why)
        self.reinstated += 1
        log.warning(
            "job %s: machine %d (%s) reinstated (was %s): %s%s",
            job.name,
            machine.rank,
            machine.instance_id,
            was,
            why,
            f"; failure {event.id}'s replacement cancelled" if event is not None else "",
        )

    def _operator_says_gone(self, instance_id: str) -> bool | None:
        """The cloud operator's view of an instance, where it has one without a network call (the local
        operator knows whether the agent process it started is still running)."""
        check = getattr(self.operator, "instance_gone", None)
        return check(instance_id) if check is not None else None

    async def _watch_leases(self) -> None:
        """etcd mode: an agent's key disappears when its lease expires (the machine is gone)."""
        assert self.coordinator is not None
        while True:
            # The sweep runs beside the watch, not before it: a lease that expires meanwhile is seen by one.
            sweep = asyncio.create_task(self._sweep_missing_keys(), name="sweep")
            try:
                async for kind, key, summary in self.coordinator.watch_machines():
                    if kind == "delete":
                        self._silent_keys.add(key)
                        await self._suspect_keys({key}, "its etcd lease expired")
                    else:
                        await self._store_summary(key, summary)
            except Deposed:
                return
            except CoordinatorUnavailable as exc:
                log.error("etcd watch failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
            except Exception:
                log.exception("etcd watch broke; restarting it")
                await asyncio.sleep(0.5)
            finally:
                sweep.cancel()

    async def _sweep_missing_keys(self) -> None:
        """Machines whose lease expired while nobody was watching (before this leader, or between two
        watches): soon after the watch starts, then every SWEEP_S (a machine that registered just before
        the first sweep is looked at by the next)."""
        assert self.coordinator is not None
        await asyncio.sleep(self.settings.lease_ttl_s + 1.0)  # let agents that just registered put their key
        while True:
            try:
                await self._sweep_once()
            except Deposed:
                return
            except Exception as exc:  # the watch restarts (with a new sweep) if etcd is the problem
                log.warning("sweep of expired leases failed: %s", exc)
            await asyncio.sleep(max(SWEEP_S, self.settings.lease_ttl_s + 1.0))

    async def _sweep_once(self) -> None:
        assert self.coordinator is not None
        present = set(await self.coordinator.machine_keys())
        grace = utcnow() - timedelta(seconds=self.settings.lease_ttl_s + 2.0)
        async with self._session() as session:
            job_ids = await repo.active_job_ids(session)
            missing = {
                MachineKey(m.job_id, m.rank, m.instance_id)
                for job_id in job_ids
                for m in await repo.live_machines(session, job_id)
                if m.state in _UNSUSPECTED
                and m.registered_at < grace
                and MachineKey(m.job_id, m.rank, m.instance_id) not in present
            }
        self._silent_keys |= missing
        await self._suspect_keys(missing, "has no etcd lease")

    async def _suspect_keys(self, keys: set[MachineKey], why: str) -> None:
        """etcd mode: the machines of these keys are suspect (then judged at once: a peer's failure may
        already be recorded)."""
        by_job: dict[uuid.UUID, set[MachineKey]] = {}
        for key in keys:
            by_job.setdefault(key.job_id, set()).add(key)

        async def one_job(job_id: uuid.UUID) -> None:
            async with self._session() as session:
                job = await repo.get_job(session, job_id, for_update=True)
                if job is None or job.state not in ACTIVE:
                    return
                now = utcnow()
                for machine in await repo.live_machines(session, job_id):
                    key = MachineKey(machine.job_id, machine.rank, machine.instance_id)
                    if key in by_job[job_id] and machine.state in _UNSUSPECTED:
                        self._suspect(job, machine, now, why)
            await self.judge(job_id)

        await self._each_job(list(by_job), one_job)

    async def _store_summary(self, key: MachineKey, summary: dict[str, Any]) -> None:
        now = time.monotonic()
        returned = key in self._silent_keys  # its lease expired and it is back: record that at once
        if (
            not returned
            and now - self._summaries_written.get((key.instance_id, key.rank), 0.0) < SUMMARY_WRITE_S
        ):
            return
        self._summaries_written[(key.instance_id, key.rank)] = now
        self._silent_keys.discard(key)
        async with self._session() as session:
            await record_summary(session, key.job_id, key.instance_id, summary)

    async def _cloud_health(self) -> None:
        """AWS: instances the group no longer has, or reports unhealthy, are failed machines."""
        instances_of = getattr(self.operator, "instances", None)
        if instances_of is None:
            return
        while True:
            await asyncio.sleep(CLOUD_CHECK_S)
            try:
                instances = {i["InstanceId"]: i for i in await instances_of()}
            except Exception as exc:  # whatever the SDK raises, the check goes on at the next tick
                log.warning("could not read the group's health: %s", exc)
                continue
            healthy = {
                iid
                for iid, i in instances.items()
                if i.get("HealthStatus") == "Healthy" and i.get("LifecycleState") in ("InService", "Pending")
            }
            try:
                await self._lost(
                    lambda m, healthy=healthy: (
                        m.instance_id.startswith("i-") and m.instance_id not in healthy
                    ),
                    "is unhealthy or terminated according to the Auto Scaling Group",
                )
            except Deposed:
                return
            except Exception:
                log.exception("cloud health check failed")


_UNSUSPECTED = (MachineState.HEALTHY, MachineState.PENDING)
_ALIVE = (*_UNSUSPECTED, MachineState.SUSPECT)


def _seen(machine: Machine) -> suspicion.Seen:
    return suspicion.Seen(
        machine.state, machine.last_heartbeat_at, machine.registered_at, machine.suspected_at
    )
