"""etcd v3 through aetcd: leader election among root replicas, and the agents' heartbeat keys.

Election: a candidate puts the leader key only if it does not exist (a transaction on version == 0), on a
lease it keeps alive; when the leader dies its lease expires, the key disappears and another candidate
wins. The leadership's epoch (its fencing token) is the etcd revision that created the key. The leader acts
only until its lease's deadline by its own clock (the time it sent the last successful refresh plus the TTL
granted): a refresh that hangs or fails does not extend it, and a leader that cannot refresh in time stops
before etcd can elect another. Every endpoint is used: a call that cannot reach one goes on to the next.
Heartbeats: each agent keeps `<prefix>/jobs/<job>/machines/<rank>/<instance>` on its own short
lease; the leader watches the prefix and treats a DELETE as the machine's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd

log = logging.getLogger(__name__)

CoordinatorUnavailable = (aetcd.exceptions.ClientError, OSError)
T = TypeVar("T")


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
        self.endpoints = endpoints
        self.prefix = prefix.rstrip("/")
        self.leader_key = f"{self.prefix}/leader".encode()
        self.leader_ttl_s = leader_ttl_s
        # One client per endpoint; calls go to the current one and move on to the next when it is down.
        self._clients = []
        for endpoint in endpoints:
            host, _, port = endpoint.partition(":")
            self._clients.append(aetcd.Client(host, int(port or 2379), timeout=5))
        self._current = 0
        self.epoch: int | None = None  # the revision that elected this candidate, while it leads
        self.deadline = 0.0  # time.monotonic() past which this leader must not act

    @property
    def _client(self) -> aetcd.Client:
        return self._clients[self._current]

    async def _call(
        self, operation: Callable[[aetcd.Client], Awaitable[T]], *, attempt_s: float | None = None
    ) -> T:
        """`operation` on the current endpoint's client; on a connection error, on the next ones in turn.
        `attempt_s`: how long one endpoint may take before the next is tried. A member that died silently
        (no RST: its host froze or lost power) answers nothing until gRPC's own 5 s deadline, longer than
        the leader lease's TTL: without it the lease expired with the other endpoints never tried."""
        failure: BaseException | None = None
        for _ in range(len(self._clients)):
            client = self._clients[self._current]
            try:
                if attempt_s is None:
                    return await operation(client)
                async with asyncio.timeout(attempt_s):
                    return await operation(client)
            except (TimeoutError, *CoordinatorUnavailable) as exc:
                if isinstance(exc, TimeoutError) and attempt_s is None:
                    raise
                failure = exc
                if len(self._clients) > 1:
                    log.warning(
                        "etcd endpoint %s failed (%s); trying the next",
                        self.endpoints[self._current],
                        exc,
                    )
                    self._current = (self._current + 1) % len(self._clients)
        assert failure is not None
        raise failure

    def leading(self) -> bool:
        """Whether this candidate's leader lease is still valid by its own clock."""
        return self.epoch is not None and time.monotonic() < self.deadline

    async def close(self) -> None:
        for client in self._clients:
            with contextlib.suppress(*CoordinatorUnavailable):
                await client.close()

    async def lead(self, candidate: str, elected: asyncio.Event, lost: asyncio.Event) -> None:
        """Campaign until elected (sets `elected`), then hold the lease; returns when leadership is lost
        (sets `lost`). To step down: set `lost` (a deposition does), or cancel it. Setting `lost` is the
        one that cannot go missing: Python 3.11's `asyncio.wait_for` drops a cancellation that arrives in
        the loop iteration its inner call completes in, and a leader whose cancellation was dropped kept
        its lease alive for minutes, with no replica leading (found by benchmarks/scale.py under load)."""
        lease: Any = None
        try:
            while True:
                asked = time.monotonic()
                lease = await self._call(lambda c: c.lease(self.leader_ttl_s))
                if await self._call(functools.partial(self._claim, candidate, lease)):
                    break
                await self._call(functools.partial(_revoke, lease))
                lease = None
                await asyncio.sleep(self.leader_ttl_s / 4)
            found = await self._call(lambda c: c.get(self.leader_key))
            if found is None or bytes(found.value).decode() != candidate:
                log.error("the leader key vanished right after the election: campaigning again")
                return
            self.epoch, self.deadline = int(found.create_revision), asked + self.leader_ttl_s
            log.info("elected leader (%s) at epoch %d", candidate, self.epoch)
            elected.set()
            while True:
                await asyncio.sleep(max(0.0, min(self.leader_ttl_s / 4, self.deadline - time.monotonic())))
                if lost.is_set():
                    log.warning("deposed: stepping down and releasing the leader lease")
                    return
                sent = time.monotonic()
                if sent >= self.deadline:
                    log.error("leader lease deadline passed without a refresh: stepping down")
                    return
                try:
                    # asyncio.timeout, not wait_for: it never swallows a cancellation (see above).
                    async with asyncio.timeout(self.deadline - sent):
                        # Each endpoint an equal share of the lease's time left: every one is tried before
                        # it ends (one endpoint: all of it, as before).
                        attempt = (self.deadline - sent) / len(self._clients)
                        reply = await self._call(functools.partial(_refresh, lease), attempt_s=attempt)
                except (TimeoutError, *CoordinatorUnavailable) as exc:
                    # Not yet a reason to step down: the lease holds until its deadline; try again.
                    log.warning("leader lease refresh failed (%s); %.1fs left", exc, self.deadline - sent)
                    continue
                ttl = getattr(reply, "TTL", 0)
                if ttl <= 0:
                    log.error("leader lease expired: stepping down")
                    return
                self.deadline = max(self.deadline, sent + min(ttl, self.leader_ttl_s))
        except CoordinatorUnavailable as exc:
            log.error("lost etcd while leading or campaigning: %s", exc)
        finally:
            self.epoch = None
            lost.set()
            if lease is not None:
                with contextlib.suppress(*CoordinatorUnavailable):
                    await self._call(functools.partial(_revoke, lease))

    async def _claim(self, candidate: str, lease: Any, client: aetcd.Client) -> bool:
        """Put the leader key on `lease` if nobody holds it."""
        won, _ = await client.transaction(
            compare=[client.transactions.version(self.leader_key) == 0],
            success=[client.transactions.put(self.leader_key, candidate.encode(), lease=lease)],
            failure=[],
        )
        return bool(won)

    async def leader(self) -> str | None:
        found = await self._call(lambda c: c.get(self.leader_key))
        return None if found is None else bytes(found.value).decode()

    async def machine_keys(self) -> dict[MachineKey, dict[str, Any]]:
        """Every live agent key (and its heartbeat summary) under the prefix."""
        found = {}
        for kv in await self._call(lambda c: c.get_prefix(f"{self.prefix}/jobs/".encode())):
            key = MachineKey.parse(self.prefix, bytes(kv.key))
            if key is not None:
                found[key] = _decode(bytes(kv.value))
        return found

    async def watch_machines(self) -> AsyncIterator[tuple[str, MachineKey, dict[str, Any]]]:
        """("put" | "delete", key, summary) for every change under the agents' prefix."""
        watch = await self._call(lambda c: c.watch_prefix(f"{self.prefix}/jobs/".encode()))
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


async def _revoke(lease: Any, client: aetcd.Client) -> Any:
    return await client.revoke_lease(lease.id)


async def _refresh(lease: Any, client: aetcd.Client) -> Any:
    return await client.refresh_lease(lease.id)


def _decode(value: bytes) -> dict[str, Any]:
    try:
        decoded = json.loads(value) if value else {}
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}
