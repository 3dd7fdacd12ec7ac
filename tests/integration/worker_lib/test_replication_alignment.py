"""Replication aligned across machines (issue 11, item 2), on real sockets with senders at different paces.

Three machines of two ranks each replicate in a ring (machine m's holder is m + 1). Their links differ: one
sender takes no wait, one sends a stripe per commit, one a stripe every two commits, so left alone each
machine's rounds complete at their own pace and pin their own iterations. The root's alignment (the pure
function the heartbeat route answers with, fed here with the replicators' own summaries after every
iteration, as heartbeats would) makes them replicate the same iterations: at every iteration, whichever
machine is lost, one iteration exists for every rank locally on the survivors and in the lost machine's
replicas on its holder; the recovery planner picks such an iteration from the survivors' inventories,
with no rank sent to the persistent tier, and every copy it picks has the digest the training process
committed.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.root.domain.recovery import MemoryCopy, plan_recovery
from services.root.domain.replication import ReplicationAlignment, replication_alignment
from tests.integration.web.scenario import running_job
from worker_lib import Checkpointer
from worker_lib.agent.dataplane import DataPlaneServer, PeerConnection, data_plane_key
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.replication import Replicator
from worker_lib.store.slots import SlotStore

JOB = "job-under-test"
KEY = data_plane_key("castor-job.abc.secret")
MACHINES = 3
PROCS = 2  # ranks per machine
NUMEL = 2 << 19  # float32 values: two 2 MiB stripes per checkpoint
EVERY = {0: 0, 1: 1, 2: 2}  # sender machine -> commits it waits for before each stripe


def holder(machine: int) -> int:
    return (machine + 1) % MACHINES


def ranks_of(machine: int) -> list[int]:
    return [machine * PROCS + p for p in range(PROCS)]


class Pace:
    """Each sender takes a stripe only after its machine's share of commits (the training loop's)."""

    def __init__(self) -> None:
        self.commits = 0
        self.open = False
        self.condition = threading.Condition()

    def commit(self) -> None:
        with self.condition:
            self.commits += 1
            self.condition.notify_all()

    def release(self) -> None:
        with self.condition:
            self.open = True
            self.condition.notify_all()

    def wait(self, commits: int) -> None:
        with self.condition:
            seen = self.commits
            self.condition.wait_for(lambda: self.open or self.commits >= seen + commits, timeout=60)


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pace(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pace]:
    pace = Pace()
    send = PeerConnection._send_unless

    def paced_send(self: PeerConnection, superseded: Callable[[], bool], view: memoryview) -> bool:
        # Sender threads are named castor-replicate-to-<machine>-<stream>: the sender is its ring predecessor.
        target = int(threading.current_thread().name.split("-")[3])
        pace.wait(EVERY[(target - 1) % MACHINES])
        return send(self, superseded, view)

    monkeypatch.setattr(PeerConnection, "_send_unless", paced_send)
    yield pace
    pace.release()


def committed(directory: Path) -> set[int]:
    if not directory.is_dir():
        return set()
    store = SlotStore(directory)  # its own object: the agent's threads use the holdings' stores
    try:
        return {m.iteration for m in store.committed()}
    finally:
        store.close()


def state(rank: int, iteration: int) -> dict[str, Any]:
    return {"w": torch.full((NUMEL,), float(iteration * 10 + rank)), "step": iteration}


def common_after_losing(lost: int, holdings: list[Holdings]) -> set[int]:
    """Iterations every rank has on a survivor: survivors' ranks locally, the lost machine's on its holder."""
    sets = [
        committed(holdings[machine].directory("local", rank))
        for machine in range(MACHINES)
        if machine != lost
        for rank in ranks_of(machine)
    ]
    sets += [committed(holdings[holder(lost)].directory("replica", rank)) for rank in ranks_of(lost)]
    return set.intersection(*sets)


def heartbeats(replicators: list[Replicator]) -> ReplicationAlignment:
    """A heartbeat round: every machine's summary to the root, the root's answer back."""
    alignment = replication_alignment([r.summary() for r in replicators])
    assert alignment is not None
    for replicator in replicators:
        replicator.align(alignment.aligned_iteration, alignment.target, alignment.go)
    return alignment


def test_machines_at_different_paces_keep_one_iteration_for_every_rank_locally_and_on_the_holders(
    shm: Path, pace: Pace
) -> None:
    holdings = [Holdings(shm / f"machine-{m}") for m in range(MACHINES)]
    servers = [DataPlaneServer(h, KEY, JOB, host="127.0.0.1").start() for h in holdings]
    replicators = []
    for machine in range(MACHINES):
        holdings[machine].prepare_local(ranks_of(machine), 4)  # as the agent does (CASTOR_LOCAL_SLOTS)
        port = servers[holder(machine)].port
        replicators.append(
            Replicator(
                holdings[machine],
                KEY,
                JOB,
                [holder(machine)],
                lambda _, port=port: ("127.0.0.1", port),
                streams=1,
            ).start()
        )
    checkpointers = {
        rank: Checkpointer(holdings[m].directory("local", rank), blocking=True)
        for m in range(MACHINES)
        for rank in ranks_of(m)
    }
    heartbeats(replicators)  # the agents heartbeat from their registration on, before training commits
    digests: dict[tuple[int, int], str] = {}
    aligned_seen: list[int] = []
    try:
        for iteration in range(1, 400):
            for machine in range(MACHINES):
                for rank in ranks_of(machine):
                    assert checkpointers[rank].save(iteration, state(rank, iteration))
                    newest = holdings[machine].newest("local", rank)
                    assert newest is not None and newest.iteration == iteration
                    digests[(rank, iteration)] = newest.digest
                    replicators[machine].notice_commit(rank, iteration)
            alignment = heartbeats(replicators)
            pace.commit()
            aligned = alignment.aligned_iteration
            if aligned is None:
                continue  # until the first aligned round completed everywhere, rounds run free
            for lost in range(MACHINES):
                common = common_after_losing(lost, holdings)
                assert common, (
                    f"iteration {iteration}: losing machine {lost} leaves no iteration in memory for every "
                    f"rank (fully replicated: {[r.stats.replicated_iteration for r in replicators]})"
                )
                assert aligned in common, (aligned, sorted(common))
            if not aligned_seen or aligned_seen[-1] != aligned:
                aligned_seen.append(aligned)
            if len(aligned_seen) >= 4:
                break
        assert len(aligned_seen) >= 4, f"the aligned iteration advances: {aligned_seen}"
        rounds = [r.stats.rounds for r in replicators]
        assert min(rounds) >= 3, rounds
    finally:
        pace.release()
        for checkpointer in checkpointers.values():
            checkpointer.close()
        for replicator in replicators:
            replicator.stop()
    try:
        # A machine is lost (each in turn): the planner, from the survivors' verified inventories, finds an
        # iteration in memory for every rank, as new as the aligned one, never the persistent tier.
        for lost in range(MACHINES):
            copies = [
                MemoryCopy(h.rank, h.iteration, machine, h.digest, bool(h.verified), h.generation)
                for machine in range(MACHINES)
                if machine != lost
                for h in holdings[machine].inventory(verify_checksums=True)
            ]
            decision = plan_recovery(
                world_size=MACHINES * PROCS,
                procs_per_machine=PROCS,
                live_machines=range(MACHINES),  # a replacement takes the lost machine's place, empty
                copies=copies,
                persisted=[],
                resumed_from={},
                reached=iteration,
            )
            assert decision.iteration is not None and decision.iteration >= aligned_seen[-1], decision
            assert {s.tier for s in decision.sources} <= {"local", "peer"}, decision
            for source in decision.sources:
                if source.rank in ranks_of(lost):
                    assert source.tier == "peer" and source.machine == holder(lost), source
                assert source.digest == digests[(source.rank, decision.iteration)], "bit-exact, as committed"
    finally:
        for server in servers:
            server.stop()
        for h in holdings:
            h.close()


async def test_the_heartbeat_answers_with_the_jobs_alignment(client: httpx.AsyncClient) -> None:
    """The root's side, through the heartbeat route: every live machine's last summary counts."""
    job = await running_job(client, machines=2)

    async def beat(rank: int, kept: list[int], proposed: int | None, ready: bool) -> Any:
        summary = {
            "local": {str(rank): 30},
            "replication_kept": kept,
            "replication_next": proposed,
            "replication_ready": ready,
            "replication_generation": 1,
        }
        body = {"instance_id": job.instances[rank], "summary": summary}
        return (await job.post(f"/machines/{rank}/heartbeat", body, 200)).json()["replication"]

    # Machine 1 has not reported replicating yet (a machine with no peer never does): machine 0 alone counts.
    assert await beat(0, [10, 20], 24, True) == {"aligned_iteration": 20, "target": 24, "go": True}
    assert await beat(1, [10], 26, False) == {"aligned_iteration": 10, "target": 26, "go": False}
    assert await beat(0, [10, 20], 26, True) == {"aligned_iteration": 10, "target": 26, "go": False}
    assert await beat(1, [10], 26, True) == {"aligned_iteration": 10, "target": 26, "go": True}
    await job.post(
        "/machines/0/heartbeat",
        {"instance_id": job.instances[0], "summary": {"replication_kept": ["x"]}},
        422,
    )
