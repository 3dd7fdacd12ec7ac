"""Session-wide real services, started lazily the first time a test needs them and stopped at the end."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests import harness

os.environ.update(harness.AWS_TEST_ENV)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[harness.Postgres]:
    with harness.postgres() as server:
        yield server


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[harness.Etcd]:
    with harness.etcd() as server:
        yield server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[harness.Moto]:
    with harness.moto() as server:
        yield server
