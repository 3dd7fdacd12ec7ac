"""The jobs list (/): a row per job, the state tabs with their counts, pagination."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlencode

from sqlalchemy.ext.asyncio import AsyncSession

from services.root.db import repository as repo
from services.root.flows import jobs as job_flows
from services.root.web import queries
from services.root.web.contexts.common import (
    JOB_STATES,
    LIVE_JOB_STATES,
    job_href,
)

__all__ = [
    "JobRow",
    "JobsPage",
    "StateTab",
    "jobs_page",
]


@dataclass(frozen=True)
class StateTab:
    label: str
    state: str | None
    count: int
    href: str
    active: bool


@dataclass(frozen=True)
class JobRow:
    id: uuid.UUID
    name: str
    href: str
    state: str
    machines: int
    machines_healthy: int
    replicas: int
    placement_strategy: str
    newest_iteration: int | None
    checkpoints_per_minute: float | None
    failures: int
    wasted_time_s: float
    created_at: datetime


@dataclass(frozen=True)
class JobsPage:
    rows: list[JobRow]
    tabs: list[StateTab]
    state: str | None
    page: int
    pages: int
    total: int
    per_page: int
    prev_href: str | None
    next_href: str | None
    live: bool
    notice: str | None = None
    title: str = "Jobs"


def _list_href(state: str | None, page: int = 1) -> str:
    params: dict[str, str | int] = {}
    if state:
        params["state"] = state
    if page > 1:
        params["page"] = page
    return "/" + ("?" + urlencode(params) if params else "")


async def jobs_page(
    session: AsyncSession, *, state: str | None, page: int, per_page: int, notice: str | None = None
) -> JobsPage:

    counts = await queries.jobs_by_state(session)
    total_all = sum(counts.values())
    jobs, total = await repo.list_jobs(session, state=state, limit=per_page, offset=(page - 1) * per_page)
    rows = [
        JobRow(
            id=job.id,
            name=job.name,
            href=job_href(job.id),
            state=job.state,
            machines=job.machines,
            machines_healthy=job.machines_healthy,
            replicas=job.replicas,
            placement_strategy=job.placement_strategy,
            newest_iteration=job.newest_iteration,
            checkpoints_per_minute=job.checkpoints_per_minute,
            failures=job.failures,
            wasted_time_s=job.wasted_time_s,
            created_at=job.created_at,
        )
        for job in await job_flows.jobs_out(session, jobs)
    ]
    tabs = [StateTab("all", None, total_all, _list_href(None), state is None)]
    tabs += [StateTab(s, s, counts.get(s, 0), _list_href(s), state == s) for s in JOB_STATES]
    pages = max(1, math.ceil(total / per_page))
    return JobsPage(
        rows=rows,
        tabs=tabs,
        state=state,
        page=page,
        pages=pages,
        total=total,
        per_page=per_page,
        prev_href=_list_href(state, page - 1) if page > 1 else None,
        next_href=_list_href(state, page + 1) if page < pages else None,
        live=any(r.state in LIVE_JOB_STATES for r in rows),
        notice=notice,
    )
