"""An agent that aligns its replication rounds (the default; CASTOR_REPLICATION_ALIGN=0 turns it off) hears
the job's alignment from a long poll as it changes and heartbeats at once when its own part changed
(worker_lib.agent.services, services.root.flows.alignment), rather than a heartbeat period later each way: an
aligned round's steps (the last machine done, the proposal, the pins, the go) each waited for a heartbeat
before."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.cli import build_parser
from tests.unit.worker_lib.helpers import until
from worker_lib.agent import services as services_module
from worker_lib.agent.cli import run
from worker_lib.agent.replication import ALIGN_ENV, aligned_rounds
from worker_lib.agent.services import MachineIdentity, MachineServices
from worker_lib.api.worker import HeartbeatResponse, ReplicationAlignment
from worker_lib.client import RootRejected

INTERVAL_S = (
    30.0  # the heartbeat period: far longer than the test, so every heartbeat after the first is eager
)


class Root:
    """The heartbeat and the alignment poll as the agent calls them."""

    job_id = "job"

    def __init__(self) -> None:
        self.heartbeats = 0
        self.answers: asyncio.Queue[ReplicationAlignment | Exception | None] = asyncio.Queue()
        self.heard: list[ReplicationAlignment | None] = []
        self.waits: list[float] = []
        self.cancelled = 0  # polls the agent gave up waiting for

    async def heartbeat(self, rank: int, instance_id: str, summary: Any) -> HeartbeatResponse:
        self.heartbeats += 1
        return HeartbeatResponse(state="healthy", job_state="running", plan_generation=1, peers=[])

    async def replication_alignment(
        self, heard: ReplicationAlignment | None, wait_s: float = 5.0
    ) -> ReplicationAlignment | None:
        self.heard.append(heard)
        self.waits.append(wait_s)
        try:
            answer = await self.answers.get()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def directive(self, after: int, wait_s: float = 10.0, machine: int | None = None) -> Any:
        raise AssertionError("the peers are known: no directive fetch")


class Replicator:
    """What the agent calls on its replicator for the alignment."""

    def __init__(self) -> None:
        self.aligned: list[tuple[int | None, int | None, bool]] = []
        self.unaligned = 0
        self.aligns = True
        self.answers_pushed = False
        self.on_alignment_change: Any = None
        self.on_rehear: Any = None

    def unalign(self) -> None:
        self.unaligned += 1

    def align(self, aligned: int | None, target: int | None, go: bool) -> None:
        self.aligned.append((aligned, target, go))


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[MachineServices, Root, Replicator]:
    monkeypatch.delenv(ALIGN_ENV, raising=False)  # aligned rounds are the default
    monkeypatch.setattr(services_module, "ALIGNMENT_RETRY_S", 0.01)
    root = Root()
    client: Any = root
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")
    placement = SimpleNamespace(ranks=[SimpleNamespace(sends_to=[1]), SimpleNamespace(sends_to=[0])])
    services.registration = SimpleNamespace(  # type: ignore[assignment]
        rank=0,
        machines=2,
        directive_wait_s=10.0,
        placement=placement,
        heartbeat=SimpleNamespace(mode="rest", interval_s=INTERVAL_S, timeout_s=90.0),
    )
    services.addresses = {1: ("10.0.0.2", 7000)}
    services.long_poll_answered_at = float("inf")  # the directive long poll keeps the peers current
    replicator = Replicator()
    services.replicator = replicator  # type: ignore[assignment]
    services.summary = lambda: {}  # type: ignore[method-assign]
    return services, root, replicator


async def test_each_alignment_heard_is_acted_on_and_asked_past(
    agent: tuple[MachineServices, Root, Replicator],
) -> None:
    services, root, replicator = agent
    task = asyncio.create_task(services.heartbeats())
    try:
        await until(lambda: len(root.heard) == 1)
        assert root.heard[0] is None  # nothing heard yet
        first = ReplicationAlignment(aligned_iteration=10, target=14, go=False)
        await root.answers.put(first)
        await until(lambda: len(root.heard) == 2)
        assert replicator.aligned == [(10, 14, False)]
        assert root.heard[1] == first, "the next poll waits for something other than what was heard"
        await root.answers.put(ReplicationAlignment(aligned_iteration=10, target=14, go=True))
        await until(lambda: replicator.aligned[-1:] == [(10, 14, True)])
        unaligned = replicator.unaligned
        await root.answers.put(None)  # the job does not align (any more): free rounds
        await until(lambda: len(root.heard) == 4)
        assert (
            len(replicator.aligned) == 2 and replicator.unaligned == unaligned + 1 and root.heard[3] is None
        )
    finally:
        task.cancel()


async def test_a_change_of_its_own_part_is_heartbeated_at_once(
    agent: tuple[MachineServices, Root, Replicator],
) -> None:
    services, root, replicator = agent
    task = asyncio.create_task(services.heartbeats())
    try:
        await until(lambda: root.heartbeats == 1 and replicator.on_alignment_change is not None)
        await asyncio.sleep(0.2)
        assert root.heartbeats == 1  # the next one is due in INTERVAL_S
        # The replicator's coordinator thread says its part changed (a round done, a proposal, a pin).
        threading.Thread(target=replicator.on_alignment_change).start()
        await until(lambda: root.heartbeats == 2)
    finally:
        task.cancel()


async def test_asked_to_hear_the_alignment_again_it_gives_up_the_poll_and_reads_it_as_it_is(
    agent: tuple[MachineServices, Root, Replicator],
) -> None:
    """The replicator declined a target while training looked stopped, and training went on: the alignment
    has not changed (the other machines wait for this one), so the waiting poll would answer only when it
    times out. The agent cancels it and reads the alignment as it is, then polls past that answer."""
    services, root, replicator = agent
    task = asyncio.create_task(services.heartbeats())
    try:
        await until(lambda: len(root.heard) == 1)
        first = ReplicationAlignment(aligned_iteration=10, target=14, go=False)
        await root.answers.put(first)
        await until(lambda: len(root.heard) == 2 and replicator.on_rehear is not None)
        assert root.heard[1] == first and root.cancelled == 0  # waiting for a change
        threading.Thread(target=replicator.on_rehear).start()  # from the coordinator's thread
        await until(lambda: len(root.heard) == 3)
        assert root.cancelled == 1, "the waiting poll was not given up"
        assert root.heard[2] is None and root.waits[2] == 0, "not read as it is, at once"
        await root.answers.put(first)  # unchanged: the same answer, acted on again
        await until(lambda: len(root.heard) == 4)
        assert replicator.aligned == [(10, 14, False), (10, 14, False)]
        assert root.heard[3] == first and root.waits[3] > 0  # polling past it again
    finally:
        task.cancel()


async def test_a_root_without_the_poll_leaves_the_alignment_to_the_heartbeats(
    agent: tuple[MachineServices, Root, Replicator],
) -> None:
    services, root, _ = agent
    task = asyncio.create_task(services.heartbeats())
    try:
        await until(lambda: len(root.heard) == 1)
        await root.answers.put(RootRejected(404, "not_found", "no such route"))
        await asyncio.sleep(0.2)
        assert len(root.heard) == 1, "not asked again"
        assert not task.done()  # the heartbeats go on
    finally:
        task.cancel()


async def test_an_agent_told_not_to_align_neither_polls_nor_acts_on_heartbeat_answers(
    agent: tuple[MachineServices, Root, Replicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALIGN_ENV, "0")
    services, root, replicator = agent
    answer = HeartbeatResponse(
        state="healthy",
        job_state="running",
        plan_generation=1,
        peers=[],
        replication=ReplicationAlignment(aligned_iteration=3, target=5, go=True),
    )
    answered: list[HeartbeatResponse] = []

    async def heartbeat(rank: int, instance_id: str, summary: Any) -> HeartbeatResponse:
        answered.append(answer)
        return answer

    root.heartbeat = heartbeat  # type: ignore[method-assign]
    task = asyncio.create_task(services.heartbeats())
    try:
        await until(lambda: len(answered) == 1)
        await asyncio.sleep(0.2)
        assert root.heard == [] and replicator.on_alignment_change is None
        assert replicator.aligned == [], "free rounds: the root's alignment is not followed"
        assert replicator.aligns is False, "its summary says so: the root aligns none of the job"
    finally:
        task.cancel()


@pytest.mark.parametrize("value", ["maybe", "2", "enabled"])
def test_the_agent_refuses_a_value_it_does_not_know_before_it_starts(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALIGN_ENV, value)
    monkeypatch.setenv("CASTOR_WORKER_TOKEN", "castor-job.00ff.secret")
    args = build_parser().parse_args(["agent", "--root", "http://r", "--job", "j", "--", "python"])
    with pytest.raises(SystemExit, match=f"{ALIGN_ENV}='{value}': give 1 .* or 0"):
        run(args)


@pytest.mark.parametrize(
    ("value", "aligned"), [("", True), ("1", True), (" On ", True), ("0", False), ("off", False)]
)
def test_the_values_it_knows(value: str, aligned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALIGN_ENV, value)
    assert aligned_rounds() is aligned
