"""The peers' addresses ride on the directive long poll's answers: an agent fetches them with a request of its
own only while a peer it sends to has no address, or while its long poll is silent (the agent is busy acting
on a directive). At 1,000 machines a fixed refresh every 10 s was 100 requests a second on the root."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.worker_lib.helpers import until
from worker_lib.agent import services as services_module
from worker_lib.agent.services import MachineIdentity, MachineServices
from worker_lib.api.worker import DirectiveOut

# The long poll's wait, as the root's registration answer gives it: long beside a loaded event loop's stalls.
WAIT_S = 1.0
REFRESH_S = 0.1


def directive(peer_port: int | None, revision: int = 3) -> DirectiveOut:
    peers = [{"rank": 0, "address": "10.0.0.1", "data_port": 7000, "state": "healthy"}]
    if peer_port is not None:
        peers.append({"rank": 1, "address": "10.0.0.2", "data_port": peer_port, "state": "healthy"})
    return DirectiveOut.model_validate(
        {
            "revision": revision,
            "job_state": "running",
            "status": "ready",
            "generation": 1,
            "iteration": None,
            "world_size": 2,
            "procs_per_machine": 1,
            "rendezvous": None,
            "sources": [],
            "machines": peers,
        }
    )


class Root:
    """The root's directive endpoint as the peers' refresh calls it; counts those calls."""

    job_id = "job"

    def __init__(self) -> None:
        self.answer = directive(None)
        self.fetches = 0

    async def directive(self, after: int, wait_s: float = 10.0, machine: int | None = None) -> DirectiveOut:
        assert wait_s == 0 and after == -1, "the refresh asks for the current directive, without waiting"
        self.fetches += 1
        return self.answer


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[MachineServices, Root]:
    monkeypatch.setattr(services_module, "PEERS_REFRESH_S", REFRESH_S)
    monkeypatch.setattr(services_module, "PEERS_REFRESH_MISSING_S", 0.02)
    root = Root()
    client: Any = root
    services = MachineServices(client, "castor-job.x.secret", MachineIdentity("i-0"), tmp_path / "shm")
    placement = SimpleNamespace(ranks=[SimpleNamespace(sends_to=[1]), SimpleNamespace(sends_to=[0])])
    services.registration = SimpleNamespace(  # type: ignore[assignment]
        rank=0, machines=2, directive_wait_s=WAIT_S, placement=placement
    )
    return services, root


async def test_a_peer_without_an_address_is_asked_for_until_it_has_one(
    machine: tuple[MachineServices, Root],
) -> None:
    services, root = machine
    refresh = asyncio.create_task(services._refresh_peers())
    try:
        await until(lambda: root.fetches >= 3)  # peer 1 has not registered: asked for every 20 ms
        assert 1 not in services.addresses
        root.answer = directive(7001)
        await until(lambda: services.addresses.get(1) == ("10.0.0.2", 7001))
    finally:
        refresh.cancel()


async def test_the_long_polls_answers_keep_the_addresses_current_without_requests_of_their_own(
    machine: tuple[MachineServices, Root],
) -> None:
    services, root = machine
    refresh = asyncio.create_task(services._refresh_peers())
    try:
        loop = asyncio.get_running_loop()
        # The long poll answers (unchanged revision, as when its wait is up) every 20 ms, for longer than
        # the wait plus the refresh period: a refresh of its own would have come by now.
        for port in range(7001, 7081):
            services.directive_answered(directive(port, revision=3))
            await asyncio.sleep(0.02)
        assert services.addresses[1] == ("10.0.0.2", 7080), "a peer's new address, from an unchanged revision"
        assert root.fetches == 0, "no refresh of its own while the long poll answers"

        # The long poll goes silent (the agent acts on a directive): the refresh takes over once the long
        # poll has been silent for its wait plus the refresh period, and no sooner. Silent since its last
        # answer, not since now: the loop above slept 20 ms after it (counting from now failed a fresh-clone
        # run by 2 ms).
        silent_since = services.long_poll_answered_at
        assert silent_since is not None
        root.answer = directive(7100)
        await until(lambda: root.fetches >= 1)
        assert loop.time() - silent_since >= WAIT_S + REFRESH_S - 0.01
        assert services.addresses[1] == ("10.0.0.2", 7100)
        await until(lambda: root.fetches >= 3)  # then every refresh period, while the long poll is silent
    finally:
        refresh.cancel()
