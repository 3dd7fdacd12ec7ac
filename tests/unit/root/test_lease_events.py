"""The etcd watch's notes (orchestration.detection.LeaseEvents): the watch records events without touching
the database, and what is applied later is each key's newest state: an expiry followed by the key's return
suspects nobody; a put followed by an expiry applies the expiry, without the stale summary."""

from __future__ import annotations

import asyncio
import uuid

from services.root.clients.etcd import MachineKey
from services.root.orchestration.detection import LeaseEvents

JOB = uuid.uuid4()
A, B = MachineKey(JOB, 0, "i-a"), MachineKey(JOB, 1, "i-b")


def test_a_key_that_expired_and_came_back_before_the_events_were_applied_is_alive() -> None:
    events = LeaseEvents()
    events.expired(A)
    events.put(A, {"local": {"0": 7}})
    assert events.take_expired() == set()
    assert events.take_summaries() == {A: {"local": {"0": 7}}}


def test_a_key_put_then_expired_is_an_expiry_without_its_stale_summary() -> None:
    events = LeaseEvents()
    events.put(A, {"local": {"0": 7}})
    events.put(B, {"local": {"1": 7}})
    events.expired(A)
    assert events.take_expired() == {A}
    assert events.take_summaries() == {B: {"local": {"1": 7}}}


def test_events_are_taken_once_and_only_the_newest_summary_of_a_key_is_kept() -> None:
    events = LeaseEvents()
    events.put(A, {"local": {"0": 1}})
    events.put(A, {"local": {"0": 2}})
    assert events.take_summaries() == {A: {"local": {"0": 2}}}
    assert events.take_summaries() == {}
    events.expired(B)
    assert events.take_expired() == {B}
    assert events.take_expired() == set()


async def test_noted_waits_for_an_event_and_returns_once_per_batch() -> None:
    events = LeaseEvents()
    waiter = asyncio.create_task(events.noted())
    await asyncio.sleep(0)
    assert not waiter.done()
    events.expired(A)
    events.expired(B)
    await asyncio.wait_for(waiter, 5)
    second = asyncio.create_task(events.noted())
    await asyncio.sleep(0)
    assert not second.done(), "two events noted before the wake are one batch"
    second.cancel()
