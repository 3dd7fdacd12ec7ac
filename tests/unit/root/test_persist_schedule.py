"""The root's persist schedule (services.root.domain.persist_schedule): one iteration for every rank, the
next one only once it is complete or given up."""

from __future__ import annotations

import pytest

from services.root.domain.persist_schedule import (
    PersistTarget,
    first_multiple_after,
    lead_iterations,
    newest_reported,
    next_target,
)


def summary(*iterations: int, per_minute: float | None = None, missed: tuple[int, int] | None = None) -> dict:
    out: dict = {"local": {str(rank): i for rank, i in enumerate(iterations)}, "per_minute": per_minute}
    if missed is not None:
        out["persist_missed"] = {"iteration": missed[0], "generation": missed[1]}
    return out


def test_first_multiple_is_strictly_after() -> None:
    assert first_multiple_after(None, 5) == 5
    assert first_multiple_after(0, 5) == 5
    assert first_multiple_after(4, 5) == 5
    assert first_multiple_after(5, 5) == 10
    with pytest.raises(ValueError):
        first_multiple_after(3, 0)


def test_newest_reported_is_the_largest_of_any_rank_and_ignores_junk() -> None:
    assert newest_reported([]) is None
    assert newest_reported([{"local": {}}, {}]) is None
    assert newest_reported([summary(3, 9), summary(7), {"local": {"0": True, "1": -4, "2": "x"}}]) == 9


def test_lead_covers_the_fastest_rank_during_the_announcement() -> None:
    assert lead_iterations(None, 5.0) == 0
    assert lead_iterations(600.0, 2.5) == 25  # 10 iterations a second for 2.5 s
    assert lead_iterations(60.0, 0.0) == 0


def test_the_first_target_is_past_the_newest_iteration_any_machine_reported_plus_the_lead() -> None:
    # The slow machine at 12, the fast at 31: the target must be ahead of the fast one.
    target = next_target(None, every=10, generation=1, summaries=[summary(12), summary(31)], latency_s=0)
    assert target == PersistTarget(40, 1)
    # 2 iterations a second for 5 s: 10 more iterations may pass before the fast rank hears of it.
    target = next_target(
        None, every=10, generation=1, summaries=[summary(12), summary(31, per_minute=120.0)], latency_s=5
    )
    assert target == PersistTarget(50, 1)
    assert next_target(None, every=10, generation=1, summaries=[], latency_s=5) == PersistTarget(10, 1)


def test_no_tier_no_target() -> None:
    assert next_target(None, every=0, generation=1, summaries=[summary(5)], latency_s=1) is None


def test_no_target_past_what_a_report_can_name() -> None:
    """A summary claiming an absurd iteration (a confused agent) would otherwise set a target no shard can
    ever be reported for (iterations are 32-bit on the wire), and it would never complete nor be given up;
    with none announced, the next sane summaries announce one."""
    absurd = [summary(12), summary(2**31 - 1)]
    assert next_target(None, every=10, generation=1, summaries=absurd, latency_s=0) is None
    done = PersistTarget(10, 1)
    assert next_target(done, every=10, generation=1, summaries=absurd, latency_s=0, complete=True) is None
    # The root then announces none (services.root.flows.machines.schedule_persist), and chooses afresh.
    sane = [summary(12), summary(13)]
    assert next_target(None, every=10, generation=1, summaries=sane, latency_s=0) == PersistTarget(20, 1)
    # The largest multiple that fits is still announced.
    assert next_target(None, every=10, generation=1, summaries=[summary(2**31 - 20)], latency_s=0) == (
        PersistTarget(2_147_483_630, 1)
    )


def test_a_target_in_progress_stays_whatever_the_machines_report() -> None:
    """The point of the schedule: ranks far ahead do not move it; only completion or giving up does."""
    current = PersistTarget(40, 1)
    far = [summary(35), summary(400)]
    assert next_target(current, every=10, generation=1, summaries=far, latency_s=5) is current


def test_a_complete_target_moves_past_itself_even_on_stale_reports() -> None:
    current = PersistTarget(40, 1)
    stale = [summary(30), summary(38)]  # heartbeats older than the commits of 40
    assert next_target(current, every=10, generation=1, summaries=stale, latency_s=0, complete=True) == (
        PersistTarget(50, 1)
    )
    ahead = [summary(44), summary(61)]
    assert next_target(current, every=10, generation=1, summaries=ahead, latency_s=0, complete=True) == (
        PersistTarget(70, 1)
    )


def test_a_recovery_gives_the_target_up_and_the_new_history_chooses_again() -> None:
    current = PersistTarget(40, 1)
    # Rolled back to 20 in generation 2: the old target's number is not kept, the new one follows the reports.
    after = next_target(current, every=10, generation=2, summaries=[summary(22), summary(23)], latency_s=0)
    assert after == PersistTarget(30, 2)


def test_a_missed_target_is_given_up_only_for_its_own_generation() -> None:
    current = PersistTarget(40, 2)
    missed = [summary(41), summary(47, missed=(40, 2))]
    assert next_target(current, every=10, generation=2, summaries=missed, latency_s=0) == PersistTarget(50, 2)
    stale = [summary(41), summary(47, missed=(40, 1))]  # a report about the previous history's 40
    assert next_target(current, every=10, generation=2, summaries=stale, latency_s=0) is current


# -- a recovery (a newer plan generation) and the pending target (issue 13: a job recovering more often than a
# persist round takes never completed a persisted checkpoint, every recovery gave its target up) ---------


def test_a_target_the_recovery_restored_at_or_past_is_kept_when_ranks_uploaded_it() -> None:
    """Restored to 45 in generation 2 with some shards of 40 (generation 1) uploaded: those shards stay on
    the timeline (a checkpoint of an iteration is the same bytes whatever generation), so the remaining
    ranks persist 40 too instead of the whole job starting over on a new target."""
    current = PersistTarget(40, 1)
    reports = [summary(46), summary(47)]
    kept = next_target(
        current,
        every=10,
        generation=2,
        summaries=reports,
        latency_s=0,
        resumed_from={1: None, 2: 45},
        uploaded=3,
    )
    assert kept == current


def test_a_target_the_recovery_restored_exactly_is_kept_even_with_nothing_uploaded() -> None:
    """Restored to the target itself: every rank holds it (the restored copy is that generation's commit)."""
    current = PersistTarget(40, 1)
    kept = next_target(
        current, every=10, generation=2, summaries=[summary(40)], latency_s=0, resumed_from={1: None, 2: 40}
    )
    assert kept == current


def test_a_kept_target_survives_several_recoveries_that_stay_past_it() -> None:
    current = PersistTarget(40, 1)
    timeline = {1: None, 2: 45, 3: 42}
    assert (
        next_target(
            current,
            every=10,
            generation=3,
            summaries=[summary(43)],
            latency_s=0,
            resumed_from=timeline,
            uploaded=1,
        )
        == current
    )
    # One generation in between rolled back before 40: its shards of 40 are off the timeline.
    timeline = {1: None, 2: 35, 3: 42}
    after = next_target(
        current,
        every=10,
        generation=3,
        summaries=[summary(43)],
        latency_s=0,
        resumed_from=timeline,
        uploaded=1,
    )
    assert after == PersistTarget(50, 3)


def test_a_kept_target_completes_or_is_missed_and_the_next_is_past_the_restore_point() -> None:
    current = PersistTarget(40, 1)
    timeline = {1: None, 2: 57}
    stale = [summary(44)]  # reports from before the restore
    for outcome in ({"complete": True}, {"summaries": [summary(44, missed=(40, 1))]}):
        kwargs: dict = {"summaries": stale, **outcome}
        after = next_target(
            current, every=10, generation=2, latency_s=0, resumed_from=timeline, uploaded=2, **kwargs
        )
        assert after == PersistTarget(60, 2), outcome


def test_a_target_past_the_restore_point_is_chosen_again_past_the_restore_point() -> None:
    """Rolled back to 20, before the target 40: its shards are of the abandoned history. The new target is
    of the new generation and strictly past what the new generation restored, even on stale reports."""
    current = PersistTarget(40, 1)
    after = next_target(
        current, every=10, generation=2, summaries=[summary(12)], latency_s=0, resumed_from={1: None, 2: 20}
    )
    assert after == PersistTarget(30, 2)
    # A target at the restore point would be held only as the older generation's copy: never announced.
    after = next_target(
        current, every=10, generation=2, summaries=[summary(3)], latency_s=0, resumed_from={1: None, 2: 30}
    )
    assert after == PersistTarget(40, 2)


def test_restored_past_the_target_with_nothing_uploaded_moves_on_past_the_restore_point() -> None:
    """Nothing of 40 was uploaded and the ranks restored 45: most no longer hold 40, nothing is lost by
    choosing again."""
    current = PersistTarget(40, 1)
    after = next_target(
        current, every=10, generation=2, summaries=[summary(41)], latency_s=0, resumed_from={1: None, 2: 45}
    )
    assert after == PersistTarget(50, 2)


def after_a_recovery_past_40(
    uploaded: int = 0, uploading: int = 0, kept: bool = False, summaries: list[dict] | None = None
) -> PersistTarget | None:
    """The target after generation 2 restored 43, with 40 (generation 1) announced, 4 ranks."""
    return next_target(
        PersistTarget(40, 1),
        every=10,
        generation=2,
        summaries=summaries or [],
        latency_s=0,
        resumed_from={1: None, 2: 43},
        uploaded=uploaded,
        world_size=4,
        uploading=uploading,
        kept=kept,
    )


def test_a_target_every_rank_uploaded_before_the_recovery_released_its_plan_is_complete() -> None:
    """Its last shard arrived while the recovery collected inventories, when no schedule runs: at the plan's
    release every rank's shard is there, so the next target is chosen (kept, it would stand for good)."""
    assert after_a_recovery_past_40(uploaded=4) == PersistTarget(50, 2)
    assert after_a_recovery_past_40(uploaded=3) == PersistTarget(40, 1), "unfinished: kept"


def test_uploads_in_flight_keep_a_target_but_complete_nothing() -> None:
    """Restored past the target with no shard of it recorded yet: ranks still uploading it keep it (their
    shards would otherwise land outside any checkpoint that can complete); they are not uploaded ones."""
    assert after_a_recovery_past_40() == PersistTarget(50, 2)
    assert after_a_recovery_past_40(uploading=4) == PersistTarget(40, 1), "kept, not complete"
    assert after_a_recovery_past_40(uploaded=3, uploading=1) == PersistTarget(40, 1)


def test_a_target_the_release_kept_moves_on_only_once_complete_or_missed() -> None:
    """The release counted uploads in flight, which no later call sees: the keep stands until then."""
    assert after_a_recovery_past_40(kept=True) == PersistTarget(40, 1)
    assert after_a_recovery_past_40(kept=True, summaries=[summary(44, missed=(40, 1))]) == PersistTarget(
        50, 2
    )
    assert after_a_recovery_past_40(kept=True, uploaded=4) == PersistTarget(50, 2)
