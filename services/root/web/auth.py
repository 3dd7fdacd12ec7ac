"""Who may read the status pages: whoever holds the admin token.

The login form checks the token (constant-time) and opens a server-side session: a random session id in the
cookie, only its SHA-256 in the database (`web_sessions`), with the admin token's fingerprint and an expiry
(7 days). A session is valid while its row exists, has not expired and names the current admin token, so
logging out (POST /logout deletes the row) ends it for good even if the cookie was copied, and rotating the
admin token signs every browser out. The cookie opens the pages only, never the API; it is HttpOnly,
SameSite=Strict (no other site can make a browser send it), Secure when the page was served over HTTPS. A
request with `Authorization: Bearer <admin token>` is let in too (curl, scripts).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import UTC, datetime, timedelta
from urllib.parse import quote, urlsplit

from fastapi import Request, Response
from sqlalchemy import delete, or_
from sqlalchemy.ext.asyncio import AsyncSession

from services.root.db.models import WebSession
from services.root.tokens import same_token

COOKIE = "castor_session"
COOKIE_MAX_AGE_S = 7 * 24 * 3600
_COOKIE_PREFIX = "v2."
_FINGERPRINT_CONTEXT = b"castor admin token fingerprint v1\x00"


class LoginRequired(Exception):
    """Raised by page routes; answered with a 303 to the login form."""

    def __init__(self, next_path: str):
        super().__init__(next_path)
        self.next_path = next_path


def token_fingerprint(admin_token: str) -> str:
    """Names the admin token without revealing it (the token is random and long, so a plain hash is
    enough); a session opened with another token does not match."""
    return hashlib.sha256(_FINGERPRINT_CONTEXT + admin_token.encode()).hexdigest()


def _session_hash(cookie: str | None) -> str | None:
    if not cookie or not cookie.startswith(_COOKIE_PREFIX) or len(cookie) > 200:
        return None
    return hashlib.sha256(cookie.encode()).hexdigest()


def bearer_is_admin(request: Request, admin_token: str) -> bool:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(credentials) and same_token(credentials.strip(), admin_token)


async def is_authenticated(request: Request, db: AsyncSession, admin_token: str) -> bool:
    if bearer_is_admin(request, admin_token):
        return True
    id_hash = _session_hash(request.cookies.get(COOKIE))
    if id_hash is None:
        return False
    # Looked up by the hash of a 256-bit random id: no timing to learn from, nothing to compare by hand.
    row = await db.get(WebSession, id_hash)
    return (
        row is not None
        and row.expires_at > datetime.now(UTC)
        and row.token_fingerprint == token_fingerprint(admin_token)
    )


async def open_session(db: AsyncSession, admin_token: str) -> str:
    """A new session for whoever just gave the admin token; returns the cookie value. Sessions that expired
    or belong to an older admin token are dropped on the way, so the table stays small."""
    now = datetime.now(UTC)
    fingerprint = token_fingerprint(admin_token)
    await db.execute(
        delete(WebSession).where(
            or_(WebSession.expires_at <= now, WebSession.token_fingerprint != fingerprint)
        )
    )
    cookie = _COOKIE_PREFIX + secrets.token_urlsafe(32)
    db.add(
        WebSession(
            id_hash=hashlib.sha256(cookie.encode()).hexdigest(),
            token_fingerprint=fingerprint,
            created_at=now,
            expires_at=now + timedelta(seconds=COOKIE_MAX_AGE_S),
        )
    )
    return cookie


async def close_session(request: Request, db: AsyncSession) -> None:
    """Forget the request's session server-side: its cookie, copied or not, opens nothing any more."""
    id_hash = _session_hash(request.cookies.get(COOKIE))
    if id_hash is not None:
        await db.execute(delete(WebSession).where(WebSession.id_hash == id_hash))


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


def set_session_cookie(response: Response, request: Request, cookie: str) -> None:
    response.set_cookie(
        COOKIE,
        cookie,
        max_age=COOKIE_MAX_AGE_S,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(
        COOKIE, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )
