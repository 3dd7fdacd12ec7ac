"""Assertions shared by the recovery tests: every rank resumed at one iteration, bit-exact with what was
saved at that iteration, having lost at most so many iterations of progress."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from tests.e2e.cluster import LocalCluster, read_events, wait_until


def wait_for_iteration(
    log_dir: Path, iteration: int, timeout: float = 120, rank: int = 0
) -> dict[int, list[dict[str, Any]]]:
    def reached() -> dict[int, list[dict[str, Any]]] | None:
        events = read_events(log_dir)
        done = [e for e in events.get(rank, []) if e["event"] == "iteration" and e["iteration"] >= iteration]
        return events if done else None

    return wait_until(reached, timeout, f"rank {rank} to reach iteration {iteration}", interval=0.1)


def wait_for_pause(log_dir: Path, world_size: int, iteration: int, timeout: float = 240) -> None:
    """Every rank of a workload started with `--pause-at` waits after `iteration`'s save (the workloads'
    e2e_workload.pause_if_asked); `log_dir`/go-<iteration> lets them go on."""

    def paused() -> bool:
        events = read_events(log_dir)
        return len(events) == world_size and all(
            e[-1]["event"] == "paused" and e[-1]["iteration"] == iteration for e in events.values()
        )

    wait_until(paused, timeout, f"every rank paused after iteration {iteration}", 0.1)


def newest_iteration(log_dir: Path) -> int:
    events = read_events(log_dir)
    return max(
        (e["iteration"] for es in events.values() for e in es if e["event"] == "iteration"), default=-1
    )


def kill_training_process(log_dir: Path, rank: int, signum: int = signal.SIGKILL) -> int:
    """Send `signum` to the live training process of `rank` (its pid is in its log)."""
    pid = read_events(log_dir)[rank][-1]["pid"]
    os.kill(pid, signum)
    return int(pid)


def machine_loss_bound(reached: int, replicated: int | None) -> int:
    """Iterations a machine loss struck while training runs may cost: the iteration in flight, or more
    when replication lagged (on a loaded host a round can outlast an iteration), but never past
    `replicated`, the job's newest fully replicated iteration read just before the strike: it is pinned
    locally and on its holders until a newer one is fully replicated (the API's figure comes from
    heartbeats, so it can be behind, never ahead). None (nothing reported yet): the in-flight bound."""
    return 1 if replicated is None else max(1, reached - replicated)


def replicated_iteration(cluster: LocalCluster) -> int | None:
    value = cluster.job_state().get("replicated_iteration")
    return None if value is None else int(value)


def check_consistent_restore(log_dir: Path, world_size: int, reached: int, max_lost: int | None) -> int:
    """Every rank's newest restart restored the same iteration, with the model and optimizer state
    bit-exact equal to what that rank had right after that iteration's step; returns the iteration."""
    events = read_events(log_dir)
    assert sorted(events) == list(range(world_size))
    restored = {}
    for rank, rank_events in events.items():
        starts = [i for i, e in enumerate(rank_events) if e["event"] == "start"]
        assert len(starts) >= 2, f"rank {rank} never restarted"
        last_start = rank_events[starts[-1]]
        restored[rank] = last_start["restored"]
        saved = [
            e
            for e in rank_events[: starts[-1]]
            if e["event"] == "iteration" and e["iteration"] == last_start["restored"]
        ]
        assert saved, f"rank {rank} restored iteration {last_start['restored']}, which it never logged"
        assert last_start["digest"] == saved[-1]["digest"], (
            f"rank {rank}: state after the restore differs from the state saved at iteration "
            f"{last_start['restored']}"
        )
    assert len(set(restored.values())) == 1, f"ranks resumed from different iterations: {restored}"
    iteration = int(next(iter(restored.values())))
    if max_lost is not None:
        assert reached - iteration <= max_lost, f"lost {reached - iteration} iterations (reached {reached})"
    return iteration


def check_event(event: dict[str, Any], *, kind: str, tier: str, replaced: bool = False) -> None:
    assert event["state"] == "recovered", event
    assert event["kind"] == kind and event["tier"] == tier, event
    phases = ["detected_at", "classified_at", "restored_at", "resumed_at"] + (
        ["replaced_at"] if replaced else []
    )
    missing = [p for p in phases if not event[p]]
    assert not missing, f"phase timestamps missing: {missing} in {event}"
    assert event["detected_at"] <= event["classified_at"] <= event["restored_at"] <= event["resumed_at"]
    if replaced:
        assert event["classified_at"] <= event["replaced_at"] <= event["restored_at"]
    assert event["iterations_lost"] is not None


def recovered_events(cluster: LocalCluster, count: int, timeout: float = 120) -> list[dict[str, Any]]:
    return [e for e in cluster.wait_for_recoveries(count, timeout) if e["state"] == "recovered"]


def complete_before(checkpoints: list[dict[str, Any]], generation: int) -> set[int]:
    """The complete persisted checkpoints (the API's list) of the history before recovery `generation`:
    every shard of an older generation. The new history persists from the plan's release on (its first
    target, the first multiple of persist_every past the restored iteration, comes with the plan), so one
    of its checkpoints may be complete by the time a test looks, at an iteration below the old history's."""
    return {
        c["iteration"]
        for c in checkpoints
        if c["complete"] and all(s["generation"] < generation for s in c["shards"])
    }
