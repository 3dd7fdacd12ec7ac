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

import asyncio
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.root.domain.recovery import MemoryCopy, plan_recovery
from services.root.domain.replication import ReplicationAlignment, replication_alignment
from tests.integration.web.scenario import Scenario, running_job
from worker_lib import Checkpointer
from worker_lib.agent.dataplane import DataPlaneServer, PeerConnection, data_plane_key, fetch
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.replication import Replicator
from worker_lib.agent.services import follow
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


async def beat(job: Scenario, rank: int, kept: list[int], proposed: int | None, ready: bool) -> Any:
    """Machine `rank`'s heartbeat with these alignment figures; the root's answer's alignment."""
    summary = {
        "local": {str(rank): 30},
        "replication_kept": kept,
        "replication_next": proposed,
        "replication_ready": ready,
        "replication_generation": 1,
    }
    body = {"instance_id": job.instances[rank], "summary": summary}
    return (await job.post(f"/machines/{rank}/heartbeat", body, 200)).json()["replication"]


async def test_the_heartbeat_answers_with_the_jobs_alignment(client: httpx.AsyncClient) -> None:
    """The root's side, through the heartbeat route: every live machine's last summary counts."""
    job = await running_job(client, machines=2)
    # Machine 1 has not reported replicating yet (a machine with no peer never does): machine 0 alone counts.
    assert await beat(job, 0, [10, 20], 24, True) == {"aligned_iteration": 20, "target": 24, "go": True}
    assert await beat(job, 1, [10], 26, False) == {"aligned_iteration": 10, "target": 26, "go": False}
    assert await beat(job, 0, [10, 20], 26, True) == {"aligned_iteration": 10, "target": 26, "go": False}
    assert await beat(job, 1, [10], 26, True) == {"aligned_iteration": 10, "target": 26, "go": True}
    await job.post(
        "/machines/0/heartbeat",
        {"instance_id": job.instances[0], "summary": {"replication_kept": ["x"]}},
        422,
    )


async def test_an_alignment_poll_is_answered_when_a_heartbeat_changes_the_alignment(
    client: httpx.AsyncClient,
) -> None:
    """The long poll agents that align their rounds follow (services.root.flows.alignment): answered at once
    when the alignment differs from what the agent heard, held while it is the same, and answered when a
    machine's heartbeat changes it (not after the wait asked for)."""
    job = await running_job(client, machines=2)

    async def poll(heard: dict[str, Any], wait: float) -> Any:
        response = await client.get(
            f"/api/v1/worker/jobs/{job.id}/replication-alignment",
            params={**heard, "wait": wait},
            headers=job.worker,
        )
        assert response.status_code == 200, response.text
        return response.json()

    # No machine replicates yet: null, at once whatever was heard.
    assert await poll({}, 0) is None
    await beat(job, 0, [10, 20], 24, True)
    await beat(job, 1, [10], 24, False)
    current = {"aligned_iteration": 10, "target": 24, "go": False}
    # What the agent heard differs from the job's: the newest read at once (which may still be the one after
    # machine 0's heartbeat, its read after machine 1's in flight), and then the next, as an agent asks.
    heard: dict[str, Any] = {}
    for _ in range(3):
        answer = await asyncio.wait_for(poll(heard, 30), 10)
        if answer == current:
            break
        heard = {**answer, "go": str(answer["go"]).lower()}
    assert answer == current
    # The same as heard: held until a heartbeat changes it (machine 1 pinned the target: go).
    held = asyncio.create_task(poll({**current, "go": "false"}, 30))
    await asyncio.sleep(0.6)  # longer than the poll's recheck of the database (RECHECK_S)
    assert not held.done(), held.result()
    await beat(job, 1, [10], 24, True)
    assert await asyncio.wait_for(held, 10) == {**current, "go": True}
    response = await client.get(
        f"/api/v1/worker/jobs/{job.id}/replication-alignment", params={"target": -2}, headers=job.worker
    )
    assert response.status_code == 422 and "target" in response.text


# -- aligned rounds whatever the iteration time (issue 11, item 2) -----------------------------------------
# The agents heartbeat every half second or so, each at its own phase, and the root answers each one from
# every machine's last summary: an iteration proposed by one machine reaches the others one or two heartbeat
# periods later. With iterations much shorter than that, a proposal must lead by the iterations committed
# meanwhile; with training stopped (ranks waiting), a proposal in the future never comes at all.

SMALL = 1 << 14  # float32 values: the pace of agreement is under test here, not the transfer


class Ring:
    """MACHINES machines of PROCS ranks replicating in a ring on real sockets, unpaced, and a root that
    keeps every machine's last summary and answers each heartbeat from them all (as the heartbeat route)."""

    def __init__(self, shm: Path):
        self.holdings = [Holdings(shm / f"machine-{m}") for m in range(MACHINES)]
        self.servers = [DataPlaneServer(h, KEY, JOB, host="127.0.0.1").start() for h in self.holdings]
        self.replicators: list[Replicator] = []
        for machine in range(MACHINES):
            self.holdings[machine].prepare_local(ranks_of(machine), 4)
            port = self.servers[holder(machine)].port
            self.replicators.append(
                Replicator(
                    self.holdings[machine],
                    KEY,
                    JOB,
                    [holder(machine)],
                    lambda _, port=port: ("127.0.0.1", port),
                    streams=1,
                ).start()
            )
        self.checkpointers = {
            rank: Checkpointer(self.holdings[m].directory("local", rank), blocking=True)
            for m in range(MACHINES)
            for rank in ranks_of(m)
        }
        self.summaries: dict[int, dict[str, Any]] = {}
        self.iteration = 0

    def commit(self, machines: range | list[int] = range(MACHINES)) -> None:
        """One training iteration: every rank (of `machines`) saves and the agents hear of the commits."""
        self.iteration += 1
        for machine in machines:
            for rank in ranks_of(machine):
                tensor = torch.full((SMALL,), float(self.iteration * 10 + rank))
                assert self.checkpointers[rank].save(self.iteration, {"w": tensor, "step": self.iteration})
                self.replicators[machine].notice_commit(rank, self.iteration)

    def heartbeat(self, machine: int) -> ReplicationAlignment:
        """Machine `machine` heartbeats: its summary to the root, the root's answer from every last one."""
        self.summaries[machine] = self.replicators[machine].summary()
        alignment = replication_alignment(self.summaries.values())
        assert alignment is not None
        self.replicators[machine].align(alignment.aligned_iteration, alignment.target, alignment.go)
        return alignment

    def heartbeats(self) -> ReplicationAlignment:
        """Every machine heartbeats in turn; the root's last answer."""
        return [self.heartbeat(machine) for machine in range(MACHINES)][-1]

    def train_until_a_target_ahead(self) -> None:
        """Commit and heartbeat until the job has an aligned iteration and the next agreed one is still to
        come (proposed ahead of the newest commit)."""
        for _ in range(400):
            self.commit()
            alignment = self.heartbeats()
            if alignment.aligned_iteration is not None and (alignment.target or 0) > self.iteration:
                return
        pytest.fail("no aligned iteration with a target ahead")

    def heartbeat_until_aligned_at(self, iteration: int, timeout_s: float = 60) -> ReplicationAlignment:
        """Training stopped: heartbeat every 0.1 s until `iteration` is aligned and every machine fully
        replicated it (or the timeout); the root's last answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            alignment = self.heartbeats()
            done = alignment.aligned_iteration == iteration and all(
                r.stats.replicated_iteration == iteration for r in self.replicators
            )
            if done or time.monotonic() >= deadline:
                return alignment
            time.sleep(0.1)  # a heartbeat period, training stopped

    def close(self) -> None:
        for checkpointer in self.checkpointers.values():
            checkpointer.close()
        for replicator in self.replicators:
            replicator.stop()
        for server in self.servers:
            server.stop()
        for h in self.holdings:
            h.close()


@pytest.fixture
def ring(shm: Path) -> Iterator[Ring]:
    ring = Ring(shm)
    yield ring
    ring.close()


def overwritten(caplog: pytest.LogCaptureFixture) -> int:
    return sum("overwritten before it could be pinned" in r.getMessage() for r in caplog.records)


def test_iterations_shorter_than_a_heartbeat_period_miss_no_agreed_iteration(
    ring: Ring, caplog: pytest.LogCaptureFixture
) -> None:
    """Each machine heartbeats every PERIOD iterations, at its own phase: once the proposals lead by what the
    machines observed (commit rate, heartbeat period), no agreed iteration is overwritten before a machine
    pinned it, and the aligned iteration keeps advancing."""
    caplog.set_level(logging.INFO, logger="worker_lib.agent.replication")
    period = 5
    missed_before = None
    advances: list[int] = []
    for _ in range(600):
        ring.commit()
        time.sleep(0.01)  # the agents' threads run between iterations, as beside a training process
        for machine in range(MACHINES):
            if (ring.iteration + 2 * machine) % period == 0:
                aligned = ring.heartbeat(machine).aligned_iteration
                if aligned is not None and (not advances or advances[-1] != aligned):
                    advances.append(aligned)
        if len(advances) == 2 and missed_before is None:
            # Past the job's start (free rounds may align by chance first): both paces are observed by now.
            missed_before = overwritten(caplog)
        if len(advances) >= 6:
            break
    assert len(advances) >= 6, f"the aligned iteration advances: {advances} by iteration {ring.iteration}"
    assert missed_before is not None
    assert overwritten(caplog) == missed_before, (
        advances,
        [r.getMessage() for r in caplog.records if "overwritten" in r.getMessage()],
    )


def test_iterations_far_longer_than_the_answers_agree_on_an_iteration_already_committed(
    ring: Ring, caplog: pytest.LogCaptureFixture
) -> None:
    """The root answers each machine many times an iteration (a proposal travels in well under half an
    iteration): a proposal leads by nothing, the newest iteration every rank committed, pinned from the slots
    at once, so no round waits for a commit; none is overwritten before it is pinned, and at every iteration
    the aligned one is in memory for every rank whichever machine is lost."""
    caplog.set_level(logging.DEBUG, logger="worker_lib.agent.replication")
    advances: list[int] = []
    agreed_committed = 0  # targets named while every rank had already committed them
    for _ in range(200):
        ring.commit()
        for _ in range(8):  # heartbeats of every machine between two commits
            time.sleep(0.005)
            for machine in range(MACHINES):
                alignment = ring.heartbeat(machine)
                if alignment.target is not None and alignment.target <= ring.iteration:
                    agreed_committed += 1
        aligned = alignment.aligned_iteration
        if aligned is not None:
            for lost in range(MACHINES):
                assert aligned in common_after_losing(lost, ring.holdings), (lost, aligned)
            if not advances or advances[-1] != aligned:
                advances.append(aligned)
        if len(advances) >= 6:
            break
    assert len(advances) >= 6, f"the aligned iteration advances: {advances} by iteration {ring.iteration}"
    proposals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("proposing iteration")]
    assert any(m.endswith("lead 0)") for m in proposals), proposals
    assert agreed_committed > 0
    assert overwritten(caplog) == 0


def test_training_that_stops_still_gets_its_last_iteration_aligned_and_replicated(ring: Ring) -> None:
    """Every rank waits after an iteration (a pause, a stalled collective) while the agreed iteration is
    still to come: the machines agree on an iteration they all hold instead, and replicate it."""
    ring.train_until_a_target_ahead()
    stopped = ring.iteration
    alignment = ring.heartbeat_until_aligned_at(stopped)
    assert alignment.aligned_iteration == stopped, (
        f"training stopped at {stopped}; aligned {alignment.aligned_iteration}, target {alignment.target}"
    )
    # Every rank's stopped iteration is on its holder, whichever machine is lost.
    for lost in range(MACHINES):
        assert stopped in common_after_losing(lost, ring.holdings)


def test_a_machine_says_at_once_when_its_part_of_the_alignment_changed(ring: Ring) -> None:
    """Replicator.on_alignment_change (the agent then heartbeats at once, not a heartbeat period later):
    called when what the machine tells the root for the alignment changed, not on every coordinator step."""
    told = [threading.Semaphore(0) for _ in range(MACHINES)]
    for machine, replicator in enumerate(ring.replicators):
        replicator.on_alignment_change = told[machine].release
        with replicator.condition:
            replicator.condition.notify_all()  # a coordinator step: the first state is told
    for machine in range(MACHINES):
        assert told[machine].acquire(timeout=5), f"machine {machine} told nothing"
    time.sleep(0.5)  # coordinator steps (every 0.2 s) with nothing changed: nothing told
    assert not any(t.acquire(blocking=False) for t in told)
    ring.commit()  # the machines' newest commit moves (no root answer yet: nothing proposed)
    ring.heartbeat(0)  # machine 0 hears of itself: proposes, pins at once (lead 0 once paced) or adopts
    assert told[0].acquire(timeout=5), "machine 0's proposal was not told"


def test_a_machine_that_runs_free_rounds_turns_the_jobs_alignment_off_and_replication_goes_on(
    ring: Ring,
) -> None:
    """One agent told CASTOR_REPLICATION_ALIGN=0 (or with stores too small to pin) in an aligned job: the
    others would wait for its pin forever. It says so in its summary, the root answers no alignment, and
    every machine runs free rounds, its aligned pins released, its replicas still completing."""
    for _ in range(400):
        ring.commit()
        alignment = ring.heartbeats()
        if alignment.aligned_iteration is not None and alignment.target is not None:
            break
    else:
        pytest.fail("no aligned iteration with a target")
    ring.replicators[2].aligns = False
    ring.summaries[2] = ring.replicators[2].summary()  # its next heartbeat
    assert ring.summaries[2]["replication_free"] is True
    before = [r.stats.rounds for r in ring.replicators]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ring.commit()
        time.sleep(0.02)
        for machine, replicator in enumerate(ring.replicators):
            ring.summaries[machine] = replicator.summary()
            alignment = replication_alignment(ring.summaries.values())
            assert alignment is None, "a machine replicates free rounds: the job does not align"
            follow(replicator, alignment)
        if all(r.stats.rounds >= b + 3 for r, b in zip(ring.replicators, before, strict=True)):
            break
    rounds = [r.stats.rounds - b for r, b in zip(ring.replicators, before, strict=True)]
    assert min(rounds) >= 3, f"free rounds go on: {rounds} completed since"
    for replicator in ring.replicators[:2]:
        summary = replicator.summary()
        assert summary["replication_next"] is None and len(summary["replication_kept"]) == 1, summary


def test_stores_too_small_to_pin_report_free_rounds(shm: Path) -> None:
    holdings = Holdings(shm / "machine")
    holdings.prepare_local(ranks_of(0), 2)  # the embedded mode's two slots per rank
    replicator = Replicator(holdings, KEY, JOB, [1], lambda _: None, streams=1)
    try:
        assert replicator.summary()["replication_free"] is True
        holdings.prepare_local(ranks_of(0), 4)
        assert "replication_free" not in replicator.summary()
        assert replicator.summary()["replication_kept"] == []
    finally:
        holdings.close()


def test_a_machine_never_proposes_an_iteration_the_job_has_aligned_already(ring: Ring) -> None:
    """Iterations slower than an aligned cycle (lead 0): once the newest commit is aligned everywhere, a
    proposal of it would count for nothing at the root, whose answer then would not change, and an agent
    waiting on the alignment poll for a change would wait out the poll (5 s: in benchmarks/recovery.py a
    machine loss lost 10-13 iterations that way). No proposal until a newer commit; then one of it."""
    for _ in range(40):
        ring.commit()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the root answers every machine many times an iteration
            alignment = ring.heartbeats()
            if alignment.aligned_iteration == ring.iteration:
                break
            time.sleep(0.01)
        else:
            continue  # the first iterations align while the paces are learnt
        for machine in range(MACHINES):  # every machine hears it (the poll answers each at once)
            assert ring.heartbeat(machine).aligned_iteration == ring.iteration
        time.sleep(0.3)  # coordinator steps with the newest commit aligned
        for machine, replicator in enumerate(ring.replicators):
            proposed = replicator.summary()["replication_next"]
            assert proposed is None or proposed > ring.iteration, (machine, proposed, ring.iteration)
        if ring.iteration >= 12:
            break
    assert ring.iteration >= 12, "the newest commit was aligned everywhere in time"
    ring.commit()  # a newer commit: proposed at once (lead 0)
    time.sleep(0.3)
    proposals = {r.summary()["replication_next"] for r in ring.replicators}
    assert ring.iteration in proposals, proposals


def test_machines_stopped_one_iteration_apart_agree_on_the_one_they_all_hold(ring: Ring) -> None:
    """Training stops with one machine an iteration ahead (a rank hung while its peers had committed one
    more): each machine proposes the newest iteration it holds, the root, hearing every machine stopped,
    names the smallest, and the machine ahead adopts it from its slots: it is replicated everywhere."""
    ring.train_until_a_target_ahead()
    common = ring.iteration
    ring.commit(machines=[0])  # machine 0 one iteration further; then nobody commits
    alignment = ring.heartbeat_until_aligned_at(common)
    assert alignment.aligned_iteration == common, (
        f"stopped at {common} ({common + 1} on machine 0); aligned {alignment.aligned_iteration}, "
        f"target {alignment.target}"
    )
    for lost in range(MACHINES):
        assert common in common_after_losing(lost, ring.holdings)


def test_a_machine_that_replicated_the_agreed_iteration_follows_when_another_machine_gives_it_up(
    shm: Path,
) -> None:
    """A machine replicated the agreed iteration (its part done) while another gave it up before its own
    round could finish (its training process, restarted by a recovery, needed the pinned slot back) and
    proposed a later one. The root then names the later one: the machine that is done follows it, instead
    of waiting for the job to align on an iteration that one machine no longer holds (replication stalled
    until the next recovery: seen in the fault matrix, tests/e2e/test_netemu_matrix.py, on a loaded host)."""
    holdings = Holdings(shm / "machine")
    holdings.prepare_local(ranks_of(0), 4)
    replicator = Replicator(holdings, KEY, JOB, [1], lambda _: None, streams=1)  # no threads: states only
    try:
        replicator.align(8, 20, False)
        assert replicator.summary()["replication_next"] == 20
        with replicator.condition:
            replicator._next_state = "done"  # its round of 20 completed (as _complete leaves it)
        replicator.align(8, 20, False)  # the others still at it: done, and ready
        summary = replicator.summary()
        assert summary["replication_next"] == 20 and summary["replication_ready"] is True
        replicator.align(8, 25, False)  # a machine gave 20 up and proposed 25
        summary = replicator.summary()
        assert summary["replication_next"] == 25, summary
        assert summary["replication_ready"] is False  # 25 is pinned when committed, then ready
        replicator.align(8, 24, False)  # never back to a smaller one
        assert replicator.summary()["replication_next"] == 25
    finally:
        replicator.stop()
        holdings.close()


def test_a_target_declined_while_training_looked_stopped_is_asked_for_again_once_training_goes_on(
    ring: Ring,
) -> None:
    """A machine hears the root's target while its training looks stopped (after a restart, until the new
    process's first commit) and has not reached it: it declines, since an iteration training never reaches
    would never come. Once training commits again it asks the root for the alignment again at once
    (Replicator.on_rehear: the agent cancels its long poll and reads the alignment as it is), and follows
    the target it hears. Before, the poll waited for a change that never came (the others waited for this
    machine), for 5 s: in the e2e fault matrix the target was overwritten meanwhile and the next proposal led
    by 52 iterations."""
    ring.train_until_a_target_ahead()
    alignment = ring.heartbeats()
    replicator = ring.replicators[0]
    asked = threading.Semaphore(0)
    replicator.on_rehear = asked.release
    deadline = time.monotonic() + 30
    while not replicator.summary()["replication_stalled"]:  # no commits, no answers: training stopped
        assert time.monotonic() < deadline, "machine 0 never saw training stop"
        time.sleep(0.1)
    target = ring.iteration + 3
    replicator.align(alignment.aligned_iteration, target, False)
    assert replicator.summary()["replication_next"] != target  # declined: training looks stopped
    time.sleep(0.5)  # coordinator steps, training still stopped: nothing asked
    assert not asked.acquire(blocking=False)
    ring.commit()  # training goes on
    assert asked.acquire(timeout=5), "machine 0 did not ask for the alignment again"
    replicator.align(alignment.aligned_iteration, target, False)  # the answer it hears then
    assert replicator.summary()["replication_next"] == target
    time.sleep(0.5)  # asked once, not at every step
    assert not asked.acquire(blocking=False)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_after_a_replacement_the_job_stays_aligned_on_the_restored_iteration(
    ring: Ring, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine 1 dies with its memory; a replacement takes its place, restored from its holder, and a second
    failure comes before the job's first aligned round of the new generation (in the e2e partition test a
    machine cut off from the root then: the job restarted from scratch). Before, the replacement kept nothing,
    so the job had no aligned iteration, the survivors let theirs go and replicated freely, and the
    iteration they all held was overwritten; and machine 0, whose holder the replacement is, had no copy
    anywhere. Now the replacement is not counted until it restored, every machine then keeps the restored
    iteration and replicates it first (to the replacement too), and the job stays aligned on it."""
    ring.train_until_a_target_ahead()
    aligned = ring.iteration
    assert ring.heartbeat_until_aligned_at(aligned).aligned_iteration == aligned
    ring.commit()
    ring.commit()  # two iterations past it, not replicated yet: then machine 1 dies

    for replicator in ring.replicators:
        replicator.pause()  # the recovery collects inventories
    lost = 1
    ring.replicators[lost].stop()
    for rank in ranks_of(lost):
        ring.checkpointers.pop(rank).close()
    ring.servers[lost].stop()
    ring.holdings[lost].close()
    shutil.rmtree(shm / f"machine-{lost}")
    copies = [
        MemoryCopy(h.rank, h.iteration, machine, h.digest, bool(h.verified), h.generation)
        for machine in range(MACHINES)
        if machine != lost
        for h in ring.holdings[machine].inventory(verify_checksums=True)
    ]
    decision = plan_recovery(
        world_size=MACHINES * PROCS,
        procs_per_machine=PROCS,
        live_machines=range(MACHINES),
        copies=copies,
        persisted=[],
        resumed_from={},
        reached=ring.iteration,
    )
    restored = decision.iteration
    assert restored == aligned, decision

    # The replacement registers into the collecting recovery: not counted until it restored.
    holdings = Holdings(shm / "replacement")
    holdings.prepare_local(ranks_of(lost), 4)
    server = DataPlaneServer(holdings, KEY, JOB, host="127.0.0.1").start()
    holder_port = ring.servers[holder(lost)].port
    replacement = Replicator(
        holdings, KEY, JOB, [holder(lost)], lambda _: ("127.0.0.1", holder_port), streams=1
    )
    replacement.pause()
    ring.holdings[lost], ring.servers[lost], ring.replicators[lost] = holdings, server, replacement.start()
    ring.replicators[lost - 1].peer_address = lambda _: ("127.0.0.1", server.port)
    ring.summaries[lost] = replacement.summary()
    assert "replication_kept" not in ring.summaries[lost]
    assert ring.heartbeats().aligned_iteration == aligned, "the survivors keep the job's aligned iteration"

    for source in decision.sources:
        if source.rank in ranks_of(lost):
            assert source.tier == "peer" and source.machine == holder(lost), source
            store = holdings.local_store(source.rank)
            fetch("127.0.0.1", holder_port, KEY, JOB, source.rank, store, restored, digest=source.digest)
    digests = {source.rank: source.digest for source in decision.sources}
    rounds = [replicator.stats.rounds for replicator in ring.replicators]
    for replicator in ring.replicators:
        replicator.resume(restored=restored, digests=digests, generation=2)
    assert restored in replacement.summary()["replication_kept"]
    assert ring.heartbeats().aligned_iteration == restored
    wait_for(
        lambda: all(
            r.stats.rounds > before and r.stats.replicated_iteration == restored
            for r, before in zip(ring.replicators, rounds, strict=True)
        ),
        "every machine to replicate the restored iteration",
    )
    for rank in ranks_of(lost - 1):  # machine 0's copies, lost with its holder, are there again
        assert restored in committed(holdings.directory("replica", rank))

    # Training goes on in generation 2, and machine 0 is cut off from the root (its summary stays as it
    # was): no aligned round can complete. Whichever machine is lost next, every rank has the restored
    # iteration on a survivor.
    monkeypatch.setenv("CASTOR_GENERATION", "2")
    for rank in [r for m in range(MACHINES) for r in ranks_of(m)]:
        if rank in ring.checkpointers:
            ring.checkpointers[rank].close()
        ring.checkpointers[rank] = Checkpointer(
            ring.holdings[rank // PROCS].directory("local", rank), blocking=True
        )
    ring.iteration = restored
    for _ in range(12):
        ring.commit()
        for machine in range(1, MACHINES):
            ring.heartbeat(machine)
        time.sleep(0.05)  # coordinator steps: free rounds, had the job lost its aligned iteration
        for machine in range(MACHINES):
            assert restored in common_after_losing(machine, ring.holdings), (machine, ring.iteration)

    # Machine 0 is heard again: the job's aligned rounds go on past the restored iteration (nothing agreed
    # before the failure, of the abandoned history, holds them up).
    for _ in range(200):
        ring.commit()
        alignment = ring.heartbeats()
        if alignment.aligned_iteration is not None and alignment.aligned_iteration > restored:
            break
        time.sleep(0.02)
    assert alignment.aligned_iteration is not None and alignment.aligned_iteration > restored, alignment
    for machine in range(MACHINES):
        assert alignment.aligned_iteration in common_after_losing(machine, ring.holdings)


def test_checkpoints_of_the_abandoned_history_are_never_replicated_again(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation 1 committed iterations 1 to 5; the recovery of generation 2 went back to 3. Until the new
    history overwrites them, 4 and 5 of generation 1 stay in the slots: a free round (before the job's
    first aligned iteration) took the newest common one, 5, and a holder then kept a replica no recovery
    may use. Now the first round is the restored iteration, and no round takes 4 or 5."""
    holdings = Holdings(shm / "machine")
    holdings.prepare_local([0], 4)
    receiver = DataPlaneServer(Holdings(shm / "holder"), KEY, JOB, host="127.0.0.1").start()
    replicator = Replicator(holdings, KEY, JOB, [1], lambda _: ("127.0.0.1", receiver.port), streams=1)
    replicator.aligns = False  # free rounds: the case where any committed iteration could be taken
    try:
        monkeypatch.setenv("CASTOR_GENERATION", "1")
        with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
            for iteration in range(2, 6):
                checkpointer.save(iteration, state(0, iteration))
        replicator.pause()
        replicator.start()
        replicator.resume(restored=3, digests={}, generation=2)
        wait_for(lambda: replicator.stats.rounds >= 1, "a round")
        time.sleep(0.5)  # coordinator steps: another free round, were 4 or 5 candidates
        assert replicator.stats.replicated_iteration == 3
        assert committed(shm / "holder" / "replicas" / "rank-0") == {3}
    finally:
        replicator.stop()
        receiver.stop()
        holdings.close()


def test_an_agreed_iteration_of_the_abandoned_history_is_dropped_at_the_restore(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine had replicated the agreed iteration 6 (its part done) when another machine died before its
    own; the recovery went back to 4, the aligned one. Were 6 still this machine's agreed iteration, it
    would adopt no later target (it waits for the job to align on 6, which the dead machine never will):
    aligned rounds stalled for the rest of the job. The restore drops it, and replicates 4 first."""
    holdings = Holdings(shm / "machine")
    holdings.prepare_local(ranks_of(0), 4)
    monkeypatch.setenv("CASTOR_GENERATION", "1")
    for rank in ranks_of(0):
        with Checkpointer(holdings.directory("local", rank), blocking=True) as checkpointer:
            for iteration in (4, 5, 6):
                checkpointer.save(iteration, state(rank, iteration))
    replicator = Replicator(holdings, KEY, JOB, [1], lambda _: None, streams=1)  # no threads: states only
    try:
        replicator.align(4, 6, True)
        with replicator.condition:
            replicator._next_state = "done"  # its round of 6 completed (as _complete leaves it)
        assert replicator.summary()["replication_next"] == 6
        replicator.pause()
        replicator.resume(restored=4, digests={}, generation=2)
        summary = replicator.summary()
        assert summary["replication_next"] is None and summary["replication_ready"] is False, summary
        assert summary["replication_kept"] == [4]
        replicator.align(4, 9, False)  # the next agreed iteration: not while 4 is on its way to the holders
        assert replicator.summary()["replication_next"] is None
        with replicator.condition:
            restored_round = replicator._round
            assert restored_round is not None and restored_round.iteration == 4
            replicator._complete(restored_round)  # as _step does once every holder has it
        replicator.align(4, 9, False)  # then adopted
        assert replicator.summary()["replication_next"] == 9
    finally:
        replicator.stop()
        holdings.close()
