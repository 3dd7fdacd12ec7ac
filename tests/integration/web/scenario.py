"""A job driven through the public and worker APIs the way agents drive it: machines register and
heartbeat, a training process dies (a software failure), the leader opens a recovery, the machines report
their inventories, the plan comes out, they restore and resume. Every value the pages show comes from
these calls and the real flows behind them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.integration.conftest import admin, bearer, create_job


async def eventually(check: Callable[[], Awaitable[Any]], what: str, within: float = 20.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out after {within}s waiting for {what}")


@dataclass
class Scenario:
    client: httpx.AsyncClient
    job: dict[str, Any]
    instances: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return str(self.job["id"])

    @property
    def worker(self) -> dict[str, str]:
        return bearer(str(self.job["worker_token"]))

    async def api(self, path: str) -> Any:
        response = await self.client.get(f"/api/v1/jobs/{self.id}{path}", headers=admin())
        assert response.status_code == 200, response.text
        return response.json()

    async def post(self, path: str, body: dict[str, Any], status: int) -> httpx.Response:
        response = await self.client.post(
            f"/api/v1/worker/jobs/{self.id}{path}", json=body, headers=self.worker
        )
        assert response.status_code == status, response.text
        return response

    async def register(self, instances: list[str]) -> None:
        for rank, instance in enumerate(instances):
            body = {"instance_id": instance, "address": "127.0.0.1", "data_port": 7000 + rank, "rank": rank}
            await self.post("/machines", body, 200)
        self.instances = list(instances)

    async def heartbeat(self, iteration: int, *, lag: float = 0.02) -> None:
        machines = len(self.instances)
        for rank, instance in enumerate(self.instances):
            peer = rank ^ 1 if (rank ^ 1) < machines else rank
            summary = {
                "local": {str(rank): iteration},
                "replicas": {str(peer): iteration - 1},
                "committed": iteration + 1,
                "replicated": iteration,
                "skipped": 0,
                "per_minute": 120.0,
                "replication_lag_s": lag * (rank + 1),
                "uploaded": 0,
                "warm_spares": 1,
            }
            await self.post(f"/machines/{rank}/heartbeat", {"instance_id": instance, "summary": summary}, 200)

    async def kill_process(self, rank: int, exit_code: int = -9, error: dict[str, str] | None = None) -> int:
        body: dict[str, Any] = {
            "instance_id": self.instances[rank],
            "local_rank": 0,
            "global_rank": rank,
            "exit_code": exit_code,
        }
        if error is not None:
            body["error"] = error
        response = await self.post(f"/machines/{rank}/exits", body, 202)
        failure_id = response.json()["failure_id"]
        assert isinstance(failure_id, int)
        return failure_id

    async def plan(self, generation: int, status: str) -> dict[str, Any]:
        async def ready() -> dict[str, Any] | None:
            # The directive first: a plan read after it is at least as new.
            directive = await self.client.get(f"/api/v1/worker/jobs/{self.id}/directive", headers=self.worker)
            if directive.json()["status"] != status or directive.json()["generation"] != generation:
                return None
            if (await self.api(""))["state"] != "recovering":
                return None
            plans = await self.api("/recovery-plans")
            return next((p for p in plans if p["generation"] == generation), None)

        return dict(await eventually(ready, f"plan {generation} {status}"))

    async def recover(self, iteration: int, *, corrupt_rank: int | None = None) -> None:
        """Report inventories for recovery generation 2 (every machine holds `iteration` of its own rank
        and its peer's replica; `corrupt_rank`'s own copy fails its checksum), then restore and resume."""
        generation = 2
        plan = await self.collect(generation, iteration, corrupt_rank=corrupt_rank)
        tiers = {s["rank"]: s for s in plan["sources"]}
        machines = len(self.instances)
        assert sorted(tiers) == list(range(machines)), plan
        for rank, instance in enumerate(self.instances):
            source = tiers[rank]
            details = {str(rank): {"tier": source["tier"], "seconds": 0.25, "source": source["source_rank"]}}
            body = {
                "instance_id": instance,
                "generation": generation,
                "event": "restored",
                "details": details,
            }
            await self.post(f"/machines/{rank}/progress", body, 204)
        for rank, instance in enumerate(self.instances):
            body = {"instance_id": instance, "generation": generation, "event": "resumed"}
            await self.post(f"/machines/{rank}/progress", body, 204)

        async def recovered() -> bool:
            return (await self.api(""))["state"] == "running"

        await eventually(recovered, "the job to run again")

    async def collect(
        self,
        generation: int,
        iteration: int,
        *,
        corrupt_rank: int | None = None,
        uploading: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        """Report every machine's inventory for recovery `generation` (each holds `iteration` of its own rank
        and its peer's replica; `corrupt_rank`'s own copy fails its checksum; `uploading`: the (iteration,
        generation) every machine's rank still uploads); returns the ready plan."""
        await self.plan(generation, "collecting")
        machines = len(self.instances)
        for rank, instance in enumerate(self.instances):
            peer = rank ^ 1 if (rank ^ 1) < machines else rank
            holdings = [
                {
                    "rank": rank,
                    "iteration": iteration,
                    "tier": "local",
                    "digest": f"{rank:02d}" * 8,
                    "data_bytes": 4096,
                    "verified": rank != corrupt_rank,
                    "problem": "stripe 3: checksum mismatch" if rank == corrupt_rank else None,
                },
                {
                    "rank": peer,
                    "iteration": iteration,
                    "tier": "replica",
                    "digest": f"{peer:02d}" * 8,
                    "data_bytes": 4096,
                    "verified": True,
                },
            ]
            body = {"instance_id": instance, "generation": generation, "holdings": holdings}
            if uploading is not None:
                body["uploading"] = [{"rank": rank, "iteration": uploading[0], "generation": uploading[1]}]
            await self.post(f"/machines/{rank}/inventory", body, 204)
        return await self.plan(generation, "ready")


async def running_job(client: httpx.AsyncClient, machines: int = 4, *, prefix: str = "i") -> Scenario:
    scenario = Scenario(client, await create_job(client, machines=machines, replicas=2))
    await scenario.register([f"{prefix}-{rank}" for rank in range(machines)])
    await scenario.heartbeat(20)
    return scenario
