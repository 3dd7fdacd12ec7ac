"""Public API (admin token): jobs and everything a user inspects about them."""

from __future__ import annotations

import pathlib
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, BackgroundTasks, Path, Query, Request, Response, status

from services.root import schemas
from services.root.api.deps import AdminDep, AdminJobDep, SessionDep, StateDep
from services.root.clients import JobInfo
from services.root.db import repository as repo
from services.root.db.models import FailureEvent, JobState
from services.root.errors import Invalid, NotFound, error_responses
from services.root.flows import jobs as job_flows
from services.root.flows import persistence, recovery
from services.root.schemas.shared import readable_json

# Lists come a page at a time. The defaults are large enough that a job of ordinary size comes whole in one
# page (its 1,000 machines; its newest 100 failures, plans and checkpoints); the maxima bound what one
# request reads and serializes (a machine's row carries its heartbeat summary; a failure its plan's
# per-rank progress; a checkpoint one shard per rank).
MACHINES_PAGE_MAX = 1000
PAGE_DEFAULT = 100
PAGE_MAX = 500
PAGE_HEADERS: dict[str, Any] = {
    "headers": {
        "X-Total-Count": {
            "description": "How many items the whole list holds.",
            "schema": {"type": "integer"},
        },
        "Link": {
            "description": 'RFC 8288: `<URL>; rel="next"`, the next page, while more items remain.',
            "schema": {"type": "string"},
        },
    }
}

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
    cwd = body.launch.cwd if body.launch is not None else None
    if cwd is not None and not _is_directory(cwd):
        raise Invalid(
            f"launch.cwd {cwd[:200]!r} is not a directory on this host, where the local operator "
            "starts the job's machines",
            code="launch_cwd_missing",
        )
    job, token = await job_flows.create_job(db, body)
    info = JobInfo(job.id, job.name, job.num_machines, job.launch)
    background.add_task(job_flows.provision_machines, state.database, state.operator, info, token)
    return schemas.JobCreated(**(await job_flows.job_out(db, job)).model_dump(), worker_token=token)


def _is_directory(path: str) -> bool:
    """One stat of a local path; a path the host cannot stat (too long, not searchable) is none."""
    try:
        return pathlib.Path(path).is_dir()
    except (OSError, ValueError):
        return False


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
    "/jobs/{job_id}/machines",
    response_model=list[schemas.MachineOut],
    responses={**error_responses(404), 200: PAGE_HEADERS},
)
async def list_machines(
    job: AdminJobDep,
    db: SessionDep,
    request: Request,
    response: Response,
    history: Annotated[bool, Query(description="Include replaced machines.")] = False,
    limit: Annotated[
        int,
        Query(ge=1, le=MACHINES_PAGE_MAX, description="Machines per page (a 1,000-machine job: one page)."),
    ] = MACHINES_PAGE_MAX,
    offset: Annotated[int, Query(ge=0, le=schemas.INT32_MAX, description="Machines skipped.")] = 0,
) -> list[schemas.MachineOut]:
    """The job's machines by rank, a page at a time (X-Total-Count, and a Link rel="next" while more
    remain). Ranks are fixed when the job is created, so offsets stay stable; with `history`, a
    replacement registering meanwhile lands beside its rank's earlier machines."""
    machines, total = await repo.machines_page(db, job.id, history=history, limit=limit, offset=offset)
    more = offset + len(machines) < total
    next_params = {"limit": limit, "offset": offset + len(machines)} if more and machines else None
    _page_headers(request, response, total, next_params)
    return [schemas.MachineOut.model_validate(m) for m in machines]


@router.get("/jobs/{job_id}/placement", response_model=schemas.PlacementOut, responses=error_responses(404))
async def get_placement(job: AdminJobDep, db: SessionDep) -> schemas.PlacementOut:
    """Placement groups, each rank's replica holders, and the recovery probability for k = 1..4."""
    return await job_flows.job_placement(db, job)


@router.get(
    "/jobs/{job_id}/failures",
    response_model=list[schemas.FailureOut],
    responses={**error_responses(404), 200: PAGE_HEADERS},
)
async def list_failures(
    job: AdminJobDep,
    db: SessionDep,
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description="Failures per page.")] = PAGE_DEFAULT,
    before_id: Annotated[
        int | None,
        Query(ge=1, le=schemas.INT32_MAX, description="Only failures older than this one (the next page)."),
    ] = None,
) -> list[schemas.FailureOut]:
    """Failure events, newest first, a page at a time (X-Total-Count, and a Link rel="next" while older
    ones remain). The next page is the failures older than the last one shown (`before_id`): new failures
    arriving meanwhile do not shift it."""
    found = await repo.failures_page(db, job.id, limit=limit + 1, before_id=before_id)
    if found is None:
        raise _bad_cursor("before_id", f"job {job.id} has no failure {before_id}")
    events, total = list(found[0]), found[1]
    more, events = len(events) > limit, events[:limit]
    _page_headers(request, response, total, {"limit": limit, "before_id": events[-1].id} if more else None)
    numbers = await repo.failure_numbers_of(db, job.id, [f.id for f in events])
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
    numbers = await repo.failure_numbers_of(db, job.id, [event.id])
    return _failure_out(event, numbers, await recovery.progress_notes(db, job.id, [event.plan_id]))


@router.get(
    "/jobs/{job_id}/recovery-plans",
    response_model=list[schemas.RecoveryPlanOut],
    responses={**error_responses(404), 200: PAGE_HEADERS},
)
async def list_recovery_plans(
    job: AdminJobDep,
    db: SessionDep,
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description="Plans per page.")] = PAGE_DEFAULT,
    before_generation: Annotated[
        int | None,
        Query(ge=1, le=schemas.INT32_MAX, description="Only plans of older generations (the next page)."),
    ] = None,
) -> list[schemas.RecoveryPlanOut]:
    """Recovery plans, newest generation first, a page at a time (X-Total-Count, and a Link rel="next"
    while older ones remain)."""
    plans, total = await repo.plans_page(db, job.id, limit=limit + 1, before_generation=before_generation)
    more, plans = len(plans) > limit, plans[:limit]
    next_params = {"limit": limit, "before_generation": plans[-1].generation} if more else None
    _page_headers(request, response, total, next_params)
    return [schemas.RecoveryPlanOut.model_validate(p) for p in plans]


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=list[schemas.PersistedCheckpointOut],
    responses={**error_responses(404), 200: PAGE_HEADERS},
)
async def list_persisted_checkpoints(
    job: AdminJobDep,
    db: SessionDep,
    request: Request,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=PAGE_MAX, description="Checkpoints per page.")] = PAGE_DEFAULT,
    before_iteration: Annotated[
        int | None,
        Query(
            ge=0, le=schemas.INT32_MAX, description="Only checkpoints of older iterations (the next page)."
        ),
    ] = None,
) -> list[schemas.PersistedCheckpointOut]:
    """Checkpoints in the persistent tier, newest first; complete when every rank's shard is there. A page
    at a time (X-Total-Count, and a Link rel="next" while older ones remain)."""
    found, total = await repo.persisted_page(db, job.id, limit=limit + 1, before_iteration=before_iteration)
    more, found = len(found) > limit, found[:limit]
    _page_headers(
        request, response, total, {"limit": limit, "before_iteration": found[-1].iteration} if more else None
    )
    return await persistence.checkpoints_out(db, job, found)


def _page_headers(
    request: Request, response: Response, total: int, next_params: dict[str, int] | None
) -> None:
    """A list's page metadata: X-Total-Count, and an RFC 8288 Link to the next page while more remain (this
    request's path and query with the next page's parameters: a reference relative to the request)."""
    response.headers["X-Total-Count"] = str(total)
    if next_params is not None:
        query = {**request.query_params, **{key: str(value) for key, value in next_params.items()}}
        response.headers["Link"] = f'<{request.url.path}?{urlencode(query)}>; rel="next"'


def _bad_cursor(field: str, problem: str) -> Invalid:
    """A cursor naming nothing of the job: a 422 in the shape of every other bad query parameter."""
    return Invalid(
        f"invalid request: query.{field}: {problem}",
        code="validation_error",
        details={"errors": [{"field": f"query.{field}", "problem": problem}]},
    )
