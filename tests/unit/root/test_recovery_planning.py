"""The recovery planner on tables of cases: one iteration for every rank, the fastest tier per rank."""

from __future__ import annotations

import pytest

from services.root.domain.recovery import (
    MemoryCopy,
    PersistedShard,
    UploadInFlight,
    on_timeline,
    plan_recovery,
)


def mem(
    rank: int, iteration: int, machine: int, *, verified: bool | None = True, generation: int = 1
) -> MemoryCopy:
    return MemoryCopy(rank, iteration, machine, f"d{rank}-{iteration}", verified, generation)


def disk(rank: int, iteration: int, generation: int = 1) -> PersistedShard:
    return PersistedShard(
        rank, iteration, f"s3://b/job/{iteration}/rank-{rank}", f"d{rank}-{iteration}", generation
    )


def group_copies(iterations: dict[int, list[int]], groups: list[list[int]]) -> list[MemoryCopy]:
    """Every machine holds its own checkpoints and its group peers' (m = group size, one rank per machine)."""
    copies = []
    for group in groups:
        for holder in group:
            for rank in group:
                copies += [mem(rank, it, holder) for it in iterations[rank]]
    return copies


def plan(**overrides):  # type: ignore[no-untyped-def]
    arguments = {
        "world_size": 4,
        "procs_per_machine": 1,
        "live_machines": range(4),
        "copies": [],
        "persisted": [],
        "resumed_from": {1: None},
        "reached": None,
    } | overrides
    return plan_recovery(**arguments)


SOFTWARE = group_copies({0: [9, 10], 1: [9, 10], 2: [9, 10], 3: [10, 11]}, [[0, 1], [2, 3]])


@pytest.mark.parametrize(
    ("case", "arguments", "iteration", "tiers", "lost"),
    [
        (
            "software failure: everyone restores locally the newest iteration all ranks have",
            {"copies": SOFTWARE, "reached": 11},
            10,
            ["local"] * 4,
            1,
        ),
        (
            "machine 1 replaced: its rank comes from its group peer, the others stay local",
            {"copies": [c for c in SOFTWARE if c.machine != 1], "reached": 11},
            10,
            ["local", "peer", "local", "local"],
            1,
        ),
        (
            "a whole group lost: every rank falls back to the newest persisted checkpoint",
            {
                "copies": [c for c in SOFTWARE if c.machine not in (2, 3)],
                "persisted": [disk(r, it) for r in range(4) for it in (0, 5)],
                "reached": 11,
            },
            5,
            ["persistent"] * 4,
            6,
        ),
        (
            "persisted iteration still in memory somewhere: that rank reads memory",
            {
                "copies": [mem(0, 5, 0), mem(1, 5, 0)],
                "persisted": [disk(r, 5) for r in range(4)],
                "live_machines": [0, 1, 2, 3],
            },
            5,
            ["local", "peer", "persistent", "persistent"],
            None,
        ),
        (
            "a corrupt local copy sends that rank to its peer, same iteration for all",
            {
                "copies": [
                    c if (c.rank, c.machine, c.iteration) != (2, 2, 10) else mem(2, 10, 2, verified=False)
                    for c in SOFTWARE
                ],
                "reached": 11,
            },
            10,
            ["local", "local", "peer", "local"],
            1,
        ),
        (
            "corrupt everywhere in memory: fall back to persistent, all ranks together",
            {
                "copies": [mem(r, 10, m, verified=r != 3) for r in range(4) for m in (r, r ^ 1)],
                "persisted": [disk(r, 8) for r in range(4)],
                "reached": 10,
            },
            8,
            ["persistent"] * 4,
            2,
        ),
        (
            "nothing anywhere: start from scratch",
            {"reached": None},
            None,
            [],
            None,
        ),
        (
            "incomplete persisted checkpoint is not used",
            {"persisted": [disk(r, 20) for r in range(3)] + [disk(r, 10) for r in range(4)]},
            10,
            ["persistent"] * 4,
            None,
        ),
    ],
)
def test_plans(
    case: str, arguments: dict[str, object], iteration: int | None, tiers: list[str], lost: int | None
) -> None:
    decision = plan(**arguments)
    assert decision.iteration == iteration, case
    assert [s.tier for s in decision.sources] == tiers, case
    assert decision.iterations_lost == lost, case
    assert all(s.rank == r for r, s in enumerate(decision.sources))


def test_peer_fetches_spread_over_holders_and_name_a_live_machine() -> None:
    # Machine 0 (ranks 0, 1 with two processes per machine) is replaced; machine 1 and 2 hold replicas.
    copies = [mem(r, 7, m) for r in (0, 1) for m in (1, 2)] + [mem(r, 7, r // 2) for r in range(2, 6)]
    decision = plan(world_size=6, procs_per_machine=2, live_machines=[0, 1, 2], copies=copies)
    assert decision.iteration == 7
    peers = [s for s in decision.sources if s.tier == "peer"]
    assert [s.rank for s in peers] == [0, 1]
    assert {s.machine for s in peers} == {1, 2}, "two fetches, two different holders"


def test_copies_not_checked_yet_count_and_a_checked_peer_is_preferred() -> None:
    # Inventories report without hashing: an unchecked copy (None) is planned like an intact one (the
    # restore verifies it), a corrupt one (False) never is, and among peers a checked copy goes first.
    unchecked = [mem(r, 9, r, verified=None) for r in range(4)]
    decision = plan(copies=unchecked)
    assert decision.iteration == 9 and [s.tier for s in decision.sources] == ["local"] * 4
    replicas = [mem(0, 9, 1, verified=None), mem(0, 9, 2, verified=True), mem(0, 9, 3, verified=False)]
    decision = plan(copies=unchecked[1:] + replicas)
    assert (decision.sources[0].tier, decision.sources[0].machine) == ("peer", 2)
    only_corrupt = [*unchecked[1:], mem(0, 9, 0, verified=False), mem(0, 9, 3, verified=False)]
    assert plan(copies=only_corrupt).iteration is None


def test_copies_on_dead_machines_are_ignored() -> None:
    copies = [mem(r, 4, r) for r in range(4)] + [mem(r, 5, r) for r in range(4)]
    decision = plan(copies=copies, live_machines=[0, 1, 2])
    assert decision.iteration is None, "rank 3's only copies were on the dead machine 3"


def test_checkpoints_from_before_a_rollback_are_another_history() -> None:
    # Generation 1 reached iteration 12; generation 2 rolled back to 8 (a group loss) and reached 10.
    assert on_timeline(8, 1, {2: 8}) and not on_timeline(9, 1, {2: 8}) and on_timeline(9, 2, {2: 8})
    stale = [mem(r, 11, r, generation=1) for r in range(4)]
    fresh = [mem(r, it, r, generation=2) for r in range(4) for it in (9, 10)]
    decision = plan(copies=stale + fresh, resumed_from={1: None, 2: 8})
    assert decision.iteration == 10
    assert plan(copies=stale, resumed_from={1: None, 2: 8}).iteration is None
    mixed = [mem(r, 11, r, generation=1) for r in range(3)] + [mem(3, 11, 3, generation=2)]
    assert plan(copies=mixed, resumed_from={1: None, 2: 8}).iteration is None, "one history per iteration"


def test_slowest_tier_names_the_recovery() -> None:
    decision = plan(copies=[c for c in SOFTWARE if c.machine != 1])
    assert decision.slowest_tier == "peer"


# A whole placement group (machines 2 and 3) is lost after every rank committed iteration 42. Iteration 35 is
# complete on the persistent tier; the lost group uploaded its ranks of 40 before it died, and the survivors
# (machines 0, 1, holding 41 and 42 in memory, 40 only in their upload buffers) are still uploading theirs.
GROUP_LOST = {
    "live_machines": [0, 1, 4, 5],  # 4 and 5 replace 2 and 3
    "copies": group_copies({0: [41, 42], 1: [41, 42]}, [[0, 1]]),
    "persisted": [disk(r, 35) for r in range(4)] + [disk(2, 40), disk(3, 40)],
    "reached": 42,
}
SURVIVORS_UPLOADING = [UploadInFlight(0, 40, 1, machine=0), UploadInFlight(1, 40, 1, machine=1)]


def test_uploads_in_flight_that_would_make_a_newer_iteration_restorable_are_named() -> None:
    decision = plan(**GROUP_LOST, uploading=SURVIVORS_UPLOADING)
    # What is restorable now does not change: the caller decides whether to wait.
    assert decision.iteration == 35 and {s.tier for s in decision.sources} == {"persistent"}
    assert set(decision.waits_for) == set(SURVIVORS_UPLOADING)
    # Once they arrive, iteration 40: the survivors' ranks from their uploads, the lost group's too.
    arrived = plan(**GROUP_LOST | {"persisted": [*GROUP_LOST["persisted"], disk(0, 40), disk(1, 40)]})
    assert arrived.iteration == 40 and arrived.waits_for == ()


@pytest.mark.parametrize(
    ("case", "uploading"),
    [
        ("no upload in flight", []),
        ("only one of the two survivors' uploads: 40 stays incomplete", SURVIVORS_UPLOADING[:1]),
        (
            "uploaded by a machine that is not live",
            [UploadInFlight(0, 40, 1, 2), UploadInFlight(1, 40, 1, 3)],
        ),
        (
            "named by machines that do not run the ranks",
            [UploadInFlight(0, 40, 1, 1), UploadInFlight(1, 40, 1, 0)],
        ),
        ("of a history rolled back from", [UploadInFlight(r, 40, 1, r) for r in (0, 1)]),
        ("older than what is restorable now", [UploadInFlight(r, 30, 1, r) for r in (0, 1)]),
    ],
)
def test_nothing_to_wait_for(case: str, uploading: list[UploadInFlight]) -> None:
    resumed_from = {1: None, 2: 38} if "history" in case else {1: None}
    decision = plan(**GROUP_LOST, uploading=uploading, resumed_from=resumed_from)
    assert decision.waits_for == (), case
    assert decision.iteration == 35, case


def test_an_upload_is_not_waited_for_where_memory_serves_the_newer_iteration() -> None:
    """A software failure: every rank holds 42 in memory, so the uploads of 40 change nothing."""
    copies = group_copies({r: [41, 42] for r in range(4)}, [[0, 1], [2, 3]])
    decision = plan(copies=copies, reached=42, uploading=SURVIVORS_UPLOADING)
    assert decision.iteration == 42 and decision.waits_for == ()
