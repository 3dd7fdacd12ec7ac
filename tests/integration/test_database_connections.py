"""The root does not ping a pooled Postgres connection before each use (with asyncpg that is three round
trips per request). A connection that died meanwhile (Postgres restarted or failed over) fails one
transaction instead: the pool is dropped, the request is answered 503 `retry` in the API's error shape,
never a 500, and the next transaction connects afresh."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError

from services.root.db.database import Database
from services.root.errors import install_error_handlers
from tests import harness


async def test_a_dead_pooled_connection_fails_one_transaction_and_the_next_reconnects(
    postgres_server: harness.Postgres,
) -> None:
    name = f"conn_{uuid.uuid4().hex[:8]}"
    database = Database(postgres_server.create_database(name))
    try:
        async with database.session() as session:
            assert (await session.execute(text("SELECT 1"))).scalar_one() == 1
        # Every connection of that database dies, as in a Postgres restart; the pool still holds one.
        postgres_server.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        )
        with pytest.raises(DBAPIError) as lost:
            async with database.session() as session:
                await session.execute(text("SELECT 1"))
        assert lost.value.connection_invalidated, "a disconnect, which the API answers with 503 retry"

        async with database.session() as session:
            assert (await session.execute(text("SELECT 2"))).scalar_one() == 2
    finally:
        await database.dispose()


async def test_a_lost_connection_is_answered_503_retry_not_500(postgres_server: harness.Postgres) -> None:
    name = f"conn_{uuid.uuid4().hex[:8]}"
    database = Database(postgres_server.create_database(name))
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/query")
    async def query() -> dict[str, int]:
        async with database.session() as session:
            return {"value": (await session.execute(text("SELECT 7"))).scalar_one()}

    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            assert (await http.get("/query")).json() == {"value": 7}
            postgres_server.psql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
            )
            lost = await http.get("/query")
            assert lost.status_code == 503, lost.text
            assert lost.headers["Retry-After"] == "1"
            assert lost.json()["error"]["code"] == "retry"
            again = await http.get("/query")
            assert again.status_code == 200 and again.json() == {"value": 7}
    finally:
        await database.dispose()


async def test_a_second_burst_of_reports_reuses_the_first_bursts_connections(
    postgres_server: harness.Postgres,
) -> None:
    """A recovery's reports come in bursts of hundreds: the connections a burst opened stay in the pool
    for the next one (an overflow connection was closed as it came back, and the next burst paid for
    asyncpg's handshake again, about a tenth of a 1,000-machine root's event loop)."""
    database = Database(postgres_server.create_database(f"conn_{uuid.uuid4().hex[:8]}"))
    connects = 0

    def count(*_: object) -> None:
        nonlocal connects
        connects += 1

    async def report() -> None:
        async with database.single_statement() as connection:
            await connection.execute(text("SELECT pg_sleep(0.05)"))

    event.listen(database.engine.sync_engine, "connect", count)
    try:
        await asyncio.gather(*(report() for _ in range(25)))
        first = connects
        await asyncio.gather(*(report() for _ in range(25)))
        assert first == 25, "the first burst opens one connection per concurrent report"
        assert connects == first, f"the second burst connected {connects - first} more times"
    finally:
        event.remove(database.engine.sync_engine, "connect", count)
        await database.dispose()
