"""The heartbeat configuration a registration answer carries: in etcd mode the summary period grows with the
job, so that a job's summary writes stay bounded (100 a second) however many machines it has."""

from __future__ import annotations

import types
import uuid
from typing import Any

import pytest

from services.root.flows.machines import SUMMARY_WRITES_PER_S, heartbeat_config
from services.root.settings import Settings


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
