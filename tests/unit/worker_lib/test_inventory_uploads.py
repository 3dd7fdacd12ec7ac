"""An agent's inventory names the uploads it has in flight, in the shape the root accepts, and never a stale
list: the report sent again after the background checks names what is in flight then."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from worker_lib.agent.agent import Agent
from worker_lib.api.worker import InventoryReport
from worker_lib.client import RootRejected


def agent_uploading(in_flight: list[dict[str, int]]) -> Agent:
    agent = Agent.__new__(Agent)  # only the inventory's body is under test: no services started
    agent.machine = SimpleNamespace(  # type: ignore[assignment]
        uploads=SimpleNamespace(in_flight=lambda: list(in_flight)),
        machine_rank=0,
        registered=SimpleNamespace(directive_wait_s=1.0),
    )
    agent._directive_revision = 0
    return agent


BODY: dict[str, Any] = {"instance_id": "i-0", "generation": 2, "holdings": [], "rendezvous_port": 29500}


def test_the_inventory_names_the_uploads_in_flight_and_the_root_accepts_it() -> None:
    in_flight = [{"rank": 0, "iteration": 40, "generation": 1}, {"rank": 1, "iteration": 40, "generation": 1}]
    body = agent_uploading(in_flight)._with_uploads(BODY)
    report = InventoryReport.model_validate(body)
    assert [(u.rank, u.iteration, u.generation) for u in report.uploading] == [(0, 40, 1), (1, 40, 1)]


def test_a_report_sent_again_drops_uploads_that_arrived_since() -> None:
    first = agent_uploading([{"rank": 0, "iteration": 40, "generation": 1}])._with_uploads(BODY)
    again = agent_uploading([])._with_uploads(first)
    assert (
        "uploading" in first and "uploading" not in again
    )  # none: the field an older root lacks is left out
    assert InventoryReport.model_validate(again).uploading == []


async def test_a_root_that_refuses_the_field_gets_the_inventory_without_it() -> None:
    """A root older than `uploading` answers 422 (its report model forbids unknown fields): the agent
    reports again without it. Before, the report was lost and the root declared the machine failed for not
    reporting its inventory."""
    sent: list[dict[str, Any]] = []

    class OlderRoot:
        async def report_inventory(self, rank: int, body: dict[str, Any], **_: Any) -> None:
            sent.append(body)
            if "uploading" in body:
                raise RootRejected(422, "validation_error", "invalid request: body.uploading: extra inputs")

    agent = agent_uploading([{"rank": 0, "iteration": 40, "generation": 1}])
    agent.client = OlderRoot()  # type: ignore[assignment]
    await agent._send_inventory(2, agent._with_uploads(BODY))
    assert ["uploading" in body for body in sent] == [True, False]
    assert sent[1] == BODY


async def test_a_refusal_about_something_else_is_not_sent_again() -> None:
    sent: list[dict[str, Any]] = []

    class Refusing:
        async def report_inventory(self, rank: int, body: dict[str, Any], **_: Any) -> None:
            sent.append(body)
            raise RootRejected(422, "validation_error", "invalid request: body.holdings.0.digest: too long")

    agent = agent_uploading([{"rank": 0, "iteration": 40, "generation": 1}])
    agent.client = Refusing()  # type: ignore[assignment]
    with pytest.raises(RootRejected):
        await agent._report(agent._with_uploads(BODY))
    assert len(sent) == 1
