"""The leader's background work, one loop in the spirit of torch.distributed.elastic's `_invoke_run`:
campaign (leadership) -> once elected, raise the fencing epoch -> run the workers of a leader (the recovery
driver and the detectors) until the leadership is lost -> campaign again.

The concerns live in their own modules: leadership (the campaign, the epoch, fenced transactions),
detection (heartbeats, etcd leases, cloud health), recovery_driver (every open recovery, one step a pass,
and the machine replacements it decides), per_job (one job's failure does not stop the others). The
recovery's states and transitions are domain.recovery_states.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.root.clients import CloudOperator
from services.root.clients.etcd import EtcdCoordinator
from services.root.db.database import Database
from services.root.orchestration.detection import Detectors
from services.root.orchestration.leadership import Leadership
from services.root.orchestration.per_job import PerJob
from services.root.orchestration.recovery_driver import RecoveryDriver
from services.root.settings import Settings
from services.root.tasks import stopped

log = logging.getLogger(__name__)

CAMPAIGN_RETRY_S = 1.0


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
        self.leadership = Leadership(database, settings, coordinator)
        self.per_job = PerJob()
        self.driver = RecoveryDriver(self.leadership, self.per_job, settings, operator)
        self.detectors = Detectors(self.leadership, self.per_job, settings, operator, coordinator)

    # What /metrics, /healthz and the tests read.
    @property
    def candidate(self) -> str:
        return self.leadership.candidate

    @candidate.setter
    def candidate(self, value: str) -> None:
        self.leadership.candidate = value

    @property
    def is_leader(self) -> bool:
        return self.leadership.is_leader

    @property
    def epoch(self) -> int | None:
        return self.leadership.epoch

    @property
    def step_failures(self) -> int:
        return self.per_job.step_failures

    @property
    def reinstated(self) -> int:
        return self.detectors.reinstated

    @property
    def jobs_silent_en_masse(self) -> int:
        return len(self.detectors.mass_silent_jobs)

    async def step(self, job_id: Any) -> None:
        """One step of one job's recovery (recovery_driver)."""
        await self.driver.step(job_id)

    async def judge(self, job_id: Any) -> None:
        """Suspicion for one job's machines (detection)."""
        await self.detectors.judge(job_id)

    async def run(self) -> None:
        while True:
            lost, elected = asyncio.Event(), asyncio.Event()
            campaign = asyncio.create_task(self.leadership.campaign(elected, lost), name="campaign")
            try:
                leading = await self._elected(campaign, elected)
                if leading:
                    await self._hold_office(lost, campaign)
            finally:
                # Every way out ends the campaign, the root's shutdown while it campaigns included: a
                # campaign left running kept campaigning, and refreshing a lease it then won, on an etcd
                # client the shutdown had closed (aetcd reconnects on the next call), or kept its Postgres
                # connection polling for the advisory lock.
                await stopped(campaign)
            if leading:
                log.warning("leadership lost; campaigning again")
            else:
                await asyncio.sleep(CAMPAIGN_RETRY_S)  # etcd or the database unreachable, or another leads

    async def _elected(self, campaign: asyncio.Task[None], elected: asyncio.Event) -> bool:
        """Whether the campaign won and the fencing epoch was raised (False: the campaign ended without
        winning, or the database refused the epoch)."""
        waiting = asyncio.create_task(elected.wait(), name="elected")
        try:
            await asyncio.wait({campaign, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await stopped(waiting)
        if campaign.done() or not elected.is_set():
            return False  # never won, or lost again already: raising the epoch now would fence a real leader
        try:
            await self.leadership.claim_epoch(self.coordinator.epoch if self.coordinator else None)
        except Exception as exc:  # the database is unreachable: nothing can be done as leader
            log.error("could not raise the leadership epoch (%s); campaigning again", exc)
            return False
        return True

    async def _hold_office(self, lost: asyncio.Event, campaign: asyncio.Task[None]) -> None:
        """The leader's workers, until the leadership is lost (or the root stops). They stop together with
        the campaign, which releases the leadership: a worker slow to stop (a cancellation swallowed) must
        not keep the lease alive with nobody leading; fencing refuses what it still tries to write."""
        self.leadership.took_office(lost)
        work = self._leader_work()
        try:
            await lost.wait()
        finally:
            self.leadership.left_office()
            await stopped(*work, campaign)

    def _leader_work(self) -> list[asyncio.Task[None]]:
        """The leader's workers: the recovery driver and the detectors this deployment has."""
        work = [
            asyncio.create_task(self.driver.drive(), name="drive"),
            asyncio.create_task(self.detectors.suspicion(), name="suspicion"),
        ]
        if self.coordinator is not None:
            work.append(asyncio.create_task(self.detectors.watch_leases(), name="leases"))
        if self.settings.cloud == "aws":
            work.append(asyncio.create_task(self.detectors.cloud_health(), name="cloud"))
        return work
