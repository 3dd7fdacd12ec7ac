"""Iterations over time, for the job page's chart.

The database keeps each job's newest checkpointed iteration (`jobs.newest_iteration`, refreshed from the
agents' heartbeats), not its history: a row per job per second would be write load for a chart. So every
root process samples that column itself, once a second, for the jobs that are running or recovering, and
keeps the samples in memory: a ring buffer per job, run-length compressed (a flat stretch, e.g. a recovery,
costs two points), holding the newest `capacity` changes.

What that means for a reader: the chart covers the time this root process has been up (a restarted or newly
elected replica starts an empty chart), and the line is as fine as the heartbeats (about a second). Every
replica samples the same database, so each one draws the same line for the time it has been up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select

from services.root.db.database import Database
from services.root.db.models import Job, JobState

log = logging.getLogger(__name__)

ACTIVE = (JobState.RUNNING, JobState.RECOVERING)


@dataclass
class Sample:
    at: datetime
    iteration: int


class IterationHistory:
    """Per job, (time, newest iteration) samples; the oldest are dropped first."""

    def __init__(self, *, capacity: int = 3600, max_jobs: int = 200, interval_s: float = 1.0):
        self.capacity = capacity
        self.max_jobs = max_jobs
        self.interval_s = interval_s
        self.started_at = datetime.now(UTC)
        self._series: OrderedDict[uuid.UUID, deque[Sample]] = OrderedDict()

    def record(self, job_id: uuid.UUID, iteration: int, at: datetime | None = None) -> None:
        at = at or datetime.now(UTC)
        series = self._series.get(job_id)
        if series is None:
            series = self._series[job_id] = deque(maxlen=self.capacity)
            while len(self._series) > self.max_jobs:
                self._series.popitem(last=False)  # the job sampled least recently
        else:
            self._series.move_to_end(job_id)
        # Run-length: of three equal iterations in a row, the middle one says nothing.
        if len(series) >= 2 and series[-1].iteration == series[-2].iteration == iteration:
            series[-1].at = at
        else:
            series.append(Sample(at, iteration))

    def samples(self, job_id: uuid.UUID) -> list[Sample]:
        return [Sample(s.at, s.iteration) for s in self._series.get(job_id, ())]

    async def sample_once(self, database: Database) -> None:
        async with database.session() as session:
            rows = (
                await session.execute(
                    select(Job.id, Job.newest_iteration).where(
                        Job.state.in_(ACTIVE), Job.newest_iteration.is_not(None)
                    )
                )
            ).all()
        now = datetime.now(UTC)
        for job_id, iteration in rows:
            if iteration is not None:
                self.record(job_id, iteration, now)

    async def run(self, database: Database) -> None:
        """Sample until cancelled; a database hiccup costs a sample, never the sampler."""
        while True:
            try:
                await self.sample_once(database)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("sampling iterations for the status pages failed: %s", exc)
            await asyncio.sleep(self.interval_s)


@contextlib.asynccontextmanager
async def sampling(history: IterationHistory, database: Database) -> AsyncIterator[None]:
    task = asyncio.create_task(history.run(database), name="iteration-sampler")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
