"""Alembic migrations, applied at start-up or by `castor db upgrade`; safe when replicas start together.

Postgres: env.py takes a transaction-scoped advisory lock before reading the current revision, so a second
replica waits and then finds the schema already at head. SQLite: a file lock beside the database file does
the same for several processes on one machine.
"""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import make_url

# A wheel carries migrations/ inside the package (setup.py copies it there); an editable install or a
# checkout reads it at the repository root.
_PACKAGED = Path(__file__).resolve().parent / "migrations"
MIGRATIONS_DIR = _PACKAGED if _PACKAGED.is_dir() else Path(__file__).resolve().parents[3] / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    with _sqlite_migration_lock(database_url):
        _without_event_loop(command.upgrade, alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    with _sqlite_migration_lock(database_url):
        _without_event_loop(command.downgrade, alembic_config(database_url), revision)


async def upgrade_async(database_url: str) -> None:
    await asyncio.to_thread(upgrade, database_url)


def _without_event_loop(function: Callable[..., None], *args: object) -> None:
    """env.py runs its own event loop (asyncio.run); from inside a running loop, use another thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        function(*args)
        return
    with ThreadPoolExecutor(1) as pool:
        pool.submit(function, *args).result()


@contextmanager
def _sqlite_migration_lock(database_url: str) -> Iterator[None]:
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        yield
        return
    db_path = Path(url.database)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db_path}.migrate.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
