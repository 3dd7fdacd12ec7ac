"""Failure detection the agents cannot do themselves, three detectors the leader runs:

- heartbeats (`Detectors.suspicion`, every tick): machines whose heartbeats lapsed (REST) become suspect,
  suspects are declared lost on a second signal or after CASTOR_SUSPECT_GRACE_S, and suspect or failed
  machines whose heartbeats resumed are reinstated (domain.suspicion decides; `judge` applies it to a job);
- etcd leases (`Detectors.watch_leases`): an agent's key disappears when its lease expires, and a sweep
  finds the keys that expired while nobody watched: those machines become suspect, then are judged;
- cloud health (`Detectors.cloud_health`, AWS): instances the Auto Scaling Group no longer has, or reports
  unhealthy, are lost machines (an authoritative signal: no suspicion first).

A lost machine opens (or joins) a recovery through flows.failures.machine_lost; the recovery driver
(recovery_driver) takes it from there. Each job is judged on its own (per_job).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from services.root.clients import CloudOperator
from services.root.clients.etcd import CoordinatorUnavailable, EtcdCoordinator, MachineKey
from services.root.db import repository as repo
from services.root.db.models import FailureEvent, Job, JobState, Machine, MachineState, utcnow
from services.root.domain import replacement, suspicion
from services.root.flows.failures import (
    is_peer_symptom,
    joinable_failures,
    latest_silent_losses,
    machine_lost,
    reinstate,
    replacement_committed,
)
from services.root.flows.machines import record_summaries
from services.root.orchestration.leadership import Deposed, Leadership
from services.root.orchestration.per_job import PerJob
from services.root.settings import Settings
from services.root.tasks import stopped

log = logging.getLogger(__name__)

TICK_S = 0.2
CLOUD_CHECK_S = 10.0
SUMMARY_WRITE_S = 2.0  # etcd mode: how often a heartbeat's summary is copied into the database
# etcd mode: after a pass that wrote summaries, the lease events wait this long for the next pass. Agents'
# summary puts come all the time at scale (100 a second at 1,000 machines, spread over their period), and a
# pass for each few of them was a transaction per few machines: half a core of the root's at 1,000
# machines, three times what the same puts cost in batches. An expiry noted meanwhile waits as long.
LEASE_EVENTS_BATCH_S = 0.1
SWEEP_S = 5.0  # etcd mode: how often the leader compares the machines with the live keys
ACTIVE = (JobState.RUNNING, JobState.RECOVERING)


class Detectors:
    def __init__(
        self,
        leadership: Leadership,
        per_job: PerJob,
        settings: Settings,
        operator: CloudOperator,
        coordinator: EtcdCoordinator | None,
    ):
        self.leadership = leadership
        self.per_job = per_job
        self.settings = settings
        self.operator = operator
        self.coordinator = coordinator
        self.reinstated = 0  # machines reinstated (suspect or failed, and their heartbeats resumed)
        # Jobs whose machines are silent en masse (suspicion.mass_silence): the grace declares none lost;
        # and when that ended, for jobs where it ended less than a grace ago (the grace restarts then).
        self.mass_silent_jobs: set[uuid.UUID] = set()
        self._mass_silence_ended: dict[uuid.UUID, datetime] = {}
        self._summaries_written: dict[tuple[str, int], float] = {}
        self._silent_keys: set[MachineKey] = set()  # etcd keys whose lease expired, until they come back
        self._lease_events = LeaseEvents()

    async def _lost(self, machine_filter: Any, cause: str) -> None:
        """Declare lost every live machine of an active job that `machine_filter(machine)` selects (an
        authoritative signal: the cloud says the instance is gone)."""
        async with self.leadership.session() as session:
            job_ids = await repo.active_job_ids(session)

        async def one_job(job_id: uuid.UUID) -> None:
            async with self.leadership.session() as session:
                job = await repo.get_job(session, job_id, for_update=True)
                if job is None:
                    return
                for machine in await repo.live_machines(session, job_id):
                    if machine.state in _ALIVE and machine_filter(machine):
                        log.warning(
                            "job %s: machine %d (%s) %s", job.name, machine.rank, machine.instance_id, cause
                        )
                        await machine_lost(session, job, machine, cause)

        await self.per_job.each(job_ids, one_job)

    async def suspicion(self) -> None:
        """Every tick: machines whose heartbeats lapsed become suspect (REST; etcd: on lease expiry),
        suspects are declared lost on a second signal or after the grace, and suspect or failed machines
        whose heartbeats resumed are reinstated."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                job_ids = await self._jobs_to_judge()
                await self.per_job.each(job_ids, self.judge)
            except Deposed:
                return
            except Exception:
                log.exception("suspicion pass failed; retrying")

    async def _jobs_to_judge(self) -> list[uuid.UUID]:
        """Active jobs with a machine to look at, in one query: a suspect, a failed machine (reinstated if
        it heartbeats), or (REST) a machine silent past the timeout."""
        query = (
            select(Machine.job_id)
            .join(Job, Job.id == Machine.job_id)
            .where(Job.state.in_(ACTIVE), repo.needs_judging(self._lapsed_before(utcnow())))
            .distinct()
        )
        async with self.leadership.session() as session:
            return list((await session.execute(query)).scalars().all())

    def _lapsed_before(self, now: datetime) -> datetime | None:
        """REST heartbeats: a healthy machine last heard from before this instant has lapsed. None under
        etcd (a lease's expiry says so instead) and during a new leader's first timeout in office, which
        gives agents one timeout to reach it before it suspects anyone."""
        in_office = time.monotonic() - self.leadership.leader_since
        if self.coordinator is not None or in_office < self.settings.heartbeat_timeout_s:
            return None
        return now - timedelta(seconds=self.settings.heartbeat_timeout_s)

    async def judge(self, job_id: uuid.UUID) -> None:
        """Suspicion for one job's machines (see suspicion), in one transaction with the job row locked."""
        async with self.leadership.session() as session:
            job = await repo.get_job(session, job_id, for_update=True)
            if job is None or job.state not in ACTIVE:
                return
            now = utcnow()
            lapsed_before = self._lapsed_before(now)
            watch_lapses = lapsed_before is not None
            # The longest silent first: a dead machine takes its peers' exits as its symptoms before a
            # merely slow one (suspect at the same time) could take them for its own second signal.
            machines = sorted(
                await repo.machines_to_judge(session, job_id, lapsed_before),
                key=lambda m: m.last_heartbeat_at or m.registered_at,
            )
            en_masse = self._note_mass_silence(job, machines, now, watch_lapses)
            events = list(await repo.open_failures(session, job_id))
            silent_losses = latest_silent_losses(events)
            exits: list[Any] | None = None  # read when a suspect needs them, again after each loss
            for machine in machines:
                seen = _seen(machine)
                if watch_lapses and suspicion.lapsed(seen, now, self.settings.heartbeat_timeout_s):
                    self._suspect(
                        job, machine, now, f"no heartbeat for {self.settings.heartbeat_timeout_s:g}s"
                    )
                    seen = _seen(machine)
                if suspicion.resumed(seen):
                    self._reinstate(job, machine, "its heartbeats resumed while it was suspect")
                    continue
                if machine.state == MachineState.FAILED:
                    failure = silent_losses.get(machine.id)
                    if failure is not None and suspicion.reinstatable(
                        machine.state,
                        machine.last_heartbeat_at,
                        failure.classified_at,
                        failure.replaced_at is not None or replacement_committed(failure),
                    ):
                        self._reinstate(
                            job, machine, "its heartbeats resumed before a replacement registered", failure
                        )
                    continue
                if machine.state != MachineState.SUSPECT:
                    continue
                # Exits not yet explained: those a machine lost before folded into its failure are gone.
                if exits is None:
                    exits = [
                        (e.machine_id, e.detected_at)
                        for e in await joinable_failures(session, job)
                        if is_peer_symptom(e)
                    ]
                why = suspicion.verdict(
                    seen,
                    now,
                    self.settings.suspect_grace_s,
                    peer_failures=[at for machine_id, at in exits if machine_id != machine.id],
                    operator_says_gone=self._operator_says_gone(machine.instance_id),
                    en_masse=en_masse,
                    believed_since=self._mass_silence_ended.get(job.id),
                )
                if why is not None:
                    log.warning(
                        "job %s: machine %d (%s) %s", job.name, machine.rank, machine.instance_id, why
                    )
                    exits = None  # its loss folds the exits it explains: the next suspect reads them anew
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

    def _note_mass_silence(
        self, job: Job, machines: list[Machine], now: datetime, watch_lapses: bool
    ) -> bool:
        """Whether the job's machines are silent en masse: suspect, those the heartbeat timeout makes
        suspect in this pass, and those declared lost and not replaced yet (one of many declared lost on a
        second signal is still one of the many silent). Logs when that starts and ends."""
        timeout_s = self.settings.heartbeat_timeout_s
        silent = sum(
            m.state in (MachineState.SUSPECT, MachineState.FAILED)
            or (watch_lapses and suspicion.lapsed(_seen(m), now, timeout_s))
            for m in machines
        )
        en_masse = suspicion.mass_silence(silent, job.num_machines, self.settings.mass_silence_fraction)
        if en_masse and job.id not in self.mass_silent_jobs:
            self.mass_silent_jobs.add(job.id)
            log.warning(
                "job %s: %d of %d machines are silent at once: more likely the root's host, etcd or the "
                "network to them than the machines; none is declared lost on silence alone until fewer "
                "than %g%% are",
                job.name,
                silent,
                job.num_machines,
                100 * self.settings.mass_silence_fraction,
            )
        elif not en_masse and job.id in self.mass_silent_jobs:
            self.mass_silent_jobs.discard(job.id)
            self._mass_silence_ended[job.id] = now
            log.warning(
                "job %s: %d of %d machines silent: the grace applies again, counted from now",
                job.name,
                silent,
                job.num_machines,
            )
        ended = self._mass_silence_ended.get(job.id)
        if ended is not None and (now - ended).total_seconds() > self.settings.suspect_grace_s:
            del self._mass_silence_ended[job.id]  # every suspicion's grace now counts as usual
        return en_masse

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

    def _reinstate(self, job: Job, machine: Machine, why: str, loss: FailureEvent | None = None) -> None:
        # The loss comes from the open failures the pass read once: reading them again per machine made a
        # pass that reinstated hundreds of machines (a lease storm) quadratic in them.
        was = machine.state
        reinstate(machine, why, loss)
        self.reinstated += 1
        log.warning(
            "job %s: machine %d (%s) reinstated (was %s): %s%s",
            job.name,
            machine.rank,
            machine.instance_id,
            was,
            why,
            f"; failure {loss.id}'s replacement cancelled" if loss is not None else "",
        )

    def _operator_says_gone(self, instance_id: str) -> bool | None:
        """The cloud operator's view of an instance, where it has one without a network call (the local
        operator knows whether the agent process it started is still running)."""
        check = getattr(self.operator, "instance_gone", None)
        return check(instance_id) if check is not None else None

    async def watch_leases(self) -> None:
        """etcd mode: an agent's key disappears when its lease expires (the machine is gone). The watch only
        takes note (LeaseEvents); `_apply_lease_events` writes them, in batches, beside it: a database
        write per event on the watch loop put a burst of expiries seconds behind (each suspicion locks its
        job and judges it), and a machine whose key came back meanwhile was declared lost after the grace
        because its return waited behind them."""
        assert self.coordinator is not None
        apply = asyncio.create_task(self._apply_lease_events(), name="lease-events")
        try:
            while True:
                # The sweep runs beside the watch, not before it: a lease that expires meanwhile is seen by
                # one.
                sweep = asyncio.create_task(self._sweep_missing_keys(), name="sweep")
                try:
                    async for kind, key, summary in self.coordinator.watch_machines():
                        if kind == "delete":
                            self._lease_events.expired(key)
                        else:
                            self._lease_events.put(key, summary)
                except Deposed:
                    return
                except CoordinatorUnavailable as exc:
                    log.error("etcd watch failed (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                except Exception:
                    log.exception("etcd watch broke; restarting it")
                    await asyncio.sleep(0.5)
                finally:
                    await stopped(sweep)
        finally:
            # Awaited, not only cancelled: the root's shutdown closes the etcd client and disposes of the
            # database right after the leader's work returns, and neither may still be in use.
            await stopped(apply)

    async def _apply_lease_events(self) -> None:
        """What the watch noted, expiries first (each job's in one transaction and one judgement), then
        summaries, every key's newest, each job's in one transaction (a returned machine's at once: it may
        be suspect; others at most every SUMMARY_WRITE_S per machine), expiries noted meanwhile before
        each job's. Whatever the watch notes while a pass runs waits for the next pass, which takes it all:
        the more behind, the larger the batches (a transaction per summary fell behind 100 machines at TTL
        1 s on 2 cores, and their signs of life reached the database seconds late). A pass that wrote
        summaries is followed by LEASE_EVENTS_BATCH_S of rest."""
        while True:
            await self._lease_events.noted()
            summaries: dict[MachineKey, dict[str, Any]] = {}
            try:
                await self._apply_expiries()
                summaries = self._lease_events.take_summaries()
                await self._store_summaries(summaries)
            except Deposed:
                return
            except Exception:
                log.exception("applying etcd lease events failed; they are dropped (the sweep catches up)")
            if summaries:
                await asyncio.sleep(LEASE_EVENTS_BATCH_S)

    async def _apply_expiries(self) -> set[MachineKey]:
        """The expiries noted since the last call, applied; their keys."""
        expired = self._lease_events.take_expired()
        if expired:
            self._silent_keys |= expired
            await self._suspect_keys(expired, "its etcd lease expired")
        return expired

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
        async with self.leadership.session() as session:
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
            async with self.leadership.session() as session:
                job = await repo.get_job(session, job_id, for_update=True)
                if job is None or job.state not in ACTIVE:
                    return
                now = utcnow()
                for machine in await repo.live_machines(session, job_id):
                    key = MachineKey(machine.job_id, machine.rank, machine.instance_id)
                    if key in by_job[job_id] and machine.state in _UNSUSPECTED:
                        self._suspect(job, machine, now, why)
            await self.judge(job_id)

        await self.per_job.each(list(by_job), one_job)

    async def _store_summaries(self, summaries: dict[MachineKey, dict[str, Any]]) -> None:
        """The summaries due (a returned machine's, whose lease expired: at once; others at most every
        SUMMARY_WRITE_S per machine), one transaction per job (record_summaries), expiries noted meanwhile
        applied before each job's: a key among them drops its summary (stale: the machine is gone)."""
        now = time.monotonic()
        due: dict[uuid.UUID, dict[MachineKey, dict[str, Any]]] = {}
        for key, summary in summaries.items():
            returned = key in self._silent_keys
            written = self._summaries_written.get((key.instance_id, key.rank))
            if returned or written is None or now - written >= SUMMARY_WRITE_S:
                due.setdefault(key.job_id, {})[key] = summary

        async def one_job(job_id: uuid.UUID) -> None:
            for key in await self._apply_expiries():  # noted meanwhile: they go first
                due.get(key.job_id, {}).pop(key, None)
            batch = due[job_id]
            if not batch:
                return
            async with self.leadership.session() as session:
                await record_summaries(session, job_id, batch)
            for key in batch:  # written: a returned machine's next summary waits its turn again
                self._summaries_written[(key.instance_id, key.rank)] = now
                self._silent_keys.discard(key)

        await self.per_job.each(list(due), one_job)

    async def cloud_health(self) -> None:
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
                if replacement.instance_alive(i.get("LifecycleState"), i.get("HealthStatus"))
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


class LeaseEvents:
    """etcd watch events not yet applied, newest per key: a key that expired and came back before they
    were applied is a put (the machine is alive: nothing to suspect), one put and then expired is an
    expiry (its summary is stale)."""

    def __init__(self) -> None:
        self._expired: set[MachineKey] = set()
        self._summaries: dict[MachineKey, dict[str, Any]] = {}
        self._noted = asyncio.Event()

    def expired(self, key: MachineKey) -> None:
        self._summaries.pop(key, None)
        self._expired.add(key)
        self._noted.set()

    def put(self, key: MachineKey, summary: dict[str, Any]) -> None:
        self._expired.discard(key)
        self._summaries[key] = summary
        self._noted.set()

    async def noted(self) -> None:
        """Waits until an event was noted since the last call."""
        await self._noted.wait()
        self._noted.clear()

    def take_expired(self) -> set[MachineKey]:
        expired, self._expired = self._expired, set()
        return expired

    def take_summaries(self) -> dict[MachineKey, dict[str, Any]]:
        """key -> its newest summary, for the keys put since the last call."""
        summaries, self._summaries = self._summaries, {}
        return summaries
