"""What a machine keeps for the job's alignment (worker_lib.agent.replication): the iterations it reports kept
(`replication_kept`) are ones every local rank holds pinned and intact, and the job's aligned iteration stays
in memory here and on the holders until a newer one is aligned, also when this machine follows a later
target after replicating one the job never aligned on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from services.root.domain.replication import replication_alignment
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.replication import Replicator
from worker_lib.store.manifest import Manifest, Stripe, content_digest
from worker_lib.store.slots import SlotStore

NBYTES = 4096


def commit(store: SlotStore, iteration: int, generation: int = 1) -> None:
    writer = store.open_write(iteration, NBYTES)
    assert writer is not None, iteration
    writer.buffer[:] = bytes([iteration % 256]) * NBYTES
    digest = xxhash.xxh3_64_hexdigest(bytes(writer.buffer))
    writer.commit(
        Manifest(
            iteration=iteration,
            data_bytes=NBYTES,
            tensors=(),
            stripes=(Stripe(0, NBYTES, digest),),
            digest=content_digest([digest]),
            meta={"generation": generation},
        )
    )


def iterations(store: SlotStore) -> list[int]:
    return sorted(m.iteration for m in store.committed())


@pytest.fixture
def holdings(shm_dir: Path) -> Iterator[Holdings]:
    made = Holdings(shm_dir)
    made.prepare_local([0, 1], 4)  # as the agent does (CASTOR_LOCAL_SLOTS)
    yield made
    made.close()


@pytest.fixture
def replicator(holdings: Holdings) -> Iterator[Replicator]:
    made = Replicator(holdings, b"k" * 32, "job", [1], lambda machine: None)  # no threads: states only
    made._ranks = {0, 1}
    yield made
    made.stop()


def replicated(replicator: Replicator, iteration: int) -> None:
    """As a completed round of `iteration` leaves the replicator: pinned for every local rank."""
    stores = [replicator.holdings.local_store(rank) for rank in (0, 1)]
    pins = {rank: pin for rank, store in enumerate(stores) if (pin := store.pin(iteration)) is not None}
    assert len(pins) == 2
    replicator._pinned, replicator._pinned_version = pins, (1, iteration)


def step(replicator: Replicator) -> None:
    with replicator.condition:
        replicator._step()


def kept(replicator: Replicator) -> list[int]:
    found: list[int] = replicator._alignment_summary()["replication_kept"]
    return found


def test_an_iteration_one_local_rank_lets_go_is_let_go_for_every_rank_and_no_longer_kept(
    holdings: Holdings, replicator: Replicator
) -> None:
    for rank in (0, 1):
        commit(holdings.local_store(rank), 10)
    replicated(replicator, 10)
    replicator.align(10, None, False)
    assert kept(replicator) == [10]
    pins = dict(replicator._pinned)
    holdings.local_store(0)._want()  # rank 0's training process finds no slot it may take
    step(replicator)
    assert kept(replicator) == [], "kept though rank 0 no longer holds it"
    assert not any(pin.held for pin in pins.values()), "the other rank's pin of the set is held still"
    assert replicator._pinned_version is None
    for iteration in (11, 12, 13, 14):  # rank 0 rotates over every slot: 10 is gone there
        commit(holdings.local_store(0), iteration)
    assert kept(replicator) == []


def test_after_a_restart_from_scratch_the_old_historys_iteration_is_not_kept_and_the_job_aligns_anew(
    holdings: Holdings, replicator: Replicator
) -> None:
    """The first save of the new history (generation 2, from iteration 1) replaces every checkpoint of the
    old one, the pinned ones too. Reported kept still, the root would align the job on it and ignore every
    proposal below it: no aligned round until the new history passed it, free rounds off meanwhile."""
    for rank in (0, 1):
        commit(holdings.local_store(rank), 10)
    replicated(replicator, 10)
    replicator.align(10, None, False)
    replicator.pause()
    replicator.resume(restored=None)  # restarted from scratch: nothing restored, nothing to catch up
    for rank in (0, 1):
        commit(holdings.local_store(rank), 1, generation=2)
        replicator.notice_commit(rank, 1)
    assert kept(replicator) == []  # even before the coordinator's next step let the broken pins go
    step(replicator)
    summary = replicator._alignment_summary()
    assert summary["replication_kept"] == [] and summary["replication_generation"] == 2, summary
    alignment = replication_alignment([summary, dict(summary)])  # two machines in the same state
    assert alignment is not None and alignment.aligned_iteration is None, alignment
    assert replicator._pinned == {} and replicator._pinned_version is None


def test_a_holder_keeps_the_jobs_aligned_replica_when_a_newer_one_is_written(
    shm_dir: Path, replicator: Replicator
) -> None:
    """A sender replicated 20, which the job never aligned on (another machine gave it up), and follows a
    later target, 30: its holder's two replica slots hold 10 (the job's aligned iteration) and 20. The write
    of 30 takes 20's slot, so a transfer that drops leaves the holder 10: every rank's aligned iteration."""
    holder = Holdings(shm_dir / "holder")
    machine = Replicator(holder, b"k" * 32, "job", [0], lambda machine: None)
    try:
        store = holder.replica_store(5)
        commit(store, 10)
        commit(store, 20)
        machine.align(10, 30, False)  # the root's answer to the holder's own heartbeat
        writer = holder.replica_store(5).open_write(30, NBYTES, "wait")
        assert writer is not None
        assert iterations(store) == [10], "the write of 30 invalidated the job's aligned replica"
        writer.abort()  # the transfer dropped
        assert iterations(store) == [10]
        machine.unalign()  # no aligned iteration any more: the newest replica is the one kept again
        commit(store, 20)
        writer = holder.replica_store(5).open_write(30, NBYTES, "wait")
        assert writer is not None and iterations(store) == [20]
        writer.abort()
    finally:
        machine.stop()
        holder.close()


def test_following_a_later_target_while_ahead_gives_up_the_iteration_the_job_never_aligned_on(
    holdings: Holdings, replicator: Replicator
) -> None:
    """The job is aligned on 10; this machine replicated the agreed 20 (10 kept, 20 pinned), but another
    machine gave 20 up and proposes 30. Followed with 20 still pinned, 10, 20 and 30 would be pinned: the
    training process, rotating over four slots, would soon find none, and every pin, 10's too, let go. 20 is
    given up: the pins are the aligned iteration and the round's."""
    for iteration in (10, 20):
        for rank in (0, 1):
            commit(holdings.local_store(rank), iteration)
    replicated(replicator, 10)
    replicator.align(10, 20, True)
    with replicator.condition:
        replicator._floor, replicator._pinned = replicator._pinned, {}  # as _complete leaves it ahead
    replicated(replicator, 20)
    replicator._next_state = "done"
    given_up = dict(replicator._pinned)
    assert kept(replicator) == [10, 20]
    replicator.align(10, 30, False)
    assert replicator._next == 30
    assert not any(pin.held for pin in given_up.values()), "20 is pinned still"
    assert kept(replicator) == [10] and replicator._pinned_version == (1, 10)
    for rank in (0, 1):
        commit(holdings.local_store(rank), 30)
        replicator.notice_commit(rank, 30)
    replicator.align(10, 30, True)
    step(replicator)
    current = replicator._round
    assert current is not None and current.iteration == 30
    held = {pin.manifest.iteration for pin in (*replicator._pinned.values(), *replicator._floor.values())}
    assert held == {10}, held
    with replicator.condition:
        replicator._complete(current)  # every holder has 30
    assert kept(replicator) == [10, 30]  # 10 until the job aligns on 30
    replicator.align(30, None, False)
    assert kept(replicator) == [30]
