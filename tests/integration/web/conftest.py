from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import ADMIN_TOKEN


@pytest.fixture
async def signed_in(client: httpx.AsyncClient) -> httpx.AsyncClient:
    """The test client with a session cookie from the login form."""
    response = await client.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    assert response.status_code == 303, response.text
    return client
