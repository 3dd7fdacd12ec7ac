"""The heartbeat configuration a registration answer carries: in etcd mode the summary period grows with the
job, so that a job's summary writes stay bounded (100 a second) however many machines it has; likewise the
directive long poll's wait, so that a job's idle long polls answer at a bounded rate."""

from __future__ import annotations

import types
import uuid
from typing import Any

import pytest

from services.root.domain.persist_schedule import lead_iterations
from services.root.flows.machines import (
    DIRECTIVE_ANSWERS_PER_S,
    DIRECTIVE_WAIT_MAX_S,
    SUMMARY_WRITES_PER_S,
    directive_wait_s,
    heartbeat_config,
    persist_latency_s,
)
from services.root.settings import Settings
from worker_lib.api.worker import RegisterResponse


def job(machines: int) -> Any:
    return types.SimpleNamespace(id=uuid.uuid4(), num_machines=machines)


@pytest.mark.parametrize(("machines", "period_s"), [(4, 2.0), (200, 2.0), (1000, 10.0), (4096, 40.96)])
def test_the_etcd_summary_period_keeps_a_jobs_writes_bounded(machines: int, period_s: float) -> None:
    settings = Settings(etcd_endpoints=["127.0.0.1:2379"])
    config = heartbeat_config(job(machines), 0, "i-0", settings)
    assert config.mode == "etcd" and config.summary_period_s == pytest.approx(period_s)
    assert machines / config.summary_period_s <= SUMMARY_WRITES_PER_S


def test_rest_heartbeats_carry_their_summary_in_every_request() -> None:
    config = heartbeat_config(job(1000), 0, "i-0", Settings())
    assert config.mode == "rest" and config.interval_s == Settings().heartbeat_interval_s


@pytest.mark.parametrize("machines", [4, 1000, 4096])
@pytest.mark.parametrize("etcd", [True, False])
def test_the_persist_lead_covers_how_old_a_summary_can_be(machines: int, etcd: bool) -> None:
    """The root announces the iteration every rank persists from the newest reported iterations plus the
    fastest rank's progress over persist_latency_s; under etcd a summary is up to its period old (10 s at
    1,000 machines), and a lead shorter than that announces iterations the ranks already overwrote."""
    settings = Settings(etcd_endpoints=["127.0.0.1:2379"] if etcd else [])
    config = heartbeat_config(job(machines), 0, "i-0", settings)
    summary_age_s = config.summary_period_s if etcd else config.interval_s
    assert summary_age_s is not None
    assert persist_latency_s(settings, machines) > summary_age_s
    # 60 iterations a minute: the lead (iterations ahead of the newest report) spans the summary's age.
    assert lead_iterations(60.0, persist_latency_s(settings, machines)) > summary_age_s


@pytest.mark.parametrize(
    ("machines", "wait_s"), [(1, 10.0), (500, 10.0), (1000, 20.0), (1500, 30.0), (8000, 30.0)]
)
def test_the_directive_long_polls_wait_grows_with_the_job(machines: int, wait_s: float) -> None:
    assert directive_wait_s(machines) == pytest.approx(wait_s)
    if wait_s < DIRECTIVE_WAIT_MAX_S:
        assert machines / directive_wait_s(machines) <= DIRECTIVE_ANSWERS_PER_S
    # Within what the directive endpoint accepts (wait <= 60), as the agent's registration model checks.
    field = RegisterResponse.model_fields["directive_wait_s"]
    assert field.default == directive_wait_s(1)
