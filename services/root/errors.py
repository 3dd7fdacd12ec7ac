"""One error shape for the whole API: {"error": {"code", "message", "details"}}.

`code` is stable and machine-readable; `message` is for humans. Domain code raises the ApiError
subclasses below; the handlers map everything else (validation, unknown routes, integrity conflicts) to the
same shape, so no client ever has to parse two formats, and bad input never yields a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    422: "The request is malformed",
}

_HTTP_CODES = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}


def _body(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    content = {"error": {"code": code, "message": message, "details": details or {}}}
    return JSONResponse(content, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _body(exc.status, exc.code, exc.message, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {
                "field": ".".join(str(p) for p in err["loc"]),
                "problem": err["msg"].removeprefix("Value error, "),
            }
            for err in exc.errors()
        ]
        summary = "; ".join(f"{p['field']}: {p['problem']}" for p in problems)
        return _body(422, "validation_error", f"invalid request: {summary}", {"errors": problems})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return _body(exc.status_code, code, str(exc.detail))

    @app.exception_handler(IntegrityError)
    async def _integrity(_: Request, exc: IntegrityError) -> JSONResponse:
        # A race that slipped past the flows' own checks (e.g. two creates with one name at once).
        log.info("integrity conflict: %s", exc.orig)
        return _body(409, "conflict", "the request conflicts with existing data; retry or change it")
