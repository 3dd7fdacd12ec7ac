"""Session-wide real services, started lazily the first time a test needs them and stopped at the end;
the local cluster of the multi-process tests (e2e, browser), whose logs a failed test leaves in
test-artifacts/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import harness
from tests.e2e.cluster import LocalCluster, keep_logs

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


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path)
    yield local
    try:
        keep_logs(request, local.logs(tail=200))
    finally:
        local.close()


E2E = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every e2e test runs in ./scripts/test's one-at-a-time part (`-m serial`), beside the tests that
    mark themselves `serial`."""
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.serial)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)  # lets fixtures see whether their test failed
    return report
