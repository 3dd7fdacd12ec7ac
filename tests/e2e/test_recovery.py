"""Failure recovery end to end: a real data-parallel training job (torch.distributed with gloo on CPU, a
checkpoint every iteration) on 4 local machines started by the root's local cloud operator, m = 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import LocalCluster, read_events, wait_until
from tests.e2e.recovery_checks import (
    check_consistent_restore,
    check_event,
    complete_before,
    kill_training_process,
    machine_loss_bound,
    newest_iteration,
    recovered_events,
    replicated_iteration,
    wait_for_iteration,
    wait_for_pause,
)
from worker_lib.agent.agent import NO_BACKGROUND_CHECK_ENV
from worker_lib.agent.holdings import Holdings

pytestmark = pytest.mark.slow

ITERATIONS = 100_000  # the test ends the job, not the loop
SLEEP = 0.2  # per iteration: a few iterations a second
PAUSE = 8  # where a test that needs every rank at one known iteration has them wait (--pause-at)


def start_job(
    cluster: LocalCluster, log_dir: Path, machines: int = 4, pause_at: int | None = None, **fields: object
) -> None:
    pause = {} if pause_at is None else {"pause_at": pause_at}
    cluster.launch_job(
        cluster.training_command(log_dir, iterations=ITERATIONS, sleep=SLEEP, **pause),
        machines=machines,
        replicas=2,
        **fields,
    )
    cluster.wait_until_warm()
    wait_for_iteration(log_dir, 3)


def test_software_failure_restores_from_local_memory(cluster: LocalCluster, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    cluster.start_root()
    start_job(cluster, logs)
    kill_training_process(logs, rank=1)
    reached = newest_iteration(logs)
    (event,) = recovered_events(cluster, 1)
    check_event(event, kind="software", tier="local")
    assert "SIGKILL" in event["cause"] and event["rank"] == 1
    assert set(event["details"]["tiers"].values()) == {"local"}
    iteration = check_consistent_restore(logs, 4, reached, max_lost=1)
    wait_for_iteration(logs, iteration + 3)  # and training goes on


def test_machine_loss_restores_the_replacement_from_its_group_peer(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    cluster.start_root()
    start_job(cluster, logs)
    lost = cluster.root_machine(2)
    replicated = replicated_iteration(cluster)
    cluster.kill_machine(lost)  # agent, training process and shared memory: the machine is gone
    reached = newest_iteration(logs)
    (event,) = recovered_events(cluster, 1)
    check_event(event, kind="hardware", tier="peer", replaced=True)
    assert event["rank"] == 2 and event["details"]["replacement"]["status"] == "launched"
    assert event["details"]["tiers"] == {"0": "local", "1": "local", "2": "peer", "3": "local"}
    machines = cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/machines?history=true")
    rank2 = [(m["instance_id"], m["state"]) for m in machines if m["rank"] == 2]
    assert (lost.instance_id, "replaced") in rank2 and len(rank2) == 2
    assert event["details"]["replaced_by"] in {i for i, s in rank2 if s != "replaced"}
    iteration = check_consistent_restore(logs, 4, reached, max_lost=machine_loss_bound(reached, replicated))
    wait_for_iteration(logs, iteration + 3)


def test_loss_of_a_whole_group_restores_its_ranks_from_the_persistent_tier(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    cluster.start_root()
    # Every complete checkpoint kept: the test compares the restore with the old history's newest, which
    # retention (3 kept by default) expires once the new history has completed three.
    start_job(cluster, logs, persist_every=5, keep_persisted=1000)
    # Kill when the newest persisted checkpoint is no longer the newest commit in memory: the lost group's
    # ranks exist only in the persistent tier, at that iteration. The root chooses which multiples of 5
    # every rank persists: wait for a complete one first.
    url = f"/api/v1/jobs/{cluster.job['id']}/checkpoints"

    def announced_past_a_complete_one() -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        # The root announces the next target at a heartbeat after the last shard completed the current
        # one: read as it completes, the directive may still name it (target == complete).
        checkpoints = cluster.api("GET", url)
        directive = cluster.directive()
        complete = [c["iteration"] for c in checkpoints if c["complete"]]
        target = (directive.get("persist") or {}).get("iteration")
        return (
            (checkpoints, directive) if complete and target is not None and target > max(complete) else None
        )

    checkpoints, directive = wait_until(
        announced_past_a_complete_one, 120, "a complete checkpoint and the next target announced", 0.1
    )
    # Every rank persisted the iterations the root announced: past the newest complete one, at most the
    # target in progress is partial (per-rank multiples would leave a partial one wherever an upload
    # lagged), and agents read the next. An older partial one is a target the root gave up (a rank's copy
    # reused before its upload: persist_missed), which retention keeps while it is newer than the oldest
    # complete one kept.
    complete = max(c["iteration"] for c in checkpoints if c["complete"])
    partial = [c["iteration"] for c in checkpoints if not c["complete"] and c["iteration"] > complete]
    target = directive["persist"]["iteration"]
    assert directive["persist"]["every"] == 5 and target % 5 == 0 and target > complete, directive
    assert len(partial) <= 1 and all(i <= target for i in partial), (partial, target, checkpoints)
    wait_until(lambda: (n := newest_iteration(logs)) >= 12 and n % 5 == 2, 120, "iteration 5k+2", 0.02)
    for rank in (2, 3):  # machines 2 and 3 form one placement group
        cluster.kill_machine(cluster.root_machine(rank))
    reached = newest_iteration(logs)
    events = recovered_events(cluster, 2)
    assert len(events) == 2 and len({e["plan_id"] for e in events}) == 1, "close failures, one recovery"
    for event in events:
        check_event(event, kind="hardware", tier="persistent", replaced=True)
    iteration = check_consistent_restore(logs, 4, reached, max_lost=None)
    persisted = cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/checkpoints")
    before = complete_before(persisted, events[0]["details"]["plan_generation"])
    newest_complete = max(i for i in before if i <= reached)
    assert iteration == newest_complete and iteration % 5 == 0
    tiers = events[0]["details"]["tiers"]
    assert {tiers["2"], tiers["3"]} == {"persistent"}, tiers
    # The survivors may still hold that iteration in memory, in their own slots or as each other's replica
    # (a replica store pins slots its own rank has already reused): either is faster than the persistent tier
    # and holds the same bytes (check_consistent_restore compared every rank's digest).
    assert {tiers["0"], tiers["1"]} <= {"local", "peer", "persistent"}, tiers


@pytest.mark.parametrize("found_by", ["background check", "restore"])
def test_corrupted_memory_checkpoint_falls_back_to_the_next_tier(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found_by: str
) -> None:
    logs = tmp_path / "logs"
    if found_by == "restore":  # the agents (started by the root) inherit it: the plan names the copy
        monkeypatch.setenv(NO_BACKGROUND_CHECK_ENV, "1")
    cluster.start_root()
    start_job(cluster, logs, machines=2, pause_at=PAUSE)
    # Both ranks wait after iteration PAUSE (they commit nothing more); training stopped, so the machines
    # agree on that iteration (aligned rounds) and its replicas reach the peers.
    wait_for_pause(logs, 2, PAUSE)
    wait_until(
        lambda: (replicated_iteration(cluster) or -1) >= PAUSE, 120, f"iteration {PAUSE} replicated", 0.1
    )
    machine = cluster.root_machine(1)
    store = Holdings(machine.shm_dir).local_store(1)
    newest = store.committed()[0]
    assert newest.iteration == PAUSE
    slot = next(p for p in machine.shm_dir.glob("local/rank-1/slot-*.json") if newest.digest in p.read_text())
    with open(slot.with_suffix(".bin"), "r+b") as data:  # one bit flips in the machine's memory
        data.seek(newest.tensors[0].offset)
        byte = data.read(1)
        data.seek(newest.tensors[0].offset)
        data.write(bytes([byte[0] ^ 0x01]))
    kill_training_process(logs, rank=1)
    (logs / f"go-{PAUSE}").touch()  # rank 0 (restarted by the recovery, or not yet) passes the pause
    reached = newest_iteration(logs)

    # The inventories report without reading a byte. The agent's background check finds the damage before
    # the plan is made (with it on, what happened in every run here, though it is a race), or the plan names
    # the local copy and the training process's restore finds it, stripe by stripe: the copy is condemned
    # where it lies, and the (next) plan takes the peer's replica. Either way no corrupt byte is loaded, and
    # the same iteration resumes.
    def passed_over() -> dict[str, Any] | None:
        events = cluster.failures()
        return next((e for e in events if e["state"] == "recovered" and e["details"].get("corrupt")), None)

    event = wait_until(passed_over, 120, "a recovery that passed the corrupt copy over", 0.25)
    if found_by == "restore":
        # The plan named the corrupt copy; the training process's restore found it before loading a byte
        # of it and failed, and the next plan read the rank from the peer. That next recovery is opened by
        # whichever failure reaches the root first: rank 1's exit, or rank 0's collective breaking off when
        # rank 1 left (a gloo abort); either way rank 1's exit, which says nothing of its peers, is the
        # recorded cause (flows.failures.join_exit), and its process said why in its output. (Its agent
        # may have stopped it for the next recovery while it was still exiting: "failed (was killed by
        # SIGTERM while exiting): CheckpointCorruptError ...", flows.failures.exit_cause.)
        assert len(cluster.failures()) >= 2, "the restore's failure opened a recovery of its own"
        causes = [e["cause"] for e in cluster.failures()]
        assert any("rank 1 " in c and "CheckpointCorruptError" in c for c in causes), causes
        output = machine.log_path.read_text(errors="replace")
        assert f"CheckpointCorruptError: checkpoint of iteration {newest.iteration} is corrupt" in output
    check_event(event, kind=event["kind"], tier="peer")
    assert event["details"]["tiers"] == {"0": "local", "1": "peer"}
    corrupt = event["details"]["corrupt"]
    assert {(c["machine"], c["rank"], c["iteration"]) for c in corrupt} == {(1, 1, newest.iteration)}
    assert "checksum" in corrupt[0]["problem"]
    iteration = check_consistent_restore(logs, 2, reached, max_lost=1)
    assert iteration == newest.iteration, "the same iteration, from the peer's intact replica"
    assert read_events(logs)[1][-1]["event"] in ("start", "iteration")
