"""Server-rendered status pages (read-only), behind the admin token.

    /login, /logout                         the token form; a server-side session (logout by POST only)
    /                                       jobs (?state=, ?page=)
    /jobs/{id}                              one job: placement, failures, iterations, checkpoints
                                            (?machines=: its machines' page, past 64 machines)
    /jobs/{id}/failures/{failure id}        one failure in full
    /static/{name}                          the stylesheet and the refresh script

Routes authenticate, read through `contexts`, and render; the templates draw the contexts.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Form, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from services.root.api.deps import SessionDep, StateDep
from services.root.app_info import VERSION
from services.root.db import repository as repo
from services.root.tokens import same_token
from services.root.web import auth, contexts, formatting
from services.root.web.sampler import IterationHistory, sampling

HERE = Path(__file__).parent
STATIC_TYPES = {"castor.css": "text/css", "castor.js": "text/javascript", "favicon.svg": "image/svg+xml"}
PER_PAGE = 25
MAX_PAGE = 1_000_000  # keeps OFFSET well inside 64 bits

templates = Jinja2Templates(directory=HERE / "templates")
formatting.install(templates.env)


def _asset_version() -> str:
    digest = hashlib.sha256()
    for name in sorted(STATIC_TYPES):
        digest.update((HERE / "static" / name).read_bytes())
    return digest.hexdigest()[:10]


templates.env.globals.update(version=VERSION, asset_version=_asset_version())

# What the pages may load: their own stylesheet, script and images, nothing inline, nothing foreign.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; script-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class PageNotFound(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def history_of(request: Request) -> IterationHistory:
    history: IterationHistory | None = getattr(request.app.state, "castor_iterations", None)
    return history if history is not None else IterationHistory()


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Sample the running jobs' iterations for the charts while the app runs (after the app's own lifespan
    opened the database)."""
    async with sampling(app.state.castor_iterations, app.state.castor.database):
        yield


router = APIRouter(include_in_schema=False, lifespan=_lifespan)


async def require_login(request: Request, state: StateDep, db: SessionDep) -> None:
    if not await auth.is_authenticated(request, db, state.admin_token):
        raise auth.LoginRequired(auth.requested_path(request))


LoggedIn = [Depends(require_login)]


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    context.setdefault("now", datetime.now(UTC))
    context.setdefault("live", False)
    context.setdefault("authenticated", True)
    response = templates.TemplateResponse(request, template, context, status_code=status)
    response.headers.update(SECURITY_HEADERS)
    return response


def install(app: FastAPI) -> None:
    """Add the pages to `app`: routes, the iteration sampler, the login redirect and the 404 page."""
    app.state.castor_iterations = IterationHistory()
    app.include_router(router)

    @app.exception_handler(auth.LoginRequired)
    async def _login_required(_: Request, exc: auth.LoginRequired) -> Response:
        # A body too, for whoever does not follow redirects (curl): where to go, nothing else.
        target = auth.login_url(exc.next_path)
        link = f'<a href="{escape(target)}">sign in</a>'
        body = f"<!doctype html><title>Castor</title><p>Castor status pages: {link}."
        return HTMLResponse(body, status_code=303, headers={"Location": target, **SECURITY_HEADERS})

    @app.exception_handler(PageNotFound)
    async def _not_found(request: Request, exc: PageNotFound) -> Response:
        state = request.app.state.castor
        async with state.database.session() as db:
            signed_in = await auth.is_authenticated(request, db, state.admin_token)
        return render(request, "not_found.html", status=404, message=exc.message, authenticated=signed_in)


# -- login -------------------------------------------------------------------------------------------------


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, state: StateDep, db: SessionDep, next: str | None = None) -> Response:
    target = auth.safe_next(next)
    if await auth.is_authenticated(request, db, state.admin_token):
        return RedirectResponse(target, status_code=303)
    return render(request, "login.html", next=target, error=None, authenticated=False)


@router.post("/login", response_class=HTMLResponse)
async def login(
    request: Request,
    state: StateDep,
    db: SessionDep,
    token: Annotated[str, Form(max_length=4096)] = "",
    next: Annotated[str, Form(max_length=2000)] = "/",
) -> Response:
    target = auth.safe_next(next)
    if not token or not same_token(token.strip(), state.admin_token):
        return render(
            request,
            "login.html",
            status=401,
            next=target,
            error="That is not the admin token.",
            authenticated=False,
        )
    response = RedirectResponse(target, status_code=303)
    auth.set_session_cookie(response, request, await auth.open_session(db, state.admin_token))
    return response


@router.get("/logout", response_class=HTMLResponse)
async def logout_form(request: Request, state: StateDep, db: SessionDep) -> Response:
    """Signing out changes state, so it takes a POST (a link or an image elsewhere cannot sign anyone out);
    a GET shows the button."""
    if not await auth.is_authenticated(request, db, state.admin_token):
        return RedirectResponse("/login", status_code=303)
    return render(request, "logout.html")


@router.post("/logout")
async def logout(request: Request, db: SessionDep) -> Response:
    await auth.close_session(request, db)
    response = RedirectResponse("/login", status_code=303)
    auth.clear_session_cookie(response, request)
    return response


# -- pages -------------------------------------------------------------------------------------------------


def _page_number(value: str | None) -> int:
    try:
        return min(max(1, int(value or 1)), MAX_PAGE)
    except ValueError:
        return 1


@router.get("/", response_class=HTMLResponse, dependencies=LoggedIn)
async def jobs(
    request: Request, db: SessionDep, state: str | None = None, page: str | None = None
) -> Response:
    notice = None
    if state == "":
        state = None
    if state is not None and state not in contexts.JOB_STATES:
        notice, state = f"There is no job state {state!r}; showing every job.", None
    context = await contexts.jobs_page(
        db, state=state, page=_page_number(page), per_page=PER_PAGE, notice=notice
    )
    return render(request, "jobs.html", page=context, live=context.live)


async def _job(db: SessionDep, job_id: str) -> Any:
    try:
        parsed = uuid.UUID(job_id)
    except ValueError:
        raise PageNotFound(f"There is no job {job_id!r}.") from None
    job = await repo.get_job(db, parsed)
    if job is None:
        raise PageNotFound(f"There is no job {job_id}: it never existed or was deleted.")
    return job


@router.get("/jobs/{job_id}", response_class=HTMLResponse, dependencies=LoggedIn)
async def job_page(request: Request, db: SessionDep, job_id: str, machines: str | None = None) -> Response:
    """One job; `machines`: the page of its machines drawn (a job of more than
    contexts.MACHINES_PER_PAGE machines; past the last one, the last)."""
    job = await _job(db, job_id)
    context = await contexts.job_page(db, job, history_of(request), machines_page=_page_number(machines))
    return render(request, "job.html", page=context, live=context.live, now=context.now)


@router.get("/jobs/{job_id}/failures/{failure_id}", response_class=HTMLResponse, dependencies=LoggedIn)
async def failure_page(request: Request, db: SessionDep, job_id: str, failure_id: str) -> Response:
    job = await _job(db, job_id)
    # ASCII digits only ("²".isdigit() is true but int() refuses it), and within the 32-bit id column.
    valid = failure_id.isascii() and failure_id.isdigit() and len(failure_id) < 10
    event = await repo.get_failure(db, job.id, int(failure_id)) if valid else None
    if event is None:
        raise PageNotFound(f"Job {job.name} has no failure {failure_id!r}.")
    context = await contexts.failure_page(db, job, event)
    return render(request, "failure.html", page=context, live=context.live, now=context.now)


@router.get("/static/{name}")
async def static(name: str) -> Response:
    media_type = STATIC_TYPES.get(name)
    if media_type is None:
        raise PageNotFound(f"No static file {name!r}.")
    return FileResponse(
        HERE / "static" / name,
        media_type=media_type,
        headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"},
    )
