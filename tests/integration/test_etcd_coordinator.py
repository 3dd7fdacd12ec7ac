"""The etcd coordinator on a real etcd: one leader among candidates, hand-over when it dies, and agents'
lease-bound heartbeat keys seen (and their expiry watched) by the root."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from services.root.clients.etcd import EtcdCoordinator, MachineKey, machine_key
from tests import harness
from worker_lib.agent.heartbeat import etcd_heartbeats


def candidates(
    etcd_server: harness.Etcd,
) -> tuple[EtcdCoordinator, EtcdCoordinator, list[asyncio.Event], list[asyncio.Event]]:
    """Two root replicas' coordinators on one fresh prefix, with their `elected` and `lost` events."""
    prefix = f"/test-{uuid.uuid4().hex[:6]}"
    first, second = (EtcdCoordinator([etcd_server.endpoint], prefix) for _ in range(2))
    return first, second, [asyncio.Event(), asyncio.Event()], [asyncio.Event(), asyncio.Event()]


async def test_one_leader_and_a_hand_over(etcd_server: harness.Etcd) -> None:
    first, second, elected, lost = candidates(etcd_server)
    campaign_a = asyncio.create_task(first.lead("a", elected[0], lost[0]))
    await asyncio.wait_for(elected[0].wait(), 5)
    campaign_b = asyncio.create_task(second.lead("b", elected[1], lost[1]))
    await asyncio.sleep(1.5)
    assert not elected[1].is_set(), "one leader at a time"
    assert await second.leader() == "a"

    started = time.monotonic()
    campaign_a.cancel()  # the leader steps down (or dies: its lease expires)
    with contextlib.suppress(asyncio.CancelledError):
        await campaign_a
    await asyncio.wait_for(elected[1].wait(), 10)
    assert time.monotonic() - started < 5 and await first.leader() == "b"
    campaign_b.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await campaign_b
    await first.close()
    await second.close()


async def test_a_deposed_leader_steps_down_by_itself_and_releases_the_key(etcd_server: harness.Etcd) -> None:
    """A deposition (a fenced transaction refused: `lost` set) ends the leadership without a cancellation:
    on Python 3.11 the orchestrator's cancellation can be swallowed by asyncio.wait_for, and a leader that
    went on refreshing its lease left no replica leading for minutes."""
    first, second, elected, lost = candidates(etcd_server)
    campaign_a = asyncio.create_task(first.lead("a", elected[0], lost[0]))
    await asyncio.wait_for(elected[0].wait(), 5)
    campaign_b = asyncio.create_task(second.lead("b", elected[1], lost[1]))
    try:
        lost[0].set()  # what Leadership.depose does; nobody cancels the campaign
        await asyncio.wait_for(campaign_a, 5)
        assert not first.leading()
        await asyncio.wait_for(elected[1].wait(), 5)
        assert await first.leader() == "b"
    finally:
        for campaign in (campaign_a, campaign_b):
            campaign.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await campaign
        await first.close()
        await second.close()


async def test_heartbeat_keys_and_their_expiry(etcd_server: harness.Etcd) -> None:
    prefix = f"/test-{uuid.uuid4().hex[:6]}"
    job = uuid.uuid4()
    coordinator = EtcdCoordinator([etcd_server.endpoint], prefix)
    key = machine_key(prefix, job, 3, "i-abc")
    heartbeat = asyncio.create_task(
        etcd_heartbeats([etcd_server.endpoint], key, 1, 0.3, lambda: {"local": {3: 7}})
    )
    expected = {MachineKey(job, 3, "i-abc"): {"local": {"3": 7}}}
    for _ in range(100):  # up to 10 s: the first put comes once the client connected, late on a loaded host
        if (keys := await coordinator.machine_keys()) == expected:
            break
        await asyncio.sleep(0.1)
    assert keys == expected

    async def first_delete() -> MachineKey:
        async for kind, found, _ in coordinator.watch_machines():
            if kind == "delete":
                return found
        raise AssertionError("watch ended")

    watcher = asyncio.create_task(first_delete())
    await asyncio.sleep(0.3)
    heartbeat.cancel()  # the agent dies: its lease (TTL 1 s) is no longer refreshed
    stopped = time.monotonic()
    assert await asyncio.wait_for(watcher, 10) == MachineKey(job, 3, "i-abc")
    assert time.monotonic() - stopped < 3.5
    await coordinator.close()


async def test_a_heartbeat_keeps_its_key_alive_without_rewriting_it_at_every_refresh(
    etcd_server: harness.Etcd,
) -> None:
    """The keepalive is the liveness; the summary (which changes with every iteration) is put at most once
    per summary period, not at every refresh: each put is an event on the root leader's watch."""
    prefix = f"/test-{uuid.uuid4().hex[:6]}"
    coordinator = EtcdCoordinator([etcd_server.endpoint], prefix)
    key = machine_key(prefix, uuid.uuid4(), 0, "i-busy")
    iteration = iter(range(1_000_000))
    puts = 0
    put_seen = asyncio.Event()

    async def count_puts() -> None:
        nonlocal puts
        async for kind, _, _ in coordinator.watch_machines():
            if kind == "put":
                puts += 1
                put_seen.set()

    watcher = asyncio.create_task(count_puts())
    await asyncio.sleep(0.3)
    refresh_s, period_s = 0.1, 1.0
    heartbeat = asyncio.create_task(
        etcd_heartbeats(
            [etcd_server.endpoint],
            key,
            1,
            refresh_s,
            lambda: {"newest": next(iteration)},
            summary_period_s=period_s,
        )
    )
    try:
        # Counted from a put the watch saw (it may start after the first one): the rewrites keep one phase,
        # a period apart (next_summary_due), so a window of 3 periods holds 3 of them; the watch's delivery
        # or a put held back by a loaded host can move one in or out at each edge of the window.
        await asyncio.wait_for(put_seen.wait(), 10)
        seen, window_s = puts, 3 * period_s
        await asyncio.sleep(window_s)  # 30 refreshes, each with a new summary
        rewrites = puts - seen
        expected_rewrites = round(window_s / period_s)
        assert expected_rewrites - 2 <= rewrites <= expected_rewrites + 2, (
            f"{rewrites} puts in {window_s} s: one a period, not one a refresh ({window_s / refresh_s:.0f})"
        )
        (summary,) = (await coordinator.machine_keys()).values()
        assert summary["newest"] >= 1, "the summary still moves on"
    finally:
        for task in (heartbeat, watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await coordinator.close()
