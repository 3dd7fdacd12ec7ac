"""Retention of persisted checkpoints: the newest `keep` complete ones on the current timeline stay."""

from __future__ import annotations

import pytest

from services.root.domain.retention import StoredCheckpoint, expired

WORLD = 4


def stored(iteration: int, generations: dict[int, int] | None = None) -> StoredCheckpoint:
    """A checkpoint whose shards `generations` (rank -> generation) exist; default: every rank, gen 1."""
    return StoredCheckpoint(
        iteration, generations if generations is not None else dict.fromkeys(range(WORLD), 1)
    )


def doomed(
    checkpoints: list[StoredCheckpoint], keep: int, resumed_from: dict[int, int | None] | None = None
) -> list[int]:
    return [
        c.iteration
        for c in expired(checkpoints, world_size=WORLD, keep=keep, resumed_from=resumed_from or {1: None})
    ]


def test_the_newest_complete_ones_stay_and_older_ones_go() -> None:
    checkpoints = [stored(5), stored(10), stored(15), stored(20)]
    assert doomed(checkpoints, keep=2) == [10, 5]
    assert doomed(checkpoints, keep=4) == []


def test_partial_uploads_stay_when_newer_than_the_oldest_kept_and_go_when_older() -> None:
    uploading = stored(25, {0: 1, 1: 1})
    abandoned = stored(7, {2: 1})
    assert doomed([stored(5), abandoned, stored(10), stored(20), uploading], keep=2) == [7, 5]


def test_nothing_goes_while_no_checkpoint_is_complete() -> None:
    assert doomed([stored(5, {0: 1}), stored(10, {1: 1, 2: 1})], keep=1) == []


def test_shards_of_an_abandoned_history_do_not_take_the_place_of_the_one_a_recovery_rolled_back_to() -> None:
    # Generation 1 persisted 5 and 10; the group holding 10 in memory was lost before every rank had it,
    # so generation 2 resumed from 5. Generation 2 has re-persisted rank 0 of iteration 10 so far.
    timeline = {1: None, 2: 5}
    rewriting = stored(10, {0: 2, 1: 1, 2: 1, 3: 1})
    assert doomed([stored(5), rewriting], keep=1, resumed_from=timeline) == [], "5 is the only usable one"
    rewritten = stored(10, dict.fromkeys(range(WORLD), 2))
    assert doomed([stored(5), rewritten], keep=1, resumed_from=timeline) == [5]


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep must be at least 1"):
        expired([stored(5)], world_size=WORLD, keep=0, resumed_from={})
