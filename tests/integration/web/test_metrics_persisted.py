"""/metrics for the persistent tier (what ops/prometheus/alerts.yml's CastorPersistentTierBehind watches):
the newest persisted iteration counts only checkpoints every rank's shard reached, and persist_every is
exported beside it."""

from __future__ import annotations

import uuid

import httpx
from fastapi import FastAPI

from services.root.db import repository as repo
from tests.integration.web.scenario import running_job
from tests.integration.web.test_metrics import scrape, value


async def test_persisted_iteration_counts_complete_checkpoints_only(client: httpx.AsyncClient) -> None:
    job = await running_job(client, machines=2)
    name = str(job.job["name"])
    samples = await scrape(client)
    assert value(samples, "castor_job_persist_every", job=name) == job.job["persist_every"]
    assert ("castor_job_persisted_iteration", frozenset({("job", name)})) not in samples, "none yet"

    async def persisted(rank: int, iteration: int) -> None:
        body = {"instance_id": job.instances[rank], "rank": rank, "iteration": iteration, "digest": "ab" * 8}
        await job.post(f"/machines/{rank}/persisted", body | {"nbytes": 64}, 204)

    await persisted(0, 10)
    await persisted(1, 10)
    await persisted(0, 20)  # rank 1's shard of iteration 20 has not arrived: not a checkpoint yet
    samples = await scrape(client)
    assert value(samples, "castor_job_persisted_iteration", job=name) == 10
    await persisted(1, 20)
    assert value(await scrape(client), "castor_job_persisted_iteration", job=name) == 20


async def test_a_condemned_shard_leaves_its_checkpoint_out_of_the_persisted_iteration_and_the_page(
    root_app: FastAPI, client: httpx.AsyncClient, signed_in: httpx.AsyncClient
) -> None:
    """A restore found rank 1's shard of iteration 20 corrupt: the newest usable checkpoint is 10, as
    retention and the API count it. Before, /metrics said 20 (the tier-behind alert stayed quiet) and the
    job page listed 20 as complete."""
    job = await running_job(client, machines=2)
    name = str(job.job["name"])
    for iteration in (10, 20):
        for rank in (0, 1):
            body = {"instance_id": job.instances[rank], "rank": rank, "iteration": iteration}
            await job.post(
                f"/machines/{rank}/persisted", body | {"digest": f"{rank:02d}" * 8, "nbytes": 64}, 204
            )
    assert value(await scrape(client), "castor_job_persisted_iteration", job=name) == 20
    async with root_app.state.castor.database.session() as session:
        assert await repo.condemn_shard(session, uuid.UUID(job.id), 20, 1, "01" * 8, "stripe 0: checksum")
    assert value(await scrape(client), "castor_job_persisted_iteration", job=name) == 10
    checkpoints = {c["iteration"]: c["complete"] for c in await job.api("/checkpoints")}
    assert checkpoints == {10: True, 20: False}
    page = (await signed_in.get(f"/jobs/{job.id}")).text
    assert 'class="badge state-recovering">partial</span> 1/2' in page


async def test_the_job_page_adds_up_shard_sizes_past_64_bits(
    client: httpx.AsyncClient, signed_in: httpx.AsyncClient
) -> None:
    """Two shards reported at the largest size the API takes: their sum is past SQLite's integers (before,
    the job page answered 500 until the checkpoint expired)."""
    job = await running_job(client, machines=2)
    for rank in (0, 1):
        body = {"instance_id": job.instances[rank], "rank": rank, "iteration": 10, "digest": "ab" * 8}
        await job.post(f"/machines/{rank}/persisted", body | {"nbytes": 2**63 - 1}, 204)
    page = await signed_in.get(f"/jobs/{job.id}")
    assert page.status_code == 200, page.text
    assert 'data-label="Size">16777216.0 TiB</td>' in page.text  # 2**64 bytes
