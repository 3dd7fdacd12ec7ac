"""The status pages sit behind the admin token: a login form, a session cookie, redirects that never
leave the site."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, update

from services.root.db.models import WebSession
from tests.integration.conftest import ADMIN_TOKEN, bearer, create_job


@pytest.mark.parametrize(
    "path",
    ["/", "/?state=running&page=2", f"/jobs/{uuid.UUID(int=1)}", f"/jobs/{uuid.UUID(int=2)}/failures/3"],
)
async def test_pages_without_a_session_redirect_to_the_login_with_next(
    client: httpx.AsyncClient, path: str
) -> None:
    response = await client.get(path)
    assert response.status_code == 303
    location = response.headers["location"]
    parts = urlsplit(location)
    assert parts.path == "/login" and not parts.netloc
    assert parse_qs(parts.query).get("next", ["/"])[0] == path
    assert "castor_session" not in response.headers.get("set-cookie", "")


async def test_login_sets_a_strict_httponly_cookie_that_is_not_the_token(client: httpx.AsyncClient) -> None:
    form = await client.get("/login?next=/jobs/abc")
    assert form.status_code == 200
    assert 'name="token"' in form.text and 'type="password"' in form.text
    assert 'name="next" value="/jobs/abc"' in form.text

    response = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/?state=running"})
    assert response.status_code == 303 and response.headers["location"] == "/?state=running"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith("castor_session=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert ADMIN_TOKEN not in cookie, "the cookie holds a value derived from the token, not the token"

    page = await client.get("/")
    assert page.status_code == 200 and "<h1>Jobs</h1>" in page.text
    # Signed in, the login form sends you on.
    again = await client.get("/login?next=/jobs/x")
    assert again.status_code == 303 and again.headers["location"] == "/jobs/x"

    out = await client.post("/logout")
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert 'castor_session=""' in out.headers["set-cookie"] or "Max-Age=0" in out.headers["set-cookie"]
    assert (await client.get("/")).status_code == 303, "logged out"


async def _sign_in(client: httpx.AsyncClient) -> str:
    response = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    assert response.status_code == 303
    cookie = client.cookies.get("castor_session")
    assert cookie
    return cookie


async def test_logout_revokes_the_session_on_the_server(root_app: FastAPI, client: httpx.AsyncClient) -> None:
    cookie = await _sign_in(client)
    async with root_app.state.castor.database.session() as db:
        stored = (await db.execute(select(WebSession.id_hash))).scalars().all()
    assert len(stored) == 1 and cookie not in stored[0], "only a hash of the session id is stored"
    assert (await client.post("/logout")).status_code == 303
    async with root_app.state.castor.database.session() as db:
        assert (await db.execute(select(WebSession))).scalars().all() == []
    # A copy of the cookie taken before the logout opens nothing any more.
    client.cookies.set("castor_session", cookie, domain="castor.test")
    assert (await client.get("/")).status_code == 303


async def test_logout_needs_a_post(client: httpx.AsyncClient) -> None:
    await _sign_in(client)
    page = await client.get("/logout")
    assert page.status_code == 200
    assert '<form method="post" action="/logout">' in page.text
    assert "set-cookie" not in page.headers
    assert (await client.get("/")).status_code == 200, "a GET (a link, an image elsewhere) signs no one out"
    client.cookies.clear()
    assert (await client.get("/logout")).headers["location"] == "/login"


async def test_rotating_the_admin_token_signs_every_browser_out(
    root_app: FastAPI, client: httpx.AsyncClient
) -> None:
    await _sign_in(client)
    assert (await client.get("/")).status_code == 200
    state = root_app.state.castor
    state.admin_token = ADMIN_TOKEN + "-rotated"
    try:
        assert (await client.get("/")).status_code == 303, "a session of the old token"
        response = await client.post("/login", data={"token": state.admin_token, "next": "/"})
        assert response.status_code == 303
        assert (await client.get("/")).status_code == 200
    finally:
        state.admin_token = ADMIN_TOKEN
    assert (await client.get("/")).status_code == 303, "the new token's session is not the old token's"


async def test_a_session_expires_after_seven_days(root_app: FastAPI, client: httpx.AsyncClient) -> None:
    await _sign_in(client)
    async with root_app.state.castor.database.session() as db:
        (row,) = (await db.execute(select(WebSession))).scalars().all()
        assert timedelta(days=6, hours=23) < row.expires_at - datetime.now(UTC) <= timedelta(days=7)
        await db.execute(update(WebSession).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    assert (await client.get("/")).status_code == 303


async def test_a_wrong_token_is_refused(client: httpx.AsyncClient) -> None:
    response = await client.post("/login", data={"token": ADMIN_TOKEN + "x", "next": "/"})
    assert response.status_code == 401
    assert "That is not the admin token." in response.text
    assert "set-cookie" not in response.headers
    empty = await client.post("/login", data={"next": "/"})
    assert empty.status_code == 401
    assert (await client.get("/")).status_code == 303


async def test_a_forged_cookie_or_a_worker_token_opens_nothing(client: httpx.AsyncClient) -> None:
    client.cookies.set("castor_session", "v1." + "0" * 64, domain="castor.test")
    assert (await client.get("/")).status_code == 303
    client.cookies.set("castor_session", ADMIN_TOKEN, domain="castor.test")
    assert (await client.get("/")).status_code == 303, "the raw token is not a session either"
    client.cookies.clear()
    job = await create_job(client)
    response = await client.get("/", headers=bearer(str(job["worker_token"])))
    assert response.status_code == 303, "a job's worker token is not the admin token"
    # The admin token as a bearer header works, for scripts.
    assert (await client.get("/", headers=bearer(ADMIN_TOKEN))).status_code == 200


@pytest.mark.parametrize(
    "target",
    [
        "https://evil.example/",
        "//evil.example/path",
        "/\\evil.example",
        "\\\\evil.example",
        "javascript:alert(1)",
        "http:/evil.example",
        "/ok\r\nSet-Cookie: x=1",
        "evil.example",
        "/logout",
    ],
)
async def test_login_never_redirects_off_site(client: httpx.AsyncClient, target: str) -> None:
    response = await client.post("/login", data={"token": ADMIN_TOKEN, "next": target})
    assert response.status_code == 303 and response.headers["location"] == "/"
    form = await client.get("/login", params={"next": target})
    assert form.status_code in (200, 303)
    if form.status_code == 303:
        assert form.headers["location"] == "/"
    else:
        assert 'name="next" value="/"' in form.text


async def test_a_local_next_survives_the_round_trip(client: httpx.AsyncClient) -> None:
    path = f"/jobs/{uuid.uuid4()}?x=1&y=2"
    redirect = await client.get(path)
    login_page = await client.get(redirect.headers["location"])
    assert login_page.status_code == 200
    next_value = parse_qs(urlsplit(redirect.headers["location"]).query)["next"][0]
    response = await client.post("/login", data={"token": ADMIN_TOKEN, "next": next_value})
    assert response.headers["location"] == path


async def test_static_assets_are_public_and_pages_carry_security_headers(client: httpx.AsyncClient) -> None:
    css = await client.get("/static/castor.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    js = await client.get("/static/castor.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert (await client.get("/static/../settings.py")).status_code == 404
    assert (await client.get("/static/routes.py")).status_code == 404
    login = await client.get("/login")
    csp = login.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert login.headers["cache-control"] == "no-store"
