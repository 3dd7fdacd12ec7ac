"""Heartbeats: REST to the root (embedded mode) or an etcd lease under the job's prefix (etcd mode).

Either way the heartbeat carries a summary of what the machine holds. In etcd mode the key lives on a
lease with a short TTL: when the agent dies the lease expires and the root leader, watching the prefix,
sees the key's deletion within about a TTL.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aetcd

from worker_lib.api.worker import HeartbeatResponse
from worker_lib.client import RootClient, RootRejected, RootUnavailable

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
) -> None:
    while True:
        try:
            on_response(await client.heartbeat(rank, instance_id, summary()))
        except RootRejected as exc:
            if exc.code in REPLACED_CODES:
                raise Replaced(exc.message) from exc
            log.warning("heartbeat refused: %s", exc)
        except RootUnavailable as exc:
            log.info("heartbeat not delivered: %s", exc)
        await asyncio.sleep(interval_s)


async def etcd_heartbeats(
    endpoints: list[str], key: str, ttl_s: float, interval_s: float, summary: Summary
) -> None:
    """Keep `key` alive on a lease of `ttl_s`, refreshed every `interval_s`, its value the summary."""
    while True:
        host, _, port = endpoints[0].partition(":")
        try:
            async with aetcd.Client(host, int(port or 2379), timeout=max(1.0, ttl_s)) as client:
                lease = await client.lease(max(1, round(ttl_s)))
                last = None
                while True:
                    refreshed = await lease.refresh()
                    if getattr(refreshed, "TTL", 1) <= 0:
                        break  # the lease lapsed (etcd unreachable for too long): take a new one
                    value = json.dumps(summary(), sort_keys=True).encode()
                    if value != last:
                        await client.put(key.encode(), value, lease=lease)
                        last = value
                    await asyncio.sleep(interval_s)
        except (aetcd.exceptions.ClientError, OSError) as exc:
            log.warning("etcd heartbeat failed (%s); retrying", exc)
            endpoints = endpoints[1:] + endpoints[:1]
            await asyncio.sleep(min(interval_s, 0.5))
