from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import LocalCluster

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    local = LocalCluster(tmp_path)
    yield local
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        # Keep the processes' logs of a failed run where CI can find them.
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"{request.node.name}.log").write_text(local.logs(tail=200))
    local.close()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
