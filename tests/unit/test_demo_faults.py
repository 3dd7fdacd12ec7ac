"""When the demo strikes its machine loss (services.demo.replicas_past_persisted): once the job's replicas
reached the newest persisted iteration, with a few iterations to go before the next, so the loss restores
the lost rank from its peer's memory, not from a persisted iteration newer than the replicas."""

from __future__ import annotations

from services.demo import PEER_MARGIN, PERSIST_EVERY, replicas_past_persisted


def job(newest: int | None, replicated: int | None) -> dict[str, int | None]:
    return {"newest_iteration": newest, "replicated_iteration": replicated}


def test_replicas_behind_the_persisted_iteration_wait() -> None:
    persisted = 8 * PERSIST_EVERY
    assert not replicas_past_persisted(job(persisted + 2, persisted - 1))
    assert replicas_past_persisted(job(persisted + 2, persisted))
    assert replicas_past_persisted(job(persisted + 2, persisted + 1))


def test_too_close_to_the_next_persisted_iteration_waits() -> None:
    persisted = 8 * PERSIST_EVERY
    last = persisted + PERSIST_EVERY - PEER_MARGIN
    assert replicas_past_persisted(job(last, last))
    assert not replicas_past_persisted(job(last + 1, last + 1))


def test_nothing_known_yet_waits() -> None:
    assert not replicas_past_persisted(job(None, None))
    assert not replicas_past_persisted(job(12, None))
    assert not replicas_past_persisted({})
