"""Who may read the status pages: whoever holds the admin token.

The login form checks the token (constant-time) and sets a cookie. The cookie does not hold the token
itself but a value derived from it (HMAC-SHA256 keyed by the token): it opens the pages only, never the
API, and rotating the admin token logs every browser out. The cookie is HttpOnly, SameSite=Strict (no
other site can make a browser send it), Secure when the page was served over HTTPS. A request with
`Authorization: Bearer <admin token>` is let in too (curl, scripts).
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import quote, urlsplit

from fastapi import Request, Response

from services.root.tokens import same_token

COOKIE = "castor_session"
COOKIE_MAX_AGE_S = 7 * 24 * 3600
_SESSION_CONTEXT = b"castor status pages v1"


class LoginRequired(Exception):
    """Raised by page routes; answered with a 303 to the login form."""

    def __init__(self, next_path: str):
        super().__init__(next_path)
        self.next_path = next_path


def session_value(admin_token: str) -> str:
    return "v1." + hmac.new(admin_token.encode(), _SESSION_CONTEXT, hashlib.sha256).hexdigest()


def is_authenticated(request: Request, admin_token: str) -> bool:
    cookie = request.cookies.get(COOKIE)
    if cookie is not None and hmac.compare_digest(cookie.encode(), session_value(admin_token).encode()):
        return True
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(credentials) and same_token(credentials.strip(), admin_token)


def safe_next(value: str | None) -> str:
    """`value` if it is a path on this site, else "/": the login never redirects anywhere else."""
    if not value or len(value) > 2000:
        return "/"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value) or "\\" in value:
        return "/"
    if not value.startswith("/") or value.startswith("//"):
        return "/"
    parts = urlsplit(value)
    if parts.scheme or parts.netloc:
        return "/"
    if parts.path.startswith(("/login", "/logout")):
        return "/"
    return value


def login_url(next_path: str) -> str:
    target = safe_next(next_path)
    return "/login" if target == "/" else "/login?next=" + quote(target, safe="/")


def requested_path(request: Request) -> str:
    query = request.url.query
    return request.url.path + ("?" + query if query else "")


def set_session(response: Response, request: Request, admin_token: str) -> None:
    response.set_cookie(
        COOKIE,
        session_value(admin_token),
        max_age=COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )
