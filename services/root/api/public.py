"""Public API (admin token): jobs and everything a user inspects about them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Path, Query, Response, status

from services.root import schemas
from services.root.api.deps import AdminDep, AdminJobDep, SessionDep, StateDep
from services.root.clients import JobInfo
from services.root.db import repository as repo
from services.root.db.models import FailureEvent, JobState
from services.root.errors import Invalid, NotFound, error_responses
from services.root.flows import jobs as job_flows
from services.root.flows import recovery
from services.root.schemas.shared import readable_json

# 503: the request's transaction lost a race inside the database and was rolled back (retry it).
router = APIRouter(prefix="/api/v1", tags=["jobs"], responses=error_responses(401, 403, 422, 503))


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    response_model=schemas.JobCreated,
    responses=error_responses(409, 413),
)
async def create_job(
    body: schemas.JobCreate, _: AdminDep, db: SessionDep, state: StateDep, background: BackgroundTasks
) -> schemas.JobCreated:
    """Create a job: computes and stores its placement; returns the worker token (shown once). With a
    launch spec, the local cloud operator starts the job's machines."""
    if body.launch is not None and state.settings.cloud != "local":
        raise Invalid(
            "a launch spec needs the local cloud operator (CASTOR_CLOUD=local)", code="launch_unsupported"
        )
    limit = state.settings.max_machines_per_job
    if body.machines > limit:
        problem = f"at most {limit} machines per job (CASTOR_MAX_MACHINES_PER_JOB)"
        raise Invalid(
            f"invalid request: body.machines: {problem}",
            code="validation_error",
            details={"errors": [{"field": "body.machines", "problem": problem}]},
        )
    local_limit = state.settings.local_max_machines
    if body.launch is not None and body.machines > local_limit:
        raise Invalid(
            f"the local operator starts at most {local_limit} machines on this host "
            f"(CASTOR_LOCAL_MAX_MACHINES); this job asks for {body.machines}: start its machines "
            "outside Castor (no launch spec) or raise the limit",
            code="launch_too_large",
        )
    job, token = await job_flows.create_job(db, body)
    info = JobInfo(job.id, job.name, job.num_machines, job.launch)
    background.add_task(state.operator.provision, info, token)  # after the commit: agents register at once
    return schemas.JobCreated(**(await job_flows.job_out(db, job)).model_dump(), worker_token=token)


@router.get("/jobs", response_model=schemas.JobPage)
async def list_jobs(
    _: AdminDep,
    db: SessionDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state.")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=schemas.INT32_MAX)] = 0,
) -> schemas.JobPage:
    """List jobs, newest first."""
    jobs, total = await repo.list_jobs(db, state=state, limit=limit, offset=offset)
    return schemas.JobPage(items=await job_flows.jobs_out(db, jobs), total=total, limit=limit, offset=offset)


@router.get("/jobs/{job_id}", response_model=schemas.JobOut, responses=error_responses(404))
async def get_job(job: AdminJobDep, db: SessionDep) -> schemas.JobOut:
    """One job with its counters."""
    return await job_flows.job_out(db, job)


@router.delete("/jobs/{job_id}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(404))
async def delete_job(
    job: AdminJobDep, db: SessionDep, state: StateDep, background: BackgroundTasks
) -> Response:
    """Delete a job and its history (machines, failures, plans, persisted checkpoint records); machines the
    local operator started are stopped."""
    info = JobInfo(job.id, job.name, job.num_machines, job.launch)
    await repo.delete_job(db, job)
    background.add_task(state.operator.release, info)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/jobs/{job_id}/stop", response_model=schemas.JobOut, responses=error_responses(404, 409))
async def stop_job(
    job: AdminJobDep, db: SessionDep, state: StateDep, background: BackgroundTasks
) -> schemas.JobOut:
    """Stop a job: its agents stop training and exit, machines the local operator started are stopped, and
    its history (failures, plans, checkpoints) stays."""
    await job_flows.stop_job(db, job)
    background.add_task(state.operator.release, JobInfo(job.id, job.name, job.num_machines, job.launch))
    return await job_flows.job_out(db, job)


@router.get(
    "/jobs/{job_id}/machines", response_model=list[schemas.MachineOut], responses=error_responses(404)
)
async def list_machines(
    job: AdminJobDep,
    db: SessionDep,
    history: Annotated[bool, Query(description="Include replaced machines.")] = False,
) -> list[schemas.MachineOut]:
    """The job's machines by rank."""
    machines = await (repo.all_machines if history else repo.live_machines)(db, job.id)
    return [schemas.MachineOut.model_validate(m) for m in machines]


@router.get("/jobs/{job_id}/placement", response_model=schemas.PlacementOut, responses=error_responses(404))
async def get_placement(job: AdminJobDep, db: SessionDep) -> schemas.PlacementOut:
    """Placement groups, each rank's replica holders, and the recovery probability for k = 1..4."""
    return await job_flows.job_placement(db, job)


@router.get(
    "/jobs/{job_id}/failures", response_model=list[schemas.FailureOut], responses=error_responses(404)
)
async def list_failures(job: AdminJobDep, db: SessionDep) -> list[schemas.FailureOut]:
    """Failure events, newest first."""
    numbers = await repo.failure_numbers(db, job.id)
    events = await repo.list_failures(db, job.id)
    notes = await recovery.progress_notes(db, job.id, [f.plan_id for f in events])
    return [_failure_out(f, numbers, notes) for f in events]


def _failure_out(
    event: FailureEvent, numbers: dict[int, int], notes: dict[int, dict[str, dict[str, Any]]]
) -> schemas.FailureOut:
    """A failure as the API shows it: its number in the job, and its plan's progress reports in its
    details (flows.recovery.progress_notes), read through the same JSON guard as the rest."""
    out = schemas.FailureOut.model_validate(event)
    update: dict[str, Any] = {"number": numbers.get(event.id)}
    if event.plan_id in notes:
        update["details"] = readable_json(recovery.with_progress(event, notes))
    return out.model_copy(update=update)


@router.get(
    "/jobs/{job_id}/failures/{failure_id}", response_model=schemas.FailureOut, responses=error_responses(404)
)
async def get_failure(
    job: AdminJobDep,
    failure_id: Annotated[int, Path(ge=1, le=schemas.INT32_MAX, description="The failure event's id.")],
    db: SessionDep,
) -> schemas.FailureOut:
    """One failure event with its phase timestamps."""
    event = await repo.get_failure(db, job.id, failure_id)
    if event is None:
        raise NotFound(f"job {job.id} has no failure {failure_id}", code="failure_not_found")
    numbers = await repo.failure_numbers(db, job.id)
    return _failure_out(event, numbers, await recovery.progress_notes(db, job.id, [event.plan_id]))


@router.get(
    "/jobs/{job_id}/recovery-plans",
    response_model=list[schemas.RecoveryPlanOut],
    responses=error_responses(404),
)
async def list_recovery_plans(job: AdminJobDep, db: SessionDep) -> list[schemas.RecoveryPlanOut]:
    """Recovery plans, newest generation first."""
    return [schemas.RecoveryPlanOut.model_validate(p) for p in await repo.list_plans(db, job.id)]


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=list[schemas.PersistedCheckpointOut],
    responses=error_responses(404),
)
async def list_persisted_checkpoints(
    job: AdminJobDep, db: SessionDep
) -> list[schemas.PersistedCheckpointOut]:
    """Checkpoints in the persistent tier, newest first; complete when every rank's shard is there."""
    world_size = job.num_machines * job.procs_per_machine
    return [
        schemas.PersistedCheckpointOut(
            iteration=c.iteration,
            location=c.location,
            created_at=c.created_at,
            complete=len(c.shards) == world_size,
            shards=[schemas.PersistedShardOut.model_validate(s) for s in c.shards],
        )
        for c in await repo.list_persisted(db, job.id)
    ]
