"""Errors that are not the client's fault still answer in the one error shape: a database conflict that a
retry resolves, or a pool with no connection free, is a 503 with Retry-After, anything else a 500 without
internals."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from services.root.db.database import is_transient_conflict
from services.root.errors import install_error_handlers


class _DriverError(Exception):
    def __init__(self, message: str, sqlstate: str | None = None):
        super().__init__(message)
        self.sqlstate = sqlstate


def _database_error(message: str, sqlstate: str | None = None) -> OperationalError:
    return OperationalError("UPDATE jobs ...", {}, _DriverError(message, sqlstate))


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (_database_error("deadlock detected", "40P01"), True),
        (_database_error("could not serialize access", "40001"), True),
        (_database_error("database is locked"), True),
        (_database_error("relation does not exist", "42P01"), False),
        (ValueError("not a database error"), False),
    ],
)
def test_transient_conflicts_are_told_apart(error: Exception, transient: bool) -> None:
    assert is_transient_conflict(error) is transient


async def test_conflicts_answer_503_and_faults_500_in_the_error_shape() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/deadlock")
    async def deadlock() -> None:
        raise _database_error("deadlock detected", "40P01")

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("secret internals")

    @app.get("/busy")
    async def busy() -> None:
        raise PoolTimeout("QueuePool limit of size 10 overflow 20 reached, connection timed out")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://castor.test") as client:
        conflict = await client.get("/deadlock")
        assert conflict.status_code == 503 and conflict.headers["retry-after"] == "1"
        assert conflict.json()["error"]["code"] == "retry"
        overloaded = await client.get("/busy")  # every pooled connection busy: a 503, not a fault
        assert overloaded.status_code == 503 and overloaded.headers["retry-after"] == "1"
        assert overloaded.json()["error"]["code"] == "overloaded"
        fault = await client.get("/bug")
        assert fault.status_code == 500
        assert fault.json()["error"]["code"] == "internal_error"
        assert "secret" not in fault.text
