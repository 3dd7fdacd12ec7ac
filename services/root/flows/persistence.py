"""Persisted checkpoints: agents upload the iteration the root announced (`domain.persist_schedule`; older
agents every K iterations); the root records each rank's shard and, once per checkpoint that becomes
complete, keeps the newest P complete checkpoints (the rules are in `domain.retention`) and announces the
next iteration to persist.

The root computes every key and location itself (`domain.persisted`): a report may only name the key the
root would compute for its (iteration, rank, generation), and only for a rank the reporting machine runs.
What the root deletes at expiry is computed the same way and scoped to the job's own prefix."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.models import Job, PersistedCheckpoint
from services.root.domain import persisted
from services.root.domain.retention import StoredCheckpoint, expired, is_complete
from services.root.errors import Forbidden, Invalid, NotFound
from services.root.flows.machines import live_machine_at, persist_latency_s, persistent_tier, schedule_persist
from services.root.settings import Settings


def stored_checkpoint(checkpoint: PersistedCheckpoint) -> StoredCheckpoint:
    """Retention's view of a checkpoint (its shards loaded). A condemned shard (a restore found it
    corrupt) is left out: a checkpoint that cannot be restored is not complete, and retention must not
    delete an older one for its sake."""
    shards = {s.rank: s.generation for s in checkpoint.shards if s.condemned is None}
    return StoredCheckpoint(checkpoint.iteration, shards)


def tier_of(settings: Settings) -> persisted.Tier:
    tier = persistent_tier(settings)
    return persisted.Tier(kind=tier.kind, prefix=tier.prefix, bucket=tier.bucket, path=tier.path)


async def record_persisted(
    database: Database,
    job_id: uuid.UUID,
    machine_rank: int,
    report: schemas.PersistedReport,
    tier: persisted.Tier,
    settings: Settings | None = None,
) -> list[str]:
    """Record one rank's uploaded shard; returns the key prefixes of checkpoints to delete now (all
    inside `persisted.job_scope(tier, job)`). `settings`: for flows.machines.persist_latency_s.

    Every rank persists the announced iteration at about the same time: a report writes its own shard's
    row (an upsert) and commits, locking nothing shared, then counts the checkpoint's shards. A report
    that finds every rank's shard there takes the job row's lock to decide completion, announce the next
    iteration and expire old checkpoints (of the last reports at once, the first announces; the others
    find the announcement moved on and nothing left to expire)."""
    for attempt in range(SHARD_TRIES):
        try:
            async with database.session() as session:
                job = await repo.get_job(session, job_id)
                if job is None:
                    raise NotFound(f"job {job_id} does not exist", code="job_not_found")
                recorded = await _record_shard(session, job, machine_rank, report, tier)
                if recorded is None:
                    return []
                checkpoint_id = recorded
                world_size = job.num_machines * job.procs_per_machine
            break
        except IntegrityError:
            # Its checkpoint was expired (deleted) between the two statements: record it anew, as a report
            # arriving after the expiry does.
            if attempt == SHARD_TRIES - 1:
                raise
    async with database.session() as session:
        # Counted after the shard's commit, not in its transaction: there, reports at once each missed the
        # others' uncommitted shards and none completed the checkpoint. Counted after, the report that
        # commits last sees every shard. Ranks still to come: nothing completes (no O(W) work per report).
        if await repo.shard_count(session, checkpoint_id) < world_size:
            return []
        job = await repo.get_job(session, job_id, for_update=True)
        if job is None:
            return []
        return await _completed(session, job, report, tier, settings)


# How often a shard report is tried when its checkpoint is deleted under it (a late report, expiring).
SHARD_TRIES = 3


async def _record_shard(
    session: AsyncSession, job: Job, machine_rank: int, report: schemas.PersistedReport, tier: persisted.Tier
) -> int | None:
    """Check and record the shard; its checkpoint's id (None: a late shard, not recorded)."""
    await live_machine_at(session, job, machine_rank, report.instance_id)
    hosted = persisted.hosted_ranks(machine_rank, job.procs_per_machine)
    if report.rank not in hosted:
        raise Forbidden(
            f"machine {machine_rank} runs ranks {hosted.start}..{hosted.stop - 1}, not rank {report.rank}",
            code="rank_not_hosted",
            details={"rank": report.rank, "hosted": [hosted.start, hosted.stop - 1]},
        )
    await _check_announced(session, job, report)
    job_id = str(job.id)
    key = persisted.shard_of(tier, job_id, report.iteration, report.rank, report.generation)
    location = persisted.checkpoint_location(tier, job_id, report.iteration)
    # Older agents name the key and location they uploaded to: accepted only if they are the root's own.
    for field, named, computed in (("key", report.key, key), ("location", report.location, location)):
        if named is not None and named != computed:
            raise Invalid(
                f"the persisted {field} of rank {report.rank} iteration {report.iteration} generation "
                f"{report.generation} is {computed!r}; the report names {named!r}",
                code=f"persisted_{field}_mismatch",
                details={"expected": computed},
            )
    checkpoint_id = await repo.persisted_checkpoint_id(session, job.id, report.iteration, location)
    recorded = await repo.record_shard(
        session,
        checkpoint_id,
        report.rank,
        key=key,
        digest=report.digest,
        nbytes=report.nbytes,
        generation=report.generation,
    )
    if not recorded:
        return None  # a late upload from before a rollback: the newer history's shard stays recorded
    return checkpoint_id


async def _check_announced(session: AsyncSession, job: Job, report: schemas.PersistedReport) -> None:
    """Once the root has announced an iteration to persist (a current root does from the job's first
    heartbeats), a shard may be of no generation the job has not reached and of no iteration past the
    announced one. Agents persist only announced iterations; a target moves back only with a rollback,
    past which the older generation's shards are off the timeline anyway. Without this, a report of an
    iteration never trained (a confused agent) could complete a checkpoint that retention then keeps in
    place of the real ones, deleting them. Before any announcement (older agents persist every K on their
    own) reports are taken as they come."""
    announced = job.persist_iteration
    if announced is None:
        return
    current = await repo.latest_generation(session, job.id) or 1
    if report.generation > current:
        raise Invalid(
            f"rank {report.rank}'s persisted shard is of generation {report.generation}; the job's newest "
            f"is {current}",
            code="persisted_generation_unknown",
            details={"generation": current},
        )
    if report.iteration > announced:
        raise Invalid(
            f"rank {report.rank}'s persisted shard is of iteration {report.iteration}, past the iteration "
            f"{announced} the root announced for persisting",
            code="persisted_iteration_unannounced",
            details={"announced": announced},
        )


async def _completed(
    session: AsyncSession,
    job: Job,
    report: schemas.PersistedReport,
    tier: persisted.Tier,
    settings: Settings | None,
) -> list[str]:
    """Under the job row's lock: if the report's checkpoint is complete, announce the next iteration (if it
    was the announced one) and expire what retention drops."""
    checkpoint = await repo.persisted_checkpoint(session, job.id, report.iteration)
    if checkpoint is None:
        return []  # expired meanwhile
    world_size = job.num_machines * job.procs_per_machine
    resumed_from = await repo.resumed_from(session, job.id)
    stored = stored_checkpoint(checkpoint)
    if not is_complete(stored, world_size=world_size, resumed_from=resumed_from):
        return []
    # This report completed the checkpoint: retention runs once per completed checkpoint, and the next
    # iteration to persist is announced if this was the announced one.
    if job.persist_iteration == report.iteration and job.persist_generation == report.generation:
        await schedule_persist(
            session,
            job,
            await repo.live_summaries(session, job.id),
            await repo.released_generation(session, job.id),
            persist_latency_s(settings, job.num_machines),
            complete=True,
        )
    return await _expire(session, job, tier, resumed_from)


async def _expire(
    session: AsyncSession, job: Job, tier: persisted.Tier, resumed_from: dict[int, int | None]
) -> list[str]:
    checkpoints = {c.iteration: c for c in await repo.list_persisted(session, job.id)}
    doomed = expired(
        [stored_checkpoint(c) for c in checkpoints.values()],
        world_size=job.num_machines * job.procs_per_machine,
        keep=job.keep_persisted,
        resumed_from=resumed_from,
    )
    prefixes = []
    for stored in doomed:
        checkpoint = checkpoints[stored.iteration]
        # <prefix>/<job>/iteration-<I>/rank-<r>: this rank's shards of the iteration, every generation's
        prefixes += persisted.expired_prefixes(
            tier, str(job.id), checkpoint.iteration, (shard.rank for shard in checkpoint.shards)
        )
        await session.delete(checkpoint)
    return prefixes


async def checkpoints_out(
    session: AsyncSession, job: Job, checkpoints: Sequence[PersistedCheckpoint]
) -> list[schemas.PersistedCheckpointOut]:
    """The API's view of persisted checkpoints (their shards loaded): complete when every rank's shard is
    there on the current timeline, as retention counts them (a shard of a history the job rolled back from
    does not complete a checkpoint of the new one)."""
    world_size = job.num_machines * job.procs_per_machine
    resumed_from = await repo.resumed_from(session, job.id) if checkpoints else {}
    return [
        schemas.PersistedCheckpointOut(
            iteration=c.iteration,
            location=c.location,
            created_at=c.created_at,
            complete=is_complete(
                stored_checkpoint(c),
                world_size=world_size,
                resumed_from=resumed_from,
            ),
            shards=[schemas.PersistedShardOut.model_validate(s) for s in c.shards],
        )
        for c in checkpoints
    ]
