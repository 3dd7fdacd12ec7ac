"""/metrics for the persistent tier (what ops/prometheus/alerts.yml's CastorPersistentTierBehind watches):
the newest persisted iteration counts only checkpoints every rank's shard reached, and persist_every is
exported beside it."""

from __future__ import annotations

import httpx

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
