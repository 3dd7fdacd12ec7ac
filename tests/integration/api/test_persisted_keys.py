"""Persisted-checkpoint keys are the root's, never a worker's: a job's valid worker token reporting hostile
keys, or ranks its machine does not run, is refused, and retention then deletes only inside that job's
own prefix. Against the real persistent tiers: a moto S3 server and a local directory, on Postgres and
SQLite."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aioboto3
import httpx
import pytest
from fastapi import FastAPI

from services.root.app import create_app
from services.root.db.models import PersistedCheckpoint, PersistedShard
from services.root.settings import Settings
from tests import harness
from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register
from tests.integration.conftest import ADMIN_TOKEN, admin, bearer, create_job, fresh_client
from worker_lib.persistent_keys import shard_key


@dataclass
class Tier:
    """One persistent tier under test, with everything in it listed as keys relative to its root: the
    bucket (S3) or the parent of the persistent directory (local, so a '../' escape shows too)."""

    kind: str
    state_dir: Path
    bucket: str | None = None
    endpoint_url: str | None = None

    @property
    def persistent_dir(self) -> Path:
        return self.state_dir.resolve() / "persistent"

    async def put(self, key: str) -> None:
        if self.kind == "s3":
            async with aioboto3.Session().client("s3", endpoint_url=self.endpoint_url) as s3:
                await s3.put_object(Bucket=self.bucket, Key=key, Body=b"x")
        else:
            path = self.state_dir / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")

    async def keys(self) -> set[str]:
        if self.kind == "s3":
            found = set()
            async with aioboto3.Session().client("s3", endpoint_url=self.endpoint_url) as s3:
                async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                    found |= {item["Key"] for item in page.get("Contents", [])}
            return found
        return {str(p.relative_to(self.state_dir)) for p in self.state_dir.rglob("*") if p.is_file()}

    def key(self, key: str) -> str:
        """A key of the persistent tier as `keys()` lists it."""
        return key if self.kind == "s3" else f"persistent/{key}"


@pytest.fixture(scope="module", params=["s3", "local"])
async def tier_app(
    request: pytest.FixtureRequest, database_kind: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Tier, FastAPI]]:
    state_dir = tmp_path_factory.mktemp("state")
    if database_kind == "postgres":
        database_url = request.getfixturevalue("postgres_server").create_database(
            f"keys_{uuid.uuid4().hex[:8]}"
        )
    else:
        database_url = f"sqlite+aiosqlite:///{state_dir / 'castor.db'}"
    settings = Settings(
        database_url=database_url, admin_token=ADMIN_TOKEN, state_dir=state_dir, heartbeat_timeout_s=3600
    )
    tier = Tier(request.param, state_dir)
    if request.param == "s3":
        moto: harness.Moto = request.getfixturevalue("moto_server")
        tier.bucket, tier.endpoint_url = f"castor-{uuid.uuid4().hex[:8]}", moto.url
        async with aioboto3.Session().client("s3", endpoint_url=moto.url) as s3:
            await s3.create_bucket(Bucket=tier.bucket)
        settings = settings.model_copy(update={"s3_bucket": tier.bucket, "s3_endpoint_url": moto.url})
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        yield tier, app


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def database_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def client(tier_app: tuple[Tier, FastAPI]) -> AsyncIterator[httpx.AsyncClient]:
    async with fresh_client(tier_app[1]) as http:
        yield http


@pytest.fixture
def tier(tier_app: tuple[Tier, FastAPI]) -> Tier:
    return tier_app[0]


def report(job: dict[str, object], rank: int, iteration: int, **fields: object) -> dict[str, object]:
    machine = rank // int(job["procs_per_machine"])  # type: ignore[call-overload]
    body = {"instance_id": f"i-{machine}", "rank": rank, "iteration": iteration, "generation": 1}
    return body | {"digest": f"d{iteration}.{rank}", "nbytes": 1} | fields


async def post_report(
    client: httpx.AsyncClient, job: dict[str, object], machine: int, body: dict[str, object]
) -> httpx.Response:
    return await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/{machine}/persisted",
        json=body,
        headers=bearer(str(job["worker_token"])),
    )


async def started(client: httpx.AsyncClient, **fields: object) -> dict[str, object]:
    job = await create_job(client, machines=2, replicas=2, procs_per_machine=2, **fields)
    for machine in range(2):
        assert (await register(client, job, f"i-{machine}")).status_code == 200
    return job


async def test_hostile_keys_are_refused_and_retention_touches_nothing_outside_the_job(
    client: httpx.AsyncClient, tier: Tier, tier_app: tuple[Tier, FastAPI]
) -> None:
    victim = await started(client)
    attacker = await started(client, keep_persisted=1)
    a, b = str(victim["id"]), str(attacker["id"])
    victims = {
        shard_key("castor", a, 10, rank) + f"/{name}" for rank in range(4) for name in ("data.bin", "m")
    }
    unrelated = {"other/keep.bin", "castor-archive/keep.bin"}
    for key in victims | unrelated:
        await tier.put(tier.key(key))
    outside = "outside.bin"  # next to the local tier's directory: what '../' would reach
    await tier.put(outside)
    ours = {shard_key("castor", b, it, rank) + "/data.bin" for it in (10, 20, 30) for rank in range(4)}
    for key in ours:
        await tier.put(tier.key(key))

    hostile = [
        "castor/x",
        "castor",
        "../",
        "..",
        "../outside.bin",
        "/etc",
        "other",
        f"castor/{a}",
        shard_key("castor", a, 10, 0),  # the victim's own shard of the same (iteration, rank)
        shard_key("castor", b, 10, 0) + "/../../../" + a,
        shard_key("castor", b, 10, 1),  # the attacker's own job, but another rank's key
        shard_key("castor", b, 10, 0, generation=2),
    ]
    for key in hostile:
        response = await post_report(client, attacker, 0, report(attacker, 0, 10, key=key))
        error = assert_error(response, 422, "persisted_key_mismatch")
        assert error["details"] == {"expected": shard_key("castor", b, 10, 0)}
    for location in ("s3://elsewhere/castor", "file:///", f"file://{tier.persistent_dir}/castor/{a}"):
        body = report(attacker, 0, 10, location=location)
        assert_error(await post_report(client, attacker, 0, body), 422, "persisted_location_mismatch")
    # Machine 0 runs ranks 0 and 1 (rank = machine * procs_per_machine + local rank), no other.
    for rank in (2, 3, 99):
        body = report(attacker, rank, 10, instance_id="i-0")
        assert_error(await post_report(client, attacker, 0, body), 403, "rank_not_hosted")
    # The attacker's token cannot report into the victim's job at all.
    stolen = victim | {"worker_token": attacker["worker_token"]}
    response = await post_report(client, stolen, 0, report(victim, 0, 10))
    assert_error(response, 403, "forbidden")
    checkpoints = (await client.get(f"/api/v1/jobs/{b}/checkpoints", headers=admin())).json()
    assert checkpoints == [], "a refused report records nothing"

    # A shard recorded before the root computed keys may hold anything: expiry must not read it back.
    async with tier_app[1].state.castor.database.session() as session:
        legacy = PersistedCheckpoint(job_id=uuid.UUID(b), iteration=5, location="castor")
        session.add(legacy)
        await session.flush()
        session.add(PersistedShard(checkpoint_id=legacy.id, rank=0, key="castor/x", digest="", nbytes=0))

    # Now the attacker's job persists three complete checkpoints (the key named or not): keep 1, so
    # iterations 5, 10 and 20 expire, and retention deletes with the root's own credentials.
    for iteration in (10, 20, 30):
        for rank in range(4):
            named = {"key": shard_key("castor", b, iteration, rank)} if rank % 2 else {}
            body = report(attacker, rank, iteration, **named)
            response = await post_report(client, attacker, rank // 2, body)
            assert response.status_code == 204, response.text

    checkpoints = (await client.get(f"/api/v1/jobs/{b}/checkpoints", headers=admin())).json()
    assert [c["iteration"] for c in checkpoints] == [30]
    location = (
        f"s3://{tier.bucket}/castor/{b}/iteration-30"
        if tier.kind == "s3"
        else f"file://{tier.persistent_dir}/castor/{b}/iteration-30"
    )
    assert checkpoints[0]["location"] == location
    assert [s["key"] for s in checkpoints[0]["shards"]] == [shard_key("castor", b, 30, r) for r in range(4)]

    left = await tier.keys()
    assert {tier.key(k) for k in victims | unrelated} <= left, "nothing of another job, nor outside castor/"
    assert outside in left
    kept = {k for k in ours if "/iteration-30/" in k}
    assert {k for k in left if f"castor/{b}/" in k} == {tier.key(k) for k in kept}, "the job's own expired"
