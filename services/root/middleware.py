"""HTTP plumbing that every route shares: the request body limit, HEAD on every GET route, and what a
405 allows. Pure ASGI (no buffering of responses)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Methods the API could ever answer; anything else is only ever a 405 (and "other" in /metrics).
KNOWN_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes (CASTOR_MAX_BODY_BYTES)")


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with a 413: before reading any of it when Content-Length
    says so, else once the bytes read exceed it (a chunked body), so no route ever holds more."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        received = 0

        async def limited() -> Message:
            # Raised inside the route that reads the body, so the error handlers answer it in the one
            # error shape; a body declared too large is refused before any of it is read.
            nonlocal received
            if declared is not None and declared > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class HeadMiddleware:
    """HEAD on every GET route (API and pages): answered as the GET would be, headers (Content-Length
    included) without the body. FastAPI routes declared with GET otherwise answer HEAD with a 405, and
    declaring HEAD on each route would double the operations in openapi.yaml."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        # In place: the latency middleware outside reads the route the router sets into this same scope.
        scope["method"] = "GET"
        ended = False

        async def without_body(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.body":
                if ended or message.get("more_body", False):
                    return
                ended = True
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.app(scope, receive, without_body)
        finally:
            scope["method"] = "HEAD"


def allowed_methods(app: ASGIApp, scope: Scope) -> list[str]:
    """The methods some route answers at this scope's path (the Allow header of a 405)."""
    routes = getattr(getattr(app, "router", None), "routes", [])
    allowed = set()
    for method in KNOWN_METHODS:
        probe = {**scope, "method": method}
        if any(route.matches(probe)[0] == Match.FULL for route in routes):
            allowed.add(method)
    if "GET" in allowed:
        allowed.add("HEAD")  # HeadMiddleware
    return [method for method in KNOWN_METHODS if method in allowed]
