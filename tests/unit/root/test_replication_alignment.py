"""The root's alignment of replication rounds across machines (pure): the aligned iteration is the newest one
every replicating machine fully replicated and still keeps, the target the largest proposal of the newest
history past it, and go only when every machine has pinned that target."""

from __future__ import annotations

from typing import Any

from services.root.domain.replication import ReplicationAlignment, replication_alignment


def machine(
    kept: list[int], proposed: int | None = None, ready: bool = False, generation: int = 1
) -> dict[str, Any]:
    return {
        "replication_kept": kept,
        "replication_next": proposed,
        "replication_ready": ready,
        "replication_generation": generation,
    }


def test_no_machine_replicates_no_alignment() -> None:
    assert replication_alignment([]) is None
    assert replication_alignment([{"local": {"0": 5}}, {"replicated_iteration": 3}]) is None


def test_the_aligned_iteration_is_the_newest_every_machine_keeps_not_the_minimum_of_the_newest() -> None:
    # Machine 0 keeps 10 and 20, machine 1 only 15: min(newest) = 15 is not held by machine 0's holders.
    assert replication_alignment([machine([10, 20]), machine([15])]).aligned_iteration is None
    assert replication_alignment([machine([10, 20]), machine([10])]).aligned_iteration == 10
    assert (
        replication_alignment([machine([10, 20]), machine([10, 20]), machine([20])]).aligned_iteration == 20
    )
    assert replication_alignment([machine([]), machine([20])]).aligned_iteration is None


def test_the_target_is_the_largest_proposal_past_the_aligned_iteration_and_go_needs_everyone_ready() -> None:
    assert replication_alignment([machine([10], 14), machine([10], 17)]) == ReplicationAlignment(
        10, 17, False
    )
    # A proposal at or below the aligned iteration is stale (that round is over everywhere).
    assert replication_alignment([machine([10], 10, True), machine([10])]) == ReplicationAlignment(
        10, None, False
    )
    assert replication_alignment([machine([10], 17, True), machine([10], 17)]).go is False
    assert replication_alignment([machine([10], 17, True), machine([10], 14, True)]).go is False
    assert replication_alignment([machine([10], 17, True), machine([10], 17, True)]) == ReplicationAlignment(
        10, 17, True
    )
    # A machine that already replicated the target still reports it (ready) until the job is aligned on it.
    assert replication_alignment([machine([10, 17], 17, True), machine([10], 17, True)]) == (
        ReplicationAlignment(10, 17, True)
    )
    assert replication_alignment([machine([10, 17], 17, True), machine([10, 17], 17, True)]) == (
        ReplicationAlignment(17, None, False)
    )


def test_after_a_rollback_only_the_newest_historys_proposals_count() -> None:
    stale = machine([], 500, True, generation=1)
    fresh = machine([], 103, False, generation=2)
    assert replication_alignment([stale, fresh]) == ReplicationAlignment(None, 103, False)


def test_malformed_summaries_count_as_nothing() -> None:
    odd = {"replication_kept": ["x", -1, True, 7], "replication_next": "soon", "replication_ready": "yes"}
    assert replication_alignment([odd, machine([7], 9, True)]) == ReplicationAlignment(7, 9, False)


def test_one_machine_that_replicates_free_rounds_means_no_machine_of_the_job_aligns() -> None:
    # The others would wait for its pin forever: every machine runs free rounds instead.
    ready = [machine([10], 14, ready=True), machine([10], 14, ready=True)]
    assert replication_alignment(ready) == ReplicationAlignment(10, 14, True)
    assert replication_alignment([*ready, {"replication_free": True, "replicated_iteration": 12}]) is None
    assert replication_alignment([*ready, {"replication_free": False, **machine([10], 14, True)}]) is not None


def test_once_every_machine_has_stopped_the_target_is_the_smallest_proposal() -> None:
    # A rank hung while its peer had committed one more: each stopped machine proposes the newest it holds.
    ahead, behind = machine([10], 15, ready=True), machine([10], 14)
    assert replication_alignment([ahead, behind]).target == 15  # still training: the largest
    stopped = [{**ahead, "replication_stalled": True}, {**behind, "replication_stalled": True}]
    assert replication_alignment(stopped) == ReplicationAlignment(10, 14, False)
    one_stopped = [{**ahead, "replication_stalled": True}, behind]
    assert replication_alignment(one_stopped).target == 15
