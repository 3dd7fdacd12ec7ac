"""The leader's background work: failure detection the agents cannot do themselves (a machine that stopped
heartbeating, an etcd lease that expired, an instance the cloud reports unhealthy) and driving every open
recovery forward (flows.recovery.advance), executing the cloud actions it decides.

With etcd, root replicas campaign for leadership and only the leader runs this; without etcd the single
root is the leader.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Coroutine
from datetime import datetime, timedelta
from typing import Any

from services.root.clients import CloudOperator, CloudOperatorError
from services.root.clients.etcd import CoordinatorUnavailable, EtcdCoordinator, MachineKey
from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.models import Machine, MachineState, utcnow
from services.root.flows import recovery
from services.root.flows.failures import machine_lost
from services.root.flows.machines import record_summary
from services.root.settings import Settings

log = logging.getLogger(__name__)

TICK_S = 0.2
CLOUD_CHECK_S = 10.0
SUMMARY_WRITE_S = 2.0  # etcd mode: how often a heartbeat's summary is copied into the database


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
        self._replacing: set[int] = set()  # failure events whose replacement is under way here
        self._tasks: set[asyncio.Task[Any]] = set()
        self._summaries_written: dict[tuple[str, int], float] = {}

    async def run(self) -> None:
        while True:
            lost = asyncio.Event()
            campaign = None
            if self.coordinator is not None:
                elected = asyncio.Event()
                campaign = asyncio.create_task(self.coordinator.lead(self.candidate, elected, lost))
                waiting = asyncio.create_task(elected.wait())
                await asyncio.wait({campaign, waiting}, return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                if not elected.is_set():
                    await asyncio.sleep(1.0)  # etcd unreachable: campaign again
                    continue
            self.is_leader, self.leader_since = True, time.monotonic()
            work = [asyncio.create_task(self._drive(), name="drive")]
            if self.coordinator is not None:
                work.append(asyncio.create_task(self._watch_leases(), name="leases"))
            else:
                work.append(asyncio.create_task(self._heartbeat_timeouts(), name="heartbeats"))
            if self.settings.cloud == "aws":
                work.append(asyncio.create_task(self._cloud_health(), name="cloud"))
            try:
                await lost.wait()
            finally:
                self.is_leader = False
                for task in [*work, *([campaign] if campaign else [])]:
                    task.cancel()
                await asyncio.gather(*work, return_exceptions=True)
            log.warning("leadership lost; campaigning again")

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- recoveries ----------------------------------------------------------------------------------------

    async def _drive(self) -> None:
        while True:
            try:
                async with self.database.session() as session:
                    job_ids = await repo.active_job_ids(session)
                for job_id in job_ids:
                    await self.step(job_id)
            except Exception:
                log.exception("orchestration step failed; retrying")
            await asyncio.sleep(TICK_S)

    async def step(self, job_id: Any) -> None:
        async with self.database.session() as session:
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
            async with self.database.session() as session:
                bound = {m.instance_id for m in await repo.all_machines(session, action.job.id)}
            replacement = await self.operator.replace(action.job, action.machine, bound)
            outcome: dict[str, Any] = {
                "instance_id": replacement.instance_id,
                "detail": replacement.detail,
                "error": None,
            }
            log.info("replacing machine %d: %s", action.machine.rank, replacement.detail)
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
        async with self.database.session() as session:
            await recovery.record_replacement(session, action.event_id, **outcome)

    # -- failure detection ---------------------------------------------------------------------------------

    async def _lost(self, machine_filter: Any, cause: str) -> None:
        """Declare lost every live machine of an active job that `machine_filter(machine)` selects."""
        async with self.database.session() as session:
            for job_id in await repo.active_job_ids(session):
                job = await repo.get_job(session, job_id, for_update=True)
                if job is None:
                    continue
                for machine in await repo.live_machines(session, job_id):
                    if machine.state == MachineState.HEALTHY and machine_filter(machine):
                        log.warning(
                            "job %s: machine %d (%s) %s", job.name, machine.rank, machine.instance_id, cause
                        )
                        await machine_lost(session, job, machine, cause)

    async def _heartbeat_timeouts(self) -> None:
        """REST mode: a machine whose agent has not heartbeated for heartbeat_timeout_s is gone."""
        timeout = self.settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(TICK_S)
            if time.monotonic() - self.leader_since < timeout:
                continue  # a new leader gives agents one timeout to reach it
            cutoff = utcnow() - timedelta(seconds=timeout)

            def silent(machine: Machine, cutoff: datetime = cutoff) -> bool:
                return machine.last_heartbeat_at is not None and machine.last_heartbeat_at < cutoff

            try:
                await self._lost(silent, f"stopped heartbeating (none for {timeout:.0f}s)")
            except Exception:
                log.exception("heartbeat check failed")

    async def _watch_leases(self) -> None:
        """etcd mode: an agent's key disappears when its lease expires (the machine is gone)."""
        assert self.coordinator is not None
        while True:
            # The sweep runs beside the watch, not before it: a lease that expires meanwhile is seen by one.
            sweep = asyncio.create_task(self._sweep_missing_keys(), name="sweep")
            try:
                async for kind, key, summary in self.coordinator.watch_machines():
                    if kind == "delete":
                        await self._lost(
                            lambda m, k=key: (
                                m.job_id == k.job_id and m.rank == k.rank and m.instance_id == k.instance_id
                            ),
                            "lost its etcd lease",
                        )
                    else:
                        await self._store_summary(key, summary)
            except CoordinatorUnavailable as exc:
                log.error("etcd watch failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
            except Exception:
                log.exception("etcd watch broke; restarting it")
                await asyncio.sleep(0.5)
            finally:
                sweep.cancel()

    async def _sweep_missing_keys(self) -> None:
        """After becoming leader: machines whose lease expired while nobody was watching."""
        assert self.coordinator is not None
        await asyncio.sleep(self.settings.lease_ttl_s + 1.0)  # let agents that just registered put their key
        try:
            await self._sweep_once()
        except Exception as exc:  # the watch restarts (with a new sweep) if etcd is the problem
            log.warning("sweep of expired leases failed: %s", exc)

    async def _sweep_once(self) -> None:
        assert self.coordinator is not None
        present = set(await self.coordinator.machine_keys())
        grace = utcnow() - timedelta(seconds=self.settings.lease_ttl_s + 2.0)
        await self._lost(
            lambda m: m.registered_at < grace and MachineKey(m.job_id, m.rank, m.instance_id) not in present,
            "has no etcd lease",
        )

    async def _store_summary(self, key: MachineKey, summary: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._summaries_written.get((key.instance_id, key.rank), 0.0) < SUMMARY_WRITE_S:
            return
        self._summaries_written[(key.instance_id, key.rank)] = now
        async with self.database.session() as session:
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
            except Exception:
                log.exception("cloud health check failed")
