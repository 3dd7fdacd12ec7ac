"""One error shape for the whole API: {"error": {"code", "message", "details"}}.

`code` is stable and machine-readable; `message` is for humans. Domain code raises the ApiError
subclasses below; the handlers map everything else (validation, unknown routes, integrity conflicts) to the
same shape, so no client ever has to parse two formats, and bad input never yields a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.root.db.database import is_transient_conflict
from services.root.middleware import allowed_methods

log = logging.getLogger(__name__)


class ApiError(Exception):
    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.details = details or {}


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class Invalid(ApiError):
    status, code = 422, "invalid_request"


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] = {}


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting the error shape for the given statuses."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


_DESCRIPTIONS = {
    401: "Missing or unknown bearer token",
    403: "The token may not act on this resource",
    404: "No such resource",
    409: "Conflicts with the current state",
    413: "The request body exceeds the service's limit (CASTOR_MAX_BODY_BYTES)",
    422: "The request is malformed",
    503: "A concurrent change got in the way, or the service is overloaded; retry after Retry-After seconds",
}

_HTTP_CODES = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_FIELD_CHARS = 200


def _field_name(loc: Any) -> str:
    """A validation error's location as text that can always be sent: it may hold a client's own object
    keys (lone surrogates have no UTF-8 encoding and would fail the response; long keys are cut)."""
    name = _SURROGATE.sub("\ufffd", ".".join(str(part) for part in loc))
    return name if len(name) <= MAX_FIELD_CHARS else name[:MAX_FIELD_CHARS] + "..."


def _body(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    default = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": "1"}}.get(status, {})
    content = {"error": {"code": code, "message": message, "details": details or {}}}
    return JSONResponse(content, status_code=status, headers={**default, **(headers or {})})


def _parse_problem(cause: BaseException) -> str:
    """What FastAPI's JSON parse of a body raised, in a few words."""
    if isinstance(cause, RecursionError):
        return "nested too deep"
    if isinstance(cause, UnicodeDecodeError):
        return "not UTF-8 text"
    # Python refuses integers of more than 4300 digits (int_max_str_digits), as a denial-of-service guard.
    if "digits" in str(cause):
        return "a number has too many digits"
    return str(cause)[:200]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _body(exc.status, exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {
                "field": _field_name(err["loc"]),
                "problem": err["msg"].removeprefix("Value error, "),
            }
            for err in exc.errors()
        ]
        summary = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
        return _body(422, "validation_error", f"invalid request: {summary}", {"errors": problems})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, ValueError | RecursionError):
            # FastAPI's "error parsing the body": not UTF-8 (UnicodeDecodeError), or nested deeper than
            # the JSON parser recurses. Malformed input like any other: a 422 in the one shape.
            problem = "not valid JSON: " + _parse_problem(exc.__cause__)
            errors = [{"field": "body", "problem": problem}]
            return _body(422, "validation_error", f"invalid request: body: {problem}", {"errors": errors})
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route matching the path; the Allow header lists them all.
            headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
        return _body(exc.status_code, code, str(exc.detail), headers=headers)

    @app.exception_handler(IntegrityError)
    async def _integrity(_: Request, exc: IntegrityError) -> JSONResponse:
        # A race that slipped past the flows' own checks (e.g. two creates with one name at once).
        log.info("integrity conflict: %s", exc.orig)
        return _body(409, "conflict", "the request conflicts with existing data; retry or change it")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug or an outage (database down), never bad input: logged with its traceback, answered in the
        # same shape so clients still parse one format.
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _body(500, "internal_error", "the server failed to handle the request; see its log")

    @app.exception_handler(PoolTimeout)
    async def _overloaded(request: Request, exc: PoolTimeout) -> JSONResponse:
        # Every pooled database connection stayed busy past the pool's timeout: the service is overloaded
        # (a thousand agents at once), not broken; the request changed nothing and a later one goes through.
        log.warning("%s %s: no database connection free: %s", request.method, request.url.path, exc)
        return _body(503, "overloaded", "every database connection is busy; nothing was changed, retry")

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        if exc.connection_invalidated:
            # A pooled connection had died (Postgres restarted or failed over): the pool was dropped and
            # the same request goes through on a fresh connection (see database.Database).
            log.warning(
                "%s %s: the database connection was lost: %s", request.method, request.url.path, exc.orig
            )
            return _body(503, "retry", "the connection to the database was lost; retry")
        if not is_transient_conflict(exc):
            return await _unexpected(request, exc)
        # Two transactions waited on each other (e.g. a job deleted while the leader recovers it): the
        # database rolled this one back, nothing was changed, and the same request will go through.
        log.info("transient database conflict: %s", exc.orig)
        return _body(503, "retry", "a concurrent change got in the way; nothing was changed, retry")
