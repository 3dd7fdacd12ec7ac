"""Job isolation for the leader's passes: each job is handled on its own, so one whose step raises is
logged and counted and the other jobs go on."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from services.root.orchestration.leadership import Deposed

log = logging.getLogger(__name__)


class PerJob:
    def __init__(self) -> None:
        self.step_failures = 0  # steps that raised (the job's own failure; the others went on)

    async def each(
        self, job_ids: Iterable[uuid.UUID], work: Callable[[uuid.UUID], Coroutine[Any, Any, None]]
    ) -> None:
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
