"""Directives: what every agent of a job must do now, derived from the job's newest recovery plan.

Agents long-poll for a revision newer than the last one they acted on. A plan moves through
pending (machines still registering) -> ready (train from `iteration`); a recovery opens a new generation
in collecting (stop training, report inventories) that becomes ready once planned.
"""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.database import Database, mark_changed
from services.root.db.models import Job, JobState, Machine, PlanStatus, RecoveryPlan
from services.root.errors import NotFound

FINISHED_STATES = (JobState.COMPLETED, JobState.STOPPED, JobState.FAILED)
POLL_INTERVAL_S = 0.5


def directive_changed(session: AsyncSession, job: Job) -> None:
    job.directive_revision += 1
    mark_changed(session, job.id)


def make_ready(session: AsyncSession, job: Job, plan: RecoveryPlan, rank0: Machine) -> None:
    """Release a plan: every rank trains from `plan.iteration`, meeting at machine 0."""
    plan.status = PlanStatus.READY
    plan.rendezvous = {"master_addr": rank0.address, "master_port": rank0.rendezvous_port}
    directive_changed(session, job)


async def directive_of(session: AsyncSession, job: Job) -> schemas.DirectiveOut:
    plan = await repo.latest_plan(session, job.id)
    if plan is None:
        raise NotFound(f"job {job.id} has no recovery plan", code="plan_not_found")
    status = "finished" if job.state in FINISHED_STATES else plan.status
    return schemas.DirectiveOut(
        revision=job.directive_revision,
        job_state=job.state,
        status=status,
        generation=plan.generation,
        iteration=plan.iteration,
        world_size=job.num_machines * job.procs_per_machine,
        procs_per_machine=job.procs_per_machine,
        rendezvous=schemas.Rendezvous(**plan.rendezvous) if plan.rendezvous else None,
        sources=[schemas.PlanSource(**source) for source in plan.sources],
        machines=[
            schemas.Peer(
                rank=m.rank,
                address=m.address,
                data_port=m.data_port,
                state=m.state,
                instance_id=m.instance_id,
            )
            for m in await repo.live_machines(session, job.id)
        ],
    )


async def wait_for_directive(
    database: Database, job_id: uuid.UUID, after: int, wait_s: float
) -> schemas.DirectiveOut:
    """The job's directive once its revision is newer than `after`, or the current one after `wait_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        async with database.session() as session:
            job = await repo.get_job(session, job_id)
            if job is None:
                raise NotFound(f"job {job_id} does not exist", code="job_not_found")
            if job.directive_revision > after or loop.time() >= deadline:
                return await directive_of(session, job)
        await database.signals.wait(job_id, min(POLL_INTERVAL_S, max(0.0, deadline - loop.time())))
