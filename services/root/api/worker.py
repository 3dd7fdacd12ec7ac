"""Worker API (a job's worker token): what agents call."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Path, Query, Response, status

from services.root import schemas
from services.root.api.deps import (
    AuthorizedJobIdDep,
    SessionDep,
    StateDep,
    WorkerJobUnlockedDep,
)
from services.root.db import repository as repo
from services.root.errors import NotFound, error_responses
from services.root.flows import alignment, directives, failures, persistence, recovery
from services.root.flows import machines as machine_flows
from services.root.persistent_store import delete_persisted

RankPath = Annotated[int, Path(ge=0, le=schemas.INT32_MAX, description="The machine's rank.")]

router = APIRouter(
    prefix="/api/v1/worker/jobs/{job_id}",
    tags=["worker"],
    responses=error_responses(401, 403, 404, 413, 422, 503),  # 503: see public.py
)


@router.post("/machines", response_model=schemas.RegisterResponse, responses=error_responses(409))
async def register_machine(
    body: schemas.RegisterRequest, job_id: AuthorizedJobIdDep, state: StateDep
) -> schemas.RegisterResponse:
    """Register this machine (idempotent: the same instance gets the same rank back). While the job is
    pending a registration locks nothing shared: its rank is claimed by one INSERT (see flows.machines)."""
    return await machine_flows.register(state.database, job_id, body, state.settings)


@router.post(
    "/machines/{rank}/heartbeat", response_model=schemas.HeartbeatResponse, responses=error_responses(409)
)
async def heartbeat(
    rank: RankPath,
    body: schemas.HeartbeatRequest,
    job: WorkerJobUnlockedDep,
    db: SessionDep,
    state: StateDep,
) -> schemas.HeartbeatResponse:
    """Liveness plus a summary of the checkpoints this machine holds (REST heartbeat mode)."""
    answer = await machine_flows.record_heartbeat(db, job, rank, body, state.settings)
    if answer.replication is not None and alignment.followed(job.id):
        alignment.refresh_after_commit(db, job.id)  # the job's alignment polls hear of it once committed
    return answer


SeenQuery = Annotated[
    int,
    Query(
        ge=-1, le=schemas.INT32_MAX, description="As this agent last heard it (-1: none, or not heard yet)."
    ),
]


@router.get("/replication-alignment", response_model=schemas.ReplicationAlignment | None)
async def get_replication_alignment(
    job_id: AuthorizedJobIdDep,
    state: StateDep,
    aligned_iteration: SeenQuery = -1,
    target: SeenQuery = -1,
    go: Annotated[bool, Query(description="As this agent last heard it.")] = False,
    wait: Annotated[
        float,
        Query(ge=0, le=30, description="Seconds to wait at most for an alignment other than the one heard."),
    ] = 0,
) -> schemas.ReplicationAlignment | None:
    """The job's replication alignment (as a heartbeat answers it) once it differs from what the agent last
    heard (long poll): agents that align their rounds hear each step the moment a machine's heartbeat makes
    it, not a heartbeat period later (null: no machine replicates, or the job does not align)."""
    seen = (None if aligned_iteration < 0 else aligned_iteration, None if target < 0 else target, go)
    current = await alignment.wait_for_alignment(state.database.engine, job_id, seen, wait)
    return None if current is None else schemas.ReplicationAlignment(**asdict(current))


@router.post(
    "/machines/{rank}/exits",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=schemas.ExitAck,
    responses=error_responses(409),
)
async def report_exit(
    rank: RankPath, body: schemas.ExitReport, job: WorkerJobUnlockedDep, db: SessionDep
) -> schemas.ExitAck:
    """A training process on this machine ended (reported at once, with its exit code). A clean exit locks
    nothing; a crash takes the job row's lock to record its failure (flows.failures.record_exit)."""
    event = await failures.record_exit(db, job, rank, body)
    return schemas.ExitAck(failure_id=event.id if event else None)


@router.get("/recovery-plan", response_model=schemas.RecoveryPlanOut)
async def current_recovery_plan(job: WorkerJobUnlockedDep, db: SessionDep) -> schemas.RecoveryPlanOut:
    """The newest recovery plan: the iteration every rank resumes from and where each rank gets it."""
    plan = await repo.latest_plan(db, job.id)
    if plan is None:
        raise NotFound(f"job {job.id} has no recovery plan", code="plan_not_found")
    return schemas.RecoveryPlanOut.model_validate(plan)


AfterQuery = Annotated[
    int, Query(ge=-1, le=schemas.INT32_MAX, description="Return once the revision is newer than this.")
]
WaitQuery = Annotated[
    float,
    Query(
        ge=0,
        le=60,
        description="Seconds to wait at most for a newer revision. An unchanged directive is answered "
        "after a random 50-100 % of the wait, so that a job's long polls, begun together, do not all "
        "end together.",
    ),
]


@router.get("/directive", response_model=schemas.DirectiveOut)
async def get_directive(
    job_id: AuthorizedJobIdDep,
    state: StateDep,
    after: AfterQuery = -1,
    wait: WaitQuery = 0,
    machine: Annotated[
        int | None,
        Query(
            ge=0,
            le=schemas.INT32_MAX,
            description="This machine's rank: the directive carries only its ranks' sources, itself and "
            "the peers holding its replicas (omitted: the whole job's, every rank and every machine).",
        ),
    ] = None,
) -> Response:
    """What this job's agents must do now (long poll): wait, train from an iteration, stop and report
    their inventory, or exit. The answer comes as soon as a commit changes the directive."""
    body = await directives.wait_for_directive(state.database, job_id, after, wait, machine)
    # Serialized once per read of the directive and machine, not per request (schema: DirectiveOut).
    return _directive_response(body)


def _directive_response(body: bytes) -> Response:
    return Response(content=body, media_type="application/json")


@router.post(
    "/machines/{rank}/progress", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(409)
)
async def report_progress(
    rank: RankPath, body: schemas.ProgressReport, job_id: AuthorizedJobIdDep, state: StateDep
) -> Response:
    """This machine's progress through the current plan (restored, resumed, finished). It writes this
    machine's own rows only and locks nothing shared; the job completes with the last machine finished."""
    await recovery.record_progress(state.database, job_id, rank, body)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/machines/{rank}/inventory",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={
        **error_responses(409),
        200: {
            "model": schemas.DirectiveOut,
            "description": "With `wait`: the report recorded, this machine's directive (long poll).",
        },
    },
)
async def report_inventory(
    rank: RankPath,
    body: schemas.InventoryReport,
    job_id: AuthorizedJobIdDep,
    state: StateDep,
    after: AfterQuery = -1,
    wait: Annotated[
        float | None,
        Query(
            ge=0,
            le=60,
            description="Also the agent's next directive long poll (as GET /directive with `after`, `wait` "
            "and `machine` this rank): the report is recorded, then answered with this machine's directive "
            "once its revision is newer than `after`. Omitted: 204 at once.",
        ),
    ] = None,
) -> Response:
    """What this machine holds (each copy checked, found corrupt, or not checked yet: agents report at once
    and check in the background) for the recovery being planned (its own row only:
    nothing shared is locked, the job row is not read). An agent that then long-polls its directive asks
    for both in this one request (`wait`): in a recovery a thousand agents report at once, and a request
    fewer each is a thousand fewer for the root while the plan waits for the last report."""
    await recovery.record_inventory(state.database, job_id, rank, body)
    if wait is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return _directive_response(await directives.wait_for_directive(state.database, job_id, after, wait, rank))


@router.post(
    "/machines/{rank}/persisted", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(409)
)
async def report_persisted(
    rank: RankPath,
    body: schemas.PersistedReport,
    job_id: AuthorizedJobIdDep,
    state: StateDep,
    background: BackgroundTasks,
) -> Response:
    """One of this machine's ranks uploaded its checkpoint to the persistent tier, at the key the root
    computes (a report naming another key: 422; a rank this machine does not run: 403); checkpoints
    beyond the newest P are deleted, only ever inside this job's own prefix. A report writes its own
    shard's row; only one that finds every rank's shard in takes the job row's lock."""
    tier = persistence.tier_of(state.settings)
    expired = await persistence.record_persisted(state.database, job_id, rank, body, tier, state.settings)
    if expired:
        background.add_task(delete_persisted, state.settings, str(job_id), expired)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
