"""Heartbeats: REST to the root (embedded mode) or an etcd lease under the job's prefix (etcd mode).

Either way the heartbeat carries a summary of what the machine holds. In etcd mode the key lives on a
lease with a short TTL: when the agent dies the lease expires and the root leader, watching the prefix,
sees the key's deletion within about a TTL. The keepalive is the liveness; the summary on the key is
rewritten once a summary period (the root's, or SUMMARY_PERIOD_S), on a clock of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable
from typing import Any

import aetcd

from worker_lib.api.worker import HeartbeatResponse
from worker_lib.client import RootClient, RootRejected, RootUnavailable, UnexpectedAnswer

log = logging.getLogger(__name__)

Summary = Callable[[], dict[str, Any]]


REPLACED_CODES = ("instance_replaced", "not_registered")  # the root's answers to a replaced machine


class Replaced(Exception):
    """The root says this machine no longer holds its rank (it was declared failed and replaced)."""


async def rest_heartbeats(
    client: RootClient,
    rank: int,
    instance_id: str,
    interval_s: float,
    summary: Summary,
    on_response: Callable[[HeartbeatResponse], None] = lambda response: None,
    wake: asyncio.Event | None = None,
) -> None:
    """Heartbeat every `interval_s`, and at once whenever `wake` is set."""
    while True:
        try:
            on_response(await client.heartbeat(rank, instance_id, summary()))
        except RootRejected as exc:
            if exc.code in REPLACED_CODES:
                raise Replaced(exc.message) from exc
            log.warning("heartbeat refused: %s", exc)
        except RootUnavailable as exc:
            log.info("heartbeat not delivered: %s", exc)
        except UnexpectedAnswer as exc:  # a proxy's page, a root of another version: tried again
            log.warning("heartbeat answered with something else than the root's API: %s", exc)
        if wake is None:
            await asyncio.sleep(interval_s)
            continue
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that arrives as the
        # event is set, and this loop then ran on, holding the agent's stop (it waits for its loops) forever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await wake.wait()
        wake.clear()


# The summary rides on the key, but liveness is the lease's keepalive alone: the key is put when a lease is
# new and then at most this often (when the summary changed). A summary changes with every iteration, and a
# put per refresh (three a second per machine at a 1 s TTL) is a write for etcd's raft log and an event on
# the root leader's watch, the same loop that must see lease expiries: at 100 machines, 300 a second.
SUMMARY_PERIOD_S = 2.0


def next_summary_due(due: float | None, now: float, period_s: float) -> float:
    """When the summary is next rewritten, after a put at `now` that was due at `due` (None: the lease's
    first put). A job's agents start together, and rewriting every period from their start they did so
    within the same second or two each period: at 1,000 machines a burst of a thousand puts that kept
    etcd and the root leader's watch at a full core for two seconds and held every lease refresh behind
    it for up to 1.2 s. So the first rewrite comes after a random part of the period, and later ones keep
    their own phase, a period after the last was due, not after it was made: a put held back (behind a
    slow refresh, as a burst of registrations makes them) would otherwise line up with every other put
    held back with it. One more than a period late starts afresh, at a random part of the period."""
    if due is None or now - due >= period_s:
        return now + period_s * random.random()
    return due + period_s


async def etcd_heartbeats(
    endpoints: list[str],
    key: str,
    ttl_s: float,
    interval_s: float,
    summary: Summary,
    *,
    summary_period_s: float = SUMMARY_PERIOD_S,
) -> None:
    """Keep `key` alive on a lease of `ttl_s`, refreshed every `interval_s`; its value, the summary, is put
    with a new lease and then rewritten (when it changed) every `summary_period_s` (next_summary_due)."""
    loop = asyncio.get_running_loop()
    while True:
        host, _, port = endpoints[0].partition(":")
        try:
            async with aetcd.Client(host, int(port or 2379), timeout=max(1.0, ttl_s)) as client:
                lease = await client.lease(max(1, round(ttl_s)))
                last: bytes | None = None
                # The first refresh after a random part of the interval (the TTL is several): a job's
                # leases are granted together (at its start, after an etcd outage), and refreshed every
                # interval from then on they would be refreshed together for good.
                refresh_at = loop.time() + random.random() * interval_s
                due: float | None = None  # the summary's next rewrite (None: put it now, the lease is new)
                while True:
                    if loop.time() >= refresh_at:
                        refreshed = await lease.refresh()
                        if getattr(refreshed, "TTL", 1) <= 0:
                            break  # the lease lapsed (etcd unreachable for too long): take a new one
                        refresh_at = loop.time() + interval_s
                    if due is None or loop.time() >= due:
                        value = json.dumps(summary(), sort_keys=True).encode()
                        if value != last:
                            await client.put(key.encode(), value, lease=lease)
                        due, last = next_summary_due(due, loop.time(), summary_period_s), value
                    await asyncio.sleep(max(0.0, min(refresh_at, due) - loop.time()))
        except (aetcd.exceptions.ClientError, OSError) as exc:
            log.warning("etcd heartbeat failed (%s); retrying", exc)
            endpoints = endpoints[1:] + endpoints[:1]
            await asyncio.sleep(min(interval_s, 0.5))
