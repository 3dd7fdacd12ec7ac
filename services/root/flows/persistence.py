"""Persisted checkpoints: agents upload every K iterations; the root records each rank's shard and keeps
the newest P complete checkpoints (the rules are in `domain.retention`)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.models import Job, PersistedCheckpoint, PersistedShard
from services.root.domain.retention import StoredCheckpoint, expired
from services.root.flows.machines import live_machine_at


async def record_persisted(
    session: AsyncSession, job: Job, rank: int, report: schemas.PersistedReport
) -> list[str]:
    """Record one rank's uploaded shard; returns the key prefixes of checkpoints to delete now."""
    await live_machine_at(session, job, rank, report.instance_id)
    checkpoint = await repo.persisted_checkpoint(session, job.id, report.iteration)
    if checkpoint is None:
        checkpoint = PersistedCheckpoint(job_id=job.id, iteration=report.iteration, location=report.location)
        session.add(checkpoint)
        await session.flush()
        await session.refresh(checkpoint, ["shards"])
    shard = next((s for s in checkpoint.shards if s.rank == report.rank), None)
    if shard is None:
        shard = PersistedShard(
            checkpoint_id=checkpoint.id, rank=report.rank, key=report.key, digest="", nbytes=0, generation=0
        )
        checkpoint.shards.append(shard)
    if report.generation < shard.generation:
        return []  # a late upload from before a rollback: the newer history's shard stays recorded
    shard.key, shard.digest, shard.nbytes, shard.generation = (
        report.key,
        report.digest,
        report.nbytes,
        report.generation,
    )
    await session.flush()
    return await _expire(session, job)


async def _expire(session: AsyncSession, job: Job) -> list[str]:
    checkpoints = {c.iteration: c for c in await repo.list_persisted(session, job.id)}
    doomed = expired(
        [
            StoredCheckpoint(c.iteration, {shard.rank: shard.generation for shard in c.shards})
            for c in checkpoints.values()
        ],
        world_size=job.num_machines * job.procs_per_machine,
        keep=job.keep_persisted,
        resumed_from=await repo.resumed_from(session, job.id),
    )
    prefixes = []
    for stored in doomed:
        checkpoint = checkpoints[stored.iteration]
        # <prefix>/<job>/iteration-<I>/rank-<r>: this rank's shards of the iteration, every generation's
        prefixes += sorted({shard.key.rsplit("/", 1)[0] for shard in checkpoint.shards})
        await session.delete(checkpoint)
    return prefixes
