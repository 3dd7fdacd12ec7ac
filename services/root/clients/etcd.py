"""etcd v3 through aetcd: leader election among root replicas, and the agents' heartbeat keys.

Election: a candidate puts the leader key only if it does not exist (a transaction on version == 0), on a
lease it keeps alive; when the leader dies its lease expires, the key disappears and another candidate
wins. Heartbeats: each agent keeps `<prefix>/jobs/<job>/machines/<rank>/<instance>` on its own short
lease; the leader watches the prefix and treats a DELETE as the machine's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aetcd

log = logging.getLogger(__name__)

CoordinatorUnavailable = (aetcd.exceptions.ClientError, OSError)


@dataclass(frozen=True)
class MachineKey:
    job_id: uuid.UUID
    rank: int
    instance_id: str

    @classmethod
    def parse(cls, prefix: str, key: bytes) -> MachineKey | None:
        parts = key.decode(errors="replace").removeprefix(prefix.rstrip("/") + "/").split("/")
        if len(parts) != 5 or parts[0] != "jobs" or parts[2] != "machines":
            return None
        try:
            return cls(uuid.UUID(hex=parts[1]), int(parts[3]), parts[4])
        except ValueError:
            return None


def machine_key(prefix: str, job_id: uuid.UUID, rank: int, instance_id: str) -> str:
    return f"{prefix.rstrip('/')}/jobs/{job_id.hex}/machines/{rank}/{instance_id}"


class EtcdCoordinator:
    def __init__(self, endpoints: list[str], prefix: str, *, leader_ttl_s: int = 2):
        host, _, port = endpoints[0].partition(":")
        self.endpoints = endpoints
        self.prefix = prefix.rstrip("/")
        self.leader_key = f"{self.prefix}/leader".encode()
        self.leader_ttl_s = leader_ttl_s
        self._client = aetcd.Client(host, int(port or 2379), timeout=5)

    async def close(self) -> None:
        with contextlib.suppress(*CoordinatorUnavailable):
            await self._client.close()

    async def lead(self, candidate: str, elected: asyncio.Event, lost: asyncio.Event) -> None:
        """Campaign until elected (sets `elected`), then hold the lease; returns when leadership is lost
        (sets `lost`). Cancel it to step down."""
        lease = None
        try:
            while True:
                lease = await self._client.lease(self.leader_ttl_s)
                won, _ = await self._client.transaction(
                    compare=[self._client.transactions.version(self.leader_key) == 0],
                    success=[self._client.transactions.put(self.leader_key, candidate.encode(), lease=lease)],
                    failure=[],
                )
                if won:
                    break
                await self._client.revoke_lease(lease.id)
                lease = None
                await asyncio.sleep(self.leader_ttl_s / 4)
            log.info("elected leader (%s)", candidate)
            elected.set()
            while True:
                await asyncio.sleep(self.leader_ttl_s / 4)
                reply = await self._client.refresh_lease(lease.id)
                if getattr(reply, "TTL", 0) <= 0:
                    log.error("leader lease expired: stepping down")
                    return
        except CoordinatorUnavailable as exc:
            log.error("lost etcd while leading or campaigning: %s", exc)
        finally:
            lost.set()
            if lease is not None:
                with contextlib.suppress(*CoordinatorUnavailable):
                    await self._client.revoke_lease(lease.id)

    async def leader(self) -> str | None:
        found = await self._client.get(self.leader_key)
        return None if found is None else bytes(found.value).decode()

    async def machine_keys(self) -> dict[MachineKey, dict[str, Any]]:
        """Every live agent key (and its heartbeat summary) under the prefix."""
        found = {}
        for kv in await self._client.get_prefix(f"{self.prefix}/jobs/".encode()):
            key = MachineKey.parse(self.prefix, bytes(kv.key))
            if key is not None:
                found[key] = _decode(bytes(kv.value))
        return found

    async def watch_machines(self) -> AsyncIterator[tuple[str, MachineKey, dict[str, Any]]]:
        """("put" | "delete", key, summary) for every change under the agents' prefix."""
        watch = await self._client.watch_prefix(f"{self.prefix}/jobs/".encode())
        try:
            async for event in watch:
                key = MachineKey.parse(self.prefix, bytes(event.kv.key))
                if key is None:
                    continue
                kind = "delete" if event.kind == aetcd.EventKind.DELETE else "put"
                yield kind, key, _decode(bytes(event.kv.value))
        finally:
            with contextlib.suppress(*CoordinatorUnavailable):
                await watch.cancel()


def _decode(value: bytes) -> dict[str, Any]:
    try:
        decoded = json.loads(value) if value else {}
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}
