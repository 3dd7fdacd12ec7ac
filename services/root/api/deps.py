"""Request dependencies: the app's shared state, a transactional session, and who is calling."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession

from services.root.clients import CloudOperator
from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.models import Job
from services.root.errors import Forbidden, NotFound, Unauthorized
from services.root.orchestration import Orchestrator
from services.root.settings import Settings
from services.root.tokens import parse_worker_token, same_token, secret_matches


@dataclass
class AppState:
    settings: Settings
    database: Database
    admin_token: str
    operator: CloudOperator
    orchestrator: Orchestrator


async def app_state(request: Request) -> AppState:
    # async, though it awaits nothing: FastAPI runs a plain `def` dependency on a worker thread, and that
    # hop on every request was about half of a cached directive's CPU (test_request_overheads.py).
    state: AppState = request.app.state.castor
    return state


async def session(request: Request) -> AsyncIterator[AsyncSession]:
    async with (await app_state(request)).database.session() as db_session:
        yield db_session


# scope="function": commit before the response is sent, so a client never sees success for a write that
# then fails to commit, and its next request sees what it wrote.
SessionDep = Annotated[AsyncSession, Depends(session, scope="function")]
StateDep = Annotated[AppState, Depends(app_state)]

_bearer = HTTPBearer(auto_error=False, description="Admin token, or a job's worker token")
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


@dataclass(frozen=True)
class Principal:
    """Who a bearer token speaks for: the operator (admin) or one job's agents."""

    admin: bool
    job_id: uuid.UUID | None = None


async def principal(credentials: CredentialsDep, state: StateDep) -> Principal:
    if credentials is None:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    token = credentials.credentials
    if same_token(token, state.admin_token):
        return Principal(admin=True)
    parsed = parse_worker_token(token)
    if parsed is not None:
        if _verified.get(token, 0.0) > time.monotonic():
            return Principal(admin=False, job_id=parsed.job_id)
        # A short transaction of its own: long polls must not hold one open while they wait.
        async with state.database.session() as db:
            job = await repo.get_job(db, parsed.job_id)
        if job is not None and secret_matches(parsed.secret, job.worker_token_hash):
            _remember(token)
            return Principal(admin=False, job_id=job.id)
    raise Unauthorized("unknown or revoked token")


# Worker tokens verified lately: every agent request presents its job's token (a thousand machines heartbeat
# a thousand times a second), and checking it is a transaction of its own. A job's token never changes; a
# deleted job's requests still fail, on the job lookup that follows (404).
TOKEN_CACHE_S = 30.0
TOKEN_CACHE_MAX = 4096
_verified: dict[str, float] = {}


def _remember(token: str) -> None:
    if len(_verified) >= TOKEN_CACHE_MAX:
        now = time.monotonic()
        for stale in [t for t, until in _verified.items() if until <= now] or list(_verified)[:1]:
            del _verified[stale]
    _verified[token] = time.monotonic() + TOKEN_CACHE_S


PrincipalDep = Annotated[Principal, Depends(principal)]


async def require_admin(who: PrincipalDep) -> Principal:
    if not who.admin:
        raise Forbidden("a job's worker token cannot use the public API; use the admin token")
    return who


AdminDep = Annotated[Principal, Depends(require_admin)]


async def job_for_admin(job_id: uuid.UUID, _: AdminDep, db: SessionDep) -> Job:
    job = await repo.get_job(db, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist", code="job_not_found")
    return job


async def job_for_worker(job_id: uuid.UUID, who: PrincipalDep, db: SessionDep) -> Job:
    """The job in the path, locked for this request's transaction; only its own token (or the admin) may
    act on it."""
    if not who.admin and who.job_id != job_id:
        raise Forbidden(f"this token belongs to another job, not {job_id}")
    job = await repo.get_job(db, job_id, for_update=True)
    if job is None:
        raise NotFound(f"job {job_id} does not exist", code="job_not_found")
    return job


async def job_for_worker_unlocked(job_id: uuid.UUID, who: PrincipalDep, db: SessionDep) -> Job:
    """The job in the path, read without a lock: for the hot paths (heartbeats), which write only their own
    machine's row and must not serialize a thousand machines on the job row."""
    if not who.admin and who.job_id != job_id:
        raise Forbidden(f"this token belongs to another job, not {job_id}")
    job = await repo.get_job(db, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist", code="job_not_found")
    return job


async def authorized_job_id(job_id: uuid.UUID, who: PrincipalDep) -> uuid.UUID:
    """The job in the path, checked against the token without touching the job row (long polls)."""
    if not who.admin and who.job_id != job_id:
        raise Forbidden(f"this token belongs to another job, not {job_id}")
    return job_id


AdminJobDep = Annotated[Job, Depends(job_for_admin)]
AuthorizedJobIdDep = Annotated[uuid.UUID, Depends(authorized_job_id)]
WorkerJobDep = Annotated[Job, Depends(job_for_worker)]
WorkerJobUnlockedDep = Annotated[Job, Depends(job_for_worker_unlocked)]
