"""Queries over the models. Functions take the session as their first argument and never commit: the
caller (a request or a background flow) owns the transaction."""

from __future__ import annotations

import functools
import uuid
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, NamedTuple

from sqlalchemy import (
    ColumnElement,
    Float,
    Table,
    and_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import defer, selectinload
from sqlalchemy.sql.elements import BindParameter

from services.root.db.models import (
    FailureEvent,
    FailureState,
    Job,
    JobState,
    Machine,
    MachineState,
    MetricTotal,
    PersistedCheckpoint,
    PersistedShard,
    PlacementGroupRow,
    PlanStatus,
    RankProgress,
    RecoveryPlan,
)
from services.root.domain import embedded
from services.root.domain.embedded import Progress
from services.root.domain.failure_metrics import MetricKey, failure_counters


async def get_job(
    session: AsyncSession, job_id: uuid.UUID, *, for_update: bool = False, skip_locked: bool = False
) -> Job | None:
    """The job; `for_update`: its row locked until the transaction ends, against every other writer of it.
    On Postgres that is FOR NO KEY UPDATE (its id never changes): an insert of a row that refers to the job
    (a registration's machine) checks its foreign key with FOR KEY SHARE, which FOR UPDATE would block.
    `skip_locked` (with `for_update`): None at once, not a wait, when another transaction holds the row.
    A locked read refreshes a job this session loaded before (populate_existing): the row may have changed
    while the lock was awaited, and the identity map would otherwise hand back the stale object."""
    query = select(Job).where(Job.id == job_id)
    if for_update:
        query = query.with_for_update(key_share=True, skip_locked=skip_locked)
        query = query.execution_options(populate_existing=True)
    return (await session.execute(query)).scalar_one_or_none()


async def job_exists(session: AsyncSession, job_id: uuid.UUID) -> bool:
    return (await session.execute(select(Job.id).where(Job.id == job_id))).first() is not None


async def job_by_name(session: AsyncSession, name: str) -> Job | None:
    return (await session.execute(select(Job).where(Job.name == name))).scalar_one_or_none()


async def list_jobs(
    session: AsyncSession, *, state: str | None, limit: int, offset: int
) -> tuple[Sequence[Job], int]:
    query = select(Job)
    if state is not None:
        query = query.where(Job.state == state)
    total = (await session.execute(select(func.count()).select_from(query.subquery()))).scalar_one()
    page = await session.execute(query.order_by(Job.created_at.desc(), Job.id).limit(limit).offset(offset))
    return page.scalars().all(), total


async def delete_job(session: AsyncSession, job: Job) -> None:
    """Delete the job and its history; what its failure events count in /metrics is retired first
    (metric_totals), so the counters do not go down. The job's row is locked first (FOR UPDATE): no failure
    of it is recorded (inserting one checks its foreign key, FOR KEY SHARE) between the retiring and the
    deletion, nor changed by the leader (FOR NO KEY UPDATE)."""
    await session.execute(select(Job.id).where(Job.id == job.id).with_for_update())
    await retire_job_failures(session, job.id)
    await session.execute(delete(RankProgress).where(RankProgress.job_id == job.id))  # no foreign key
    await session.execute(delete(Job).where(Job.id == job.id))


# A machine row's JSON documents: decoding a 1,000-machine job's summaries and inventories costs the root
# tens of ms, and the leader reads the live machines at every tick of a recovery (5 a second).
MachineDocument = Literal["summary", "inventory"]
_MACHINE_DOCUMENTS: tuple[MachineDocument, ...] = ("summary", "inventory")


async def live_machines(
    session: AsyncSession, job_id: uuid.UUID, *, documents: Collection[MachineDocument] = ()
) -> Sequence[Machine]:
    """The machine currently bound to each rank (replaced ones are history), with only the JSON documents
    named in `documents` loaded: reading another one raises, so a caller that needs one says so here
    instead of paying for every document at every call."""
    skipped = [
        defer(getattr(Machine, name), raiseload=True) for name in _MACHINE_DOCUMENTS if name not in documents
    ]
    query = (
        select(Machine)
        .options(*skipped)
        .where(Machine.job_id == job_id, Machine.state != MachineState.REPLACED)
        .order_by(Machine.rank)
    )
    return (await session.execute(query)).scalars().all()


async def live_inventories(session: AsyncSession, job_id: uuid.UUID) -> dict[int, dict[str, Any]]:
    """Each live machine's inventory by its rank (the one read a recovery's plan decision makes)."""
    query = select(Machine.rank, Machine.inventory).where(
        Machine.job_id == job_id, Machine.state != MachineState.REPLACED
    )
    return {int(rank): inventory or {} for rank, inventory in (await session.execute(query)).all()}


async def newest_summary_iterations(
    session: AsyncSession, job_id: uuid.UUID, failed: Collection[int] = ()
) -> list[int]:
    """The newest heartbeat summary's local iterations of every live machine and of the replaced machines
    `failed` (ids): not of those replaced in earlier recoveries, whose last summaries are of a history the
    job has since rolled back from."""
    query = select(Machine.summary).where(
        Machine.job_id == job_id, (Machine.state != MachineState.REPLACED) | Machine.id.in_(list(failed))
    )
    return [
        int(iteration)
        for (summary,) in (await session.execute(query)).all()
        for iteration in (summary or {}).get("local", {}).values()
    ]


class RecoveryProgress(NamedTuple):
    """How far a recovery's generation got on the job's live machines, counted in the database."""

    not_inventoried: int  # live machines without the generation's inventory
    oldest_not_inventoried_registered_at: datetime | None  # the earliest registration among them
    not_restored: int
    not_resumed: int
    any_failed: bool  # a live machine is failed (its replacement has not registered)
    any_embedded: bool


async def recovery_progress(session: AsyncSession, job_id: uuid.UUID, generation: int) -> RecoveryProgress:
    """One aggregate over the job's live machines: the leader asks 5 times a second while a recovery
    waits for its agents, and loading a thousand machines' rows to find who is still missing was the
    largest part of its step."""

    def behind(column: Any) -> ColumnElement[bool]:
        return or_(column.is_(None), column != generation)

    def count(condition: ColumnElement[bool]) -> Any:
        return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)

    query = select(
        count(behind(Machine.inventory_generation)),
        func.min(
            case((behind(Machine.inventory_generation), Machine.registered_at)),
            type_=Machine.registered_at.type,
        ),
        count(behind(Machine.restored_generation)),
        # A machine that finished training without an iteration after the restore (restored at the last one)
        # never says "resumed": it is done with the generation all the same.
        count(and_(behind(Machine.resumed_generation), behind(Machine.finished_generation))),
        count(Machine.state == MachineState.FAILED),
        count(Machine.embedded.is_(True)),
    ).where(Machine.job_id == job_id, Machine.state != MachineState.REPLACED)
    inventory, oldest, restored, resumed, failed, embedded = (await session.execute(query)).one()
    return RecoveryProgress(int(inventory), oldest, int(restored), int(resumed), failed > 0, embedded > 0)


class LiveRank(NamedTuple):
    rank: int
    state: str
    instance_id: str


async def live_ranks(session: AsyncSession, job_id: uuid.UUID) -> list[LiveRank]:
    """Each live machine's rank, state and instance id (not its row: no summary, no inventory)."""
    query = (
        select(Machine.rank, Machine.state, Machine.instance_id)
        .where(Machine.job_id == job_id, Machine.state != MachineState.REPLACED)
        .order_by(Machine.rank)
    )
    return [
        LiveRank(rank, state, instance_id)
        for rank, state, instance_id in (await session.execute(query)).all()
    ]


async def instance_held_elsewhere(
    session: AsyncSession, instance_id: str, job_id: uuid.UUID
) -> tuple[str, int] | None:
    """The job (its name) and rank for which `instance_id` is a live machine of another unfinished job."""
    query = (
        select(Job.name, Machine.rank)
        .join(Job, Job.id == Machine.job_id)
        .where(
            Machine.instance_id == instance_id,
            Machine.job_id != job_id,
            Machine.state != MachineState.REPLACED,
            Job.state.not_in((JobState.COMPLETED, JobState.STOPPED, JobState.FAILED)),
        )
        .limit(1)
    )
    row = (await session.execute(query)).first()
    return None if row is None else (row[0], row[1])


async def machine_by_instance(session: AsyncSession, job_id: uuid.UUID, instance_id: str) -> Machine | None:
    query = select(Machine).where(Machine.job_id == job_id, Machine.instance_id == instance_id)
    return (await session.execute(query)).scalar_one_or_none()


async def touch_machine(
    session: AsyncSession,
    job_id: uuid.UUID,
    rank: int,
    instance_id: str,
    *,
    at: datetime,
    summary: dict[str, Any],
) -> str | None:
    """A heartbeat in one statement: the live machine `instance_id` at `rank` gets its time and summary (a
    pending one becomes healthy); its state after, or None when no live machine matches. One indexed row
    (the job's unique instance id), nothing else locked."""
    query = (
        update(Machine)
        .where(*_live_machine(job_id, rank, instance_id))
        .values(
            last_heartbeat_at=at,
            summary=summary,
            state=case((Machine.state == MachineState.PENDING, MachineState.HEALTHY), else_=Machine.state),
        )
        .returning(Machine.state)
        .execution_options(synchronize_session=False)
    )
    return (await session.execute(query)).scalar_one_or_none()


async def touch_machines(
    session: AsyncSession,
    job_id: uuid.UUID,
    summaries: Mapping[str, dict[str, Any]],
    ranks: Mapping[str, int],
    *,
    at: datetime,
) -> None:
    """etcd mode: heartbeats of many machines of a job in one statement run once per machine (executemany):
    each live machine whose instance id is a key of `summaries`, at the rank `ranks` names for it, gets `at`
    and its summary (a replaced one, an instance the job does not know, or one at another rank (a key written
    under a rank it does not hold) is left alone). Indexed rows only (the job's unique instance id), nothing
    else locked."""
    if not summaries:
        return
    machines = Machine.__table__  # Core, not the ORM: its bulk UPDATE matches rows by primary key only
    assert isinstance(machines, Table)
    query = (
        update(machines)
        .where(
            machines.c.job_id == job_id,
            machines.c.instance_id == bindparam("b_instance_id"),
            machines.c.rank == bindparam("b_rank"),
            machines.c.state != MachineState.REPLACED,
        )
        .values(last_heartbeat_at=at, summary=bindparam("b_summary", type_=machines.c.summary.type))
    )
    rows = [
        {"b_instance_id": iid, "b_rank": ranks[iid], "b_summary": summary}
        for iid, summary in summaries.items()
    ]
    await session.execute(query, rows)


async def machines_at_ranks(
    session: AsyncSession, job_id: uuid.UUID, ranks: Sequence[int]
) -> Sequence[Machine]:
    """The live machines at `ranks` (a placement group's peers: the live-rank index, not the whole job)."""
    if not ranks:
        return []
    query = select(Machine).where(
        Machine.job_id == job_id, Machine.rank.in_(list(ranks)), Machine.state != MachineState.REPLACED
    )
    return (await session.execute(query)).scalars().all()


async def live_summaries(session: AsyncSession, job_id: uuid.UUID) -> Sequence[dict[str, Any]]:
    """The heartbeat summaries of the job's live machines, and nothing else of their rows."""
    query = select(Machine.summary).where(Machine.job_id == job_id, Machine.state != MachineState.REPLACED)
    return [summary or {} for summary in (await session.execute(query)).scalars().all()]


async def live_progress(session: AsyncSession, job_id: uuid.UUID) -> dict[int, Progress]:
    """Per live machine's rank, what its heartbeat summary says of its registered agent session
    (embedded.progress_of; nothing where the summary is another session's)."""
    query = select(Machine.rank, Machine.summary, Machine.agent_session).where(
        Machine.job_id == job_id, Machine.state != MachineState.REPLACED
    )
    return {
        rank: embedded.progress_of(summary, agent_session) or Progress(0)
        for rank, summary, agent_session in (await session.execute(query)).all()
    }


async def session_progress(session: AsyncSession, machine_id: int) -> Progress | None:
    """What the machine's heartbeat summary says of its registered agent session (embedded.progress_of)."""
    query = select(Machine.summary, Machine.agent_session).where(Machine.id == machine_id)
    row = (await session.execute(query)).first()
    return None if row is None else embedded.progress_of(row[0], row[1])


async def last_charged(session: AsyncSession, job_id: uuid.UUID) -> embedded.Charged:
    """What the job's most recently ended recovery charged it (embedded.charged_by): the failures that
    resumed training last, a few rows."""
    last = (
        select(func.max(FailureEvent.resumed_at))
        .where(FailureEvent.job_id == job_id, FailureEvent.state == FailureState.RECOVERED)
        .scalar_subquery()
    )
    query = select(FailureEvent).where(
        FailureEvent.job_id == job_id,
        FailureEvent.state == FailureState.RECOVERED,
        FailureEvent.resumed_at == last,
    )
    closed = (await session.execute(query)).scalars().all()
    return embedded.charged_by(closed, closed[0].resumed_at if closed else None)


async def latest_generation(session: AsyncSession, job_id: uuid.UUID) -> int | None:
    """The newest plan's generation, without loading its per-rank sources."""
    query = select(func.max(RecoveryPlan.generation)).where(RecoveryPlan.job_id == job_id)
    return (await session.execute(query)).scalar_one_or_none()


class NewestPlan(NamedTuple):
    generation: int
    released: bool  # every rank has its source (READY); not while a recovery collects inventories


async def newest_plan(session: AsyncSession, job_id: uuid.UUID) -> NewestPlan | None:
    """The newest plan's generation and whether it is released, without loading its per-rank sources."""
    query = (
        select(RecoveryPlan.generation, RecoveryPlan.status)
        .where(RecoveryPlan.job_id == job_id)
        .order_by(RecoveryPlan.generation.desc())
        .limit(1)
    )
    row = (await session.execute(query)).first()
    return None if row is None else NewestPlan(row.generation, row.status == PlanStatus.READY)


async def released_generation(session: AsyncSession, job_id: uuid.UUID) -> int | None:
    """The newest plan's generation once it is released; None before (the persist schedule's generation)."""
    newest = await newest_plan(session, job_id)
    return newest.generation if newest is not None and newest.released else None


async def placement_groups(session: AsyncSession, job_id: uuid.UUID) -> Sequence[PlacementGroupRow]:
    query = (
        select(PlacementGroupRow).where(PlacementGroupRow.job_id == job_id).order_by(PlacementGroupRow.index)
    )
    return (await session.execute(query)).scalars().all()


async def failure_counts(session: AsyncSession, job_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int]:
    if not job_ids:
        return {}
    query = (
        select(FailureEvent.job_id, func.count())
        .where(FailureEvent.job_id.in_(job_ids))
        .group_by(FailureEvent.job_id)
    )
    return {job_id: count for job_id, count in (await session.execute(query)).all()}


async def healthy_counts(session: AsyncSession, job_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int]:
    if not job_ids:
        return {}
    query = (
        select(Machine.job_id, func.count())
        .where(Machine.job_id.in_(job_ids), Machine.state == MachineState.HEALTHY)
        .group_by(Machine.job_id)
    )
    return {job_id: count for job_id, count in (await session.execute(query)).all()}


async def list_failures(session: AsyncSession, job_id: uuid.UUID) -> Sequence[FailureEvent]:
    query = (
        select(FailureEvent).where(FailureEvent.job_id == job_id).order_by(FailureEvent.detected_at.desc())
    )
    return (await session.execute(query)).scalars().all()


async def failure_numbers(session: AsyncSession, job_id: uuid.UUID) -> dict[int, int]:
    """Failure event id -> its number within the job (1, 2, 3, ... in the order recorded). Ids are global
    and skip numbers within a job: other jobs' failures, and process exits folded into a machine loss."""
    query = select(FailureEvent.id).where(FailureEvent.job_id == job_id).order_by(FailureEvent.id)
    ids = (await session.execute(query)).scalars().all()
    return {failure_id: number for number, failure_id in enumerate(ids, start=1)}


async def get_failure(session: AsyncSession, job_id: uuid.UUID, failure_id: int) -> FailureEvent | None:
    query = select(FailureEvent).where(FailureEvent.job_id == job_id, FailureEvent.id == failure_id)
    return (await session.execute(query)).scalar_one_or_none()


async def latest_plan(
    session: AsyncSession, job_id: uuid.UUID, *, sources: bool = True
) -> RecoveryPlan | None:
    """The job's newest plan; without `sources`, its per-rank sources are not loaded (an 8,000-rank plan's
    are a JSON document of about a megabyte) and reading them raises (writing them is allowed)."""
    query = (
        select(RecoveryPlan)
        .options(*([] if sources else [defer(RecoveryPlan.sources, raiseload=True)]))
        .where(RecoveryPlan.job_id == job_id)
        .order_by(RecoveryPlan.generation.desc())
        .limit(1)
    )
    return (await session.execute(query)).scalar_one_or_none()


async def list_plans(session: AsyncSession, job_id: uuid.UUID) -> Sequence[RecoveryPlan]:
    query = select(RecoveryPlan).where(RecoveryPlan.job_id == job_id).order_by(RecoveryPlan.generation.desc())
    return (await session.execute(query)).scalars().all()


async def resumed_from(session: AsyncSession, job_id: uuid.UUID) -> dict[int, int | None]:
    """Each released plan's generation and the iteration it resumed from (None: from scratch): the
    job's timeline, for `domain.recovery.on_timeline`."""
    query = select(RecoveryPlan.generation, RecoveryPlan.iteration).where(
        RecoveryPlan.job_id == job_id, RecoveryPlan.status == PlanStatus.READY
    )
    return {generation: iteration for generation, iteration in (await session.execute(query)).all()}


async def resumed_since(session: AsyncSession, job_id: uuid.UUID, generation: int) -> dict[int, int | None]:
    """`resumed_from` for the released plans newer than `generation` only, without their per-rank sources
    (the persist schedule's check after a recovery, on heartbeat paths)."""
    query = select(RecoveryPlan.generation, RecoveryPlan.iteration).where(
        RecoveryPlan.job_id == job_id,
        RecoveryPlan.generation > generation,
        RecoveryPlan.status == PlanStatus.READY,
    )
    return {g: i for g, i in (await session.execute(query)).all()}


async def persisted_shard_count(
    session: AsyncSession, job_id: uuid.UUID, iteration: int, generation: int
) -> int:
    """How many ranks' shards of `iteration` written in `generation` the root recorded."""
    query = (
        select(func.count())
        .select_from(PersistedShard)
        .join(PersistedCheckpoint, PersistedShard.checkpoint_id == PersistedCheckpoint.id)
        .where(
            PersistedCheckpoint.job_id == job_id,
            PersistedCheckpoint.iteration == iteration,
            PersistedShard.generation == generation,
        )
    )
    return int((await session.execute(query)).scalar_one())


async def list_persisted(session: AsyncSession, job_id: uuid.UUID) -> Sequence[PersistedCheckpoint]:
    query = (
        select(PersistedCheckpoint)
        .options(selectinload(PersistedCheckpoint.shards))
        .where(PersistedCheckpoint.job_id == job_id)
        .order_by(PersistedCheckpoint.iteration.desc())
    )
    return (await session.execute(query)).scalars().all()


async def open_failures(session: AsyncSession, job_id: uuid.UUID) -> Sequence[FailureEvent]:
    """Failure events not yet recovered, oldest first."""
    query = (
        select(FailureEvent)
        .where(FailureEvent.job_id == job_id, FailureEvent.state.in_(("detected", "recovering")))
        .order_by(FailureEvent.detected_at, FailureEvent.id)
    )
    return (await session.execute(query)).scalars().all()


async def has_fresh_failures(session: AsyncSession, job_id: uuid.UUID) -> bool:
    """Whether the job has a failure event that no recovery generation took up yet (state `detected`)."""
    query = select(FailureEvent.id).where(FailureEvent.job_id == job_id, FailureEvent.state == "detected")
    return (await session.execute(query.limit(1))).first() is not None


async def failures_of_plan(session: AsyncSession, plan_id: int) -> Sequence[FailureEvent]:
    query = select(FailureEvent).where(FailureEvent.plan_id == plan_id).order_by(FailureEvent.detected_at)
    return (await session.execute(query)).scalars().all()


async def active_job_ids(session: AsyncSession) -> Sequence[uuid.UUID]:
    query = select(Job.id).where(Job.state.in_(("running", "recovering")))
    return (await session.execute(query)).scalars().all()


async def persisted_shards(
    session: AsyncSession, job_id: uuid.UUID
) -> Sequence[tuple[PersistedCheckpoint, PersistedShard]]:
    query = (
        select(PersistedCheckpoint, PersistedShard)
        .join(PersistedShard, PersistedShard.checkpoint_id == PersistedCheckpoint.id)
        .where(PersistedCheckpoint.job_id == job_id)
    )
    return [(c, s) for c, s in (await session.execute(query)).all()]


async def persisted_shard_keys(
    session: AsyncSession, job_id: uuid.UUID, keys: Collection[tuple[int, int, int]]
) -> set[tuple[int, int, int]]:
    """Which of `keys`, (iteration, rank, generation), the job has persisted: their rows only, where
    `persisted_shards` reads them all."""
    query = (
        select(PersistedCheckpoint.iteration, PersistedShard.rank, PersistedShard.generation)
        .join(PersistedShard, PersistedShard.checkpoint_id == PersistedCheckpoint.id)
        .where(
            PersistedCheckpoint.job_id == job_id,
            PersistedCheckpoint.iteration.in_({iteration for iteration, _, _ in keys}),
            PersistedShard.rank.in_({rank for _, rank, _ in keys}),
        )
    )
    return {(int(i), int(r), int(g)) for i, r, g in (await session.execute(query)).all()}


async def persisted_checkpoint(
    session: AsyncSession, job_id: uuid.UUID, iteration: int
) -> PersistedCheckpoint | None:
    query = (
        select(PersistedCheckpoint)
        .options(selectinload(PersistedCheckpoint.shards))
        .where(PersistedCheckpoint.job_id == job_id, PersistedCheckpoint.iteration == iteration)
    )
    return (await session.execute(query)).scalar_one_or_none()


# -- what agents report during a recovery: each report writes its own machine's row and its own progress
# row, and locks nothing shared (not the job row: a thousand machines report at once after a recovery) ---


def _live_machine(
    job_id: uuid.UUID | BindParameter[Any],
    rank: int | BindParameter[Any],
    instance_id: str | BindParameter[Any],
) -> tuple[Any, ...]:
    """The live machine `instance_id` at `rank`: one indexed row (the job's unique instance id). Values, or
    bound parameters for a statement built once (see _live_machine_bound)."""
    return (
        Machine.job_id == job_id,
        Machine.instance_id == instance_id,
        Machine.rank == rank,
        Machine.state != MachineState.REPLACED,
    )


async def mark_machine(
    session: AsyncSession | AsyncConnection, job_id: uuid.UUID, rank: int, instance_id: str, **values: Any
) -> int | None:
    """Set `values` on the live machine `instance_id` at `rank` in one statement (its row only); its id,
    or None when no live machine matches."""
    query = (
        update(Machine)
        .where(*_live_machine(job_id, rank, instance_id))
        .values(**values)
        .returning(Machine.id)
        .execution_options(synchronize_session=False)
    )
    return (await session.execute(query)).scalar_one_or_none()


# The reports of a recovery's burst (a thousand at once) run prebuilt statements with bound parameters:
# building one per request (coercions, cache key) took about as much of the root's CPU as executing it
# (measured in process: 0.88 ms per inventory report prebuilt, 1.7 ms built per call).
_COLUMNS = Machine.__table__.c


def _live_machine_bound() -> tuple[Any, ...]:
    """_live_machine's conditions on bound parameters (`b_job_id`, `b_instance_id`, `b_rank`: a column's
    own name is reserved for its value in an UPDATE)."""
    return _live_machine(bindparam("b_job_id"), bindparam("b_rank"), bindparam("b_instance_id"))


@functools.cache
def _inventory_update(columns: tuple[str, ...]) -> Any:
    """UPDATE of a live machine's `columns` (bound as `set_<column>`) if the job's newest plan is the
    bound `generation` and still collecting."""
    newest = (
        select(func.max(RecoveryPlan.generation))
        .where(RecoveryPlan.job_id == bindparam("b_job_id"))
        .scalar_subquery()
    )
    collecting = exists().where(
        RecoveryPlan.job_id == bindparam("b_job_id"),
        RecoveryPlan.generation == bindparam("b_generation"),
        RecoveryPlan.status == PlanStatus.COLLECTING,
        RecoveryPlan.generation == newest,
    )
    assignments = {name: bindparam(f"set_{name}", type_=_COLUMNS[name].type) for name in columns}
    return update(Machine).where(*_live_machine_bound(), collecting).values(assignments).returning(Machine.id)


async def mark_machine_if_collecting(
    connection: AsyncConnection,
    job_id: uuid.UUID,
    rank: int,
    instance_id: str,
    generation: int,
    **values: Any,
) -> int | None:
    """An inventory report's write: set `values` on the live machine `instance_id` at `rank` if the job's
    newest plan is `generation` and still collecting, in one statement (the plan's head checked in its
    WHERE clause, not read first). The machine's id, or None when nothing matched (see the caller for why)."""
    statement = _inventory_update(tuple(sorted(values)))
    parameters = {
        "b_job_id": job_id,
        "b_rank": rank,
        "b_instance_id": instance_id,
        "b_generation": generation,
    }
    parameters |= {f"set_{name}": value for name, value in values.items()}
    found: int | None = (await connection.execute(statement, parameters)).scalar_one_or_none()
    return found


# A progress report's machine column (the generation it reached) and the times its progress row keeps.
# "finished" counts as "resumed" (a machine restored at the last iteration has none left to run and says
# only "finished"), so its time is the row's resumed time unless a "resumed" came first.
_PROGRESS_COLUMNS = {
    "restored": ("restored_generation", ("restored_at", "restore")),
    "resumed": ("resumed_generation", ("resumed_at",)),
    "finished": ("finished_generation", ("resumed_at",)),
}


@functools.cache
def _progress_statements(dialect: str, report: str) -> tuple[Any, Any]:
    """A `report`'s ("restored", "resumed", "finished") statements on bound parameters: the live machine's
    UPDATE, and the progress row's upsert (on Postgres fed by that UPDATE as a CTE, so one statement does
    both)."""
    column, reported = _PROGRESS_COLUMNS[report]
    marked = (
        update(Machine)
        .where(*_live_machine_bound())
        .values({column: bindparam("b_generation")})
        .returning(Machine.id)
    )
    names = ("job_id", "generation", "rank", *reported)
    progress = RankProgress.__table__.c
    bound = {name: bindparam(f"p_{name}", type_=progress[name].type) for name in names}
    if dialect == "postgresql":
        machine = marked.cte("marked")
        chosen = select(*bound.values()).select_from(machine)
        statement = postgresql.insert(RankProgress).from_select(list(names), chosen)
        upsert = _on_progress_conflict(statement, reported).returning(RankProgress.id)
        return marked, upsert
    return marked, _on_progress_conflict(sqlite.insert(RankProgress).values(bound), reported)


async def mark_progress(
    connection: AsyncConnection,
    job_id: uuid.UUID,
    rank: int,
    instance_id: str,
    generation: int,
    report: Literal["restored", "resumed", "finished"],
    at: datetime,
    restore: dict[str, Any] | None = None,
) -> int | None:
    """A "restored" (with its `restore` details), "resumed" or "finished" report that arrived `at`: the live
    machine's `*_generation` column and its progress row for `generation` (the rank's report times and
    restore details, one row per job, generation and rank: see _on_progress_conflict). On Postgres one
    statement (the machine's UPDATE as a CTE feeding the progress upsert, so the row is written only for a
    live machine); on SQLite, which has no data-modifying CTE, the two statements of one transaction. The
    machine's id (its progress row's, on Postgres), or None when no live machine matched."""
    marked, upsert = _progress_statements(connection.dialect.name, report)
    parameters: dict[str, Any] = {"b_job_id": job_id, "b_rank": rank, "b_instance_id": instance_id}
    parameters |= {"b_generation": generation, "p_job_id": job_id, "p_generation": generation, "p_rank": rank}
    if report == "restored":
        parameters |= {"p_restored_at": at, "p_restore": restore if restore is not None else {}}
    else:
        parameters["p_resumed_at"] = at
    if connection.dialect.name == "postgresql":
        landed: int | None = (await connection.execute(upsert, parameters)).scalar_one_or_none()
        return landed
    found: int | None = (await connection.execute(marked, parameters)).scalar_one_or_none()
    if found is not None:
        await connection.execute(upsert, parameters)
    return found


def _on_progress_conflict(statement: Any, reported: Sequence[str]) -> Any:
    """The first "restored" and "resumed" report times stay (a retry does not move them); the newest
    restore details replace the previous."""
    new = statement.excluded
    changes: dict[str, Any] = {
        "restored_at": func.coalesce(RankProgress.restored_at, new.restored_at),
        "resumed_at": func.coalesce(RankProgress.resumed_at, new.resumed_at),
        "restore": new.restore,
    }
    return statement.on_conflict_do_update(
        index_elements=[RankProgress.job_id, RankProgress.generation, RankProgress.rank],
        set_={key: changes[key] for key in reported},
    )


async def last_progress(
    session: AsyncSession, job_id: uuid.UUID, generation: int, *, resumed: bool
) -> datetime | None:
    """When the last machine's first "restored" (or `resumed`: "resumed" or "finished") report for
    `generation` arrived."""
    column = RankProgress.resumed_at if resumed else RankProgress.restored_at
    query = select(func.max(column)).where(
        RankProgress.job_id == job_id, RankProgress.generation == generation
    )
    found: datetime | None = (await session.execute(query)).scalar_one_or_none()
    return found


async def plan_progress(
    session: AsyncSession, job_id: uuid.UUID, plan_ids: Sequence[int]
) -> list[tuple[int, RankProgress]]:
    """The progress rows of the plans `plan_ids` (by plan id), for the failure events recovered by them."""
    if not plan_ids:
        return []
    query = (
        select(RecoveryPlan.id, RankProgress)
        .join(
            RecoveryPlan,
            (RecoveryPlan.job_id == RankProgress.job_id)
            & (RecoveryPlan.generation == RankProgress.generation),
        )
        .where(RankProgress.job_id == job_id, RecoveryPlan.id.in_(list(plan_ids)))
        .order_by(RankProgress.rank)
    )
    return [(plan_id, row) for plan_id, row in (await session.execute(query)).all()]


async def unfinished_machines(session: AsyncSession, job_id: uuid.UUID, generation: int) -> int:
    """How many live machines have not reported "finished" for `generation`."""
    query = (
        select(func.count())
        .select_from(Machine)
        .where(
            Machine.job_id == job_id,
            Machine.state != MachineState.REPLACED,
            (Machine.finished_generation.is_(None)) | (Machine.finished_generation != generation),
        )
    )
    return int((await session.execute(query)).scalar_one())


async def complete_job(session: AsyncSession, job_id: uuid.UUID, at: datetime) -> str | None:
    """Mark a running job completed, its directive's revision moved, in one conditional statement: of
    several callers at once exactly one gets the job's name, the others None (the row's lock orders them;
    the later ones find the job no longer running)."""
    query = (
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.RUNNING)
        .values(state=JobState.COMPLETED, finished_at=at, directive_revision=Job.directive_revision + 1)
        .returning(Job.name)
        .execution_options(synchronize_session=False)
    )
    name: str | None = (await session.execute(query)).scalar_one_or_none()
    return name


class PlanHead(NamedTuple):
    """A plan's identity and status, without its per-rank sources."""

    id: int
    generation: int
    status: str


async def latest_plan_head(session: AsyncSession, job_id: uuid.UUID) -> PlanHead | None:
    """The newest plan's id, generation and status, without its per-rank sources."""
    query = (
        select(RecoveryPlan.id, RecoveryPlan.generation, RecoveryPlan.status)
        .where(RecoveryPlan.job_id == job_id)
        .order_by(RecoveryPlan.generation.desc())
        .limit(1)
    )
    found = (await session.execute(query)).first()
    return PlanHead(*found) if found is not None else None


# -- registrations off the job row: a rank is claimed by the live-rank unique index, the job started by a
# conditional UPDATE (flows.machines.register) ------------------------------------------------------------


async def claim_rank(session: AsyncSession, job_id: uuid.UUID, rank: int, **values: Any) -> int | None:
    """Insert a live machine at `rank` unless the rank (the live-rank unique index) or its instance id is
    taken: one statement, nothing else locked. Its id, or None when another machine holds either (a
    concurrent claim waits for the other transaction to end first, then finds it)."""
    dialect = session.bind.dialect.name if session.bind is not None else "postgresql"
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = (
        insert(Machine)
        .values(job_id=job_id, rank=rank, **values)
        .on_conflict_do_nothing()
        .returning(Machine.id)
    )
    return (await session.execute(statement)).scalar_one_or_none()


async def live_machine_count(session: AsyncSession, job_id: uuid.UUID) -> int:
    """How many ranks have a live machine (the live-rank index, no row read)."""
    query = (
        select(func.count())
        .select_from(Machine)
        .where(Machine.job_id == job_id, Machine.state != MachineState.REPLACED)
    )
    return int((await session.execute(query)).scalar_one())


async def start_job(session: AsyncSession, job_id: uuid.UUID, at: datetime) -> bool:
    """Move a pending job to running in one conditional statement: of several callers at once exactly one
    gets True (and holds the job row's lock until it commits); the later ones find it running."""
    query = (
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.PENDING)
        .values(state=JobState.RUNNING, started_at=at)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    return (await session.execute(query)).scalar_one_or_none() is not None


# -- pages of the list endpoints and the status pages: bounded reads (LIMIT in SQL, totals by count()) -----


async def _count(session: AsyncSession, query: Any) -> int:
    """How many rows `query` (a select) matches, counted by the database."""
    return int((await session.execute(select(func.count()).select_from(query.subquery()))).scalar_one())


async def machines_page(
    session: AsyncSession, job_id: uuid.UUID, *, history: bool, limit: int, offset: int
) -> tuple[Sequence[Machine], int]:
    """One page of the job's machines by rank (`history`: replaced ones too, each rank's in the order they
    registered) and how many there are; without their inventories (no page shows them)."""
    query = select(Machine).where(Machine.job_id == job_id)
    if not history:
        query = query.where(Machine.state != MachineState.REPLACED)
    total = await _count(session, query.with_only_columns(Machine.id))
    page = (
        query.options(defer(Machine.inventory))
        .order_by(Machine.rank, Machine.registered_at, Machine.id)
        .limit(limit)
        .offset(offset)
    )
    return (await session.execute(page)).scalars().all(), total


async def failure_count(session: AsyncSession, job_id: uuid.UUID) -> int:
    query = select(func.count()).select_from(FailureEvent).where(FailureEvent.job_id == job_id)
    return int((await session.execute(query)).scalar_one())


async def failures_page(
    session: AsyncSession, job_id: uuid.UUID, *, limit: int, before_id: int | None = None
) -> tuple[Sequence[FailureEvent], int] | None:
    """The job's newest `limit` failures (newest first: detection time, then id), those older than failure
    `before_id` when given (a keyset cursor: new failures arriving meanwhile do not shift the pages), and
    how many the job has. None when `before_id` is no failure of the job."""
    query = select(FailureEvent).where(FailureEvent.job_id == job_id)
    if before_id is not None:
        cursor = await session.execute(
            select(FailureEvent.detected_at).where(
                FailureEvent.job_id == job_id, FailureEvent.id == before_id
            )
        )
        detected_at = cursor.scalar_one_or_none()
        if detected_at is None:
            return None
        query = query.where(
            (FailureEvent.detected_at < detected_at)
            | ((FailureEvent.detected_at == detected_at) & (FailureEvent.id < before_id))
        )
    query = query.order_by(FailureEvent.detected_at.desc(), FailureEvent.id.desc()).limit(limit)
    return (await session.execute(query)).scalars().all(), await failure_count(session, job_id)


async def failure_numbers_of(
    session: AsyncSession, job_id: uuid.UUID, failure_ids: Sequence[int]
) -> dict[int, int]:
    """`failure_numbers` for `failure_ids` only: the numbering is done by the database (a window over the
    job's failure ids), and only the wanted rows come back."""
    if not failure_ids:
        return {}
    numbered = (
        select(FailureEvent.id, func.row_number().over(order_by=FailureEvent.id).label("number"))
        .where(FailureEvent.job_id == job_id)
        .subquery()
    )
    query = select(numbered.c.id, numbered.c.number).where(numbered.c.id.in_(list(failure_ids)))
    return {int(failure_id): int(number) for failure_id, number in (await session.execute(query)).all()}


async def plans_page(
    session: AsyncSession, job_id: uuid.UUID, *, limit: int, before_generation: int | None = None
) -> tuple[Sequence[RecoveryPlan], int]:
    """The job's newest `limit` recovery plans (newest generation first), those before `before_generation`
    when given (a keyset cursor), and how many the job has."""
    query = select(RecoveryPlan).where(RecoveryPlan.job_id == job_id)
    total = await _count(session, query.with_only_columns(RecoveryPlan.id))
    if before_generation is not None:
        query = query.where(RecoveryPlan.generation < before_generation)
    page = query.order_by(RecoveryPlan.generation.desc()).limit(limit)
    return (await session.execute(page)).scalars().all(), total


class PlanLine(NamedTuple):
    """A recovery plan without its per-rank sources and rendezvous (the job page's table and chart)."""

    id: int
    generation: int
    status: str
    iteration: int | None
    reason: str
    created_at: datetime
    ready_at: datetime | None


async def plan_lines(session: AsyncSession, job_id: uuid.UUID, *, limit: int) -> tuple[list[PlanLine], int]:
    """The job's newest `limit` plans as PlanLines, and how many plans it has."""
    query = (
        select(
            RecoveryPlan.id,
            RecoveryPlan.generation,
            RecoveryPlan.status,
            RecoveryPlan.iteration,
            RecoveryPlan.reason,
            RecoveryPlan.created_at,
            RecoveryPlan.ready_at,
        )
        .where(RecoveryPlan.job_id == job_id)
        .order_by(RecoveryPlan.generation.desc())
        .limit(limit)
    )
    count = select(func.count()).select_from(RecoveryPlan).where(RecoveryPlan.job_id == job_id)
    total = int((await session.execute(count)).scalar_one())
    return [PlanLine(*row) for row in (await session.execute(query)).all()], total


async def plan_tier_counts(session: AsyncSession, plan_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    """Per plan id, how many of its per-rank sources come from each tier, counted by the database (the
    sources JSON of a 1,000-machine plan holds 8,000 entries; it never reaches Python)."""
    if not plan_ids:
        return {}
    dialect = session.bind.dialect.name if session.bind is not None else "postgresql"
    ids = ", ".join(str(int(plan_id)) for plan_id in plan_ids)  # integers only: safe to inline
    if dialect == "postgresql":
        sql = (
            "SELECT p.id, s.value ->> 'tier', count(*) FROM recovery_plans AS p "
            "CROSS JOIN LATERAL json_array_elements(p.sources::json) AS s(value) "
            f"WHERE p.id IN ({ids}) AND json_typeof(p.sources::json) = 'array' GROUP BY 1, 2"
        )
    else:
        sql = (
            "SELECT p.id, json_extract(s.value, '$.tier'), count(*) FROM recovery_plans AS p, "
            f"json_each(p.sources) AS s WHERE p.id IN ({ids}) AND json_type(p.sources) = 'array' "
            "GROUP BY 1, 2"
        )
    counts: dict[int, dict[str, int]] = {}
    for plan_id, tier, count in (await session.execute(text(sql))).all():
        counts.setdefault(int(plan_id), {})[str(tier)] = int(count)
    return counts


async def persisted_page(
    session: AsyncSession, job_id: uuid.UUID, *, limit: int, before_iteration: int | None = None
) -> tuple[Sequence[PersistedCheckpoint], int]:
    """The job's newest `limit` persisted checkpoints with their shards (newest iteration first), those
    before `before_iteration` when given (a keyset cursor), and how many the job has."""
    query = select(PersistedCheckpoint).where(PersistedCheckpoint.job_id == job_id)
    total = await _count(session, query.with_only_columns(PersistedCheckpoint.id))
    if before_iteration is not None:
        query = query.where(PersistedCheckpoint.iteration < before_iteration)
    page = (
        query.options(selectinload(PersistedCheckpoint.shards))
        .order_by(PersistedCheckpoint.iteration.desc())
        .limit(limit)
    )
    return (await session.execute(page)).scalars().all(), total


class CheckpointLine(NamedTuple):
    """A persisted checkpoint with its shards counted and summed by the database."""

    iteration: int
    location: str
    created_at: datetime
    shards: int
    nbytes: int
    generations: frozenset[int]  # of the training that wrote its shards


async def checkpoint_lines(
    session: AsyncSession, job_id: uuid.UUID, *, limit: int
) -> tuple[list[CheckpointLine], int]:
    """The job's newest `limit` persisted checkpoints as CheckpointLines, and how many it has."""
    newest = (
        select(PersistedCheckpoint.id)
        .where(PersistedCheckpoint.job_id == job_id)
        .order_by(PersistedCheckpoint.iteration.desc())
        .limit(limit)
        .subquery()
    )
    # Counted per generation of the shards (one row per checkpoint and generation, few of them): whether a
    # checkpoint is complete depends on which of them are on the current timeline.
    query = (
        select(
            PersistedCheckpoint.iteration,
            PersistedCheckpoint.location,
            PersistedCheckpoint.created_at,
            PersistedShard.generation,
            func.count(PersistedShard.id),
            # As a float: SQLite's integer sum raises on overflow (shard sizes are reports, up to 2**63 each).
            func.coalesce(func.sum(cast(PersistedShard.nbytes, Float)), 0),
        )
        .join(newest, newest.c.id == PersistedCheckpoint.id)
        # A condemned shard (a restore found it corrupt) does not count: its checkpoint is not
        # complete, as retention and the API count it.
        .outerjoin(
            PersistedShard,
            and_(PersistedShard.checkpoint_id == PersistedCheckpoint.id, PersistedShard.condemned.is_(None)),
        )
        .group_by(PersistedCheckpoint.id, PersistedCheckpoint.iteration, PersistedCheckpoint.location)
        .group_by(PersistedCheckpoint.created_at, PersistedShard.generation)
        .order_by(PersistedCheckpoint.iteration.desc())
    )
    count = select(func.count()).select_from(PersistedCheckpoint).where(PersistedCheckpoint.job_id == job_id)
    total = int((await session.execute(count)).scalar_one())
    lines: dict[int, CheckpointLine] = {}
    for iteration, location, created_at, generation, shards, nbytes in (await session.execute(query)).all():
        line = lines.get(iteration) or CheckpointLine(iteration, location, created_at, 0, 0, frozenset())
        lines[iteration] = line._replace(
            shards=line.shards + int(shards),
            nbytes=line.nbytes + int(nbytes),
            generations=line.generations | ({int(generation)} if generation is not None else set()),
        )
    return list(lines.values()), total


def needs_judging(lapsed_before: datetime | None) -> ColumnElement[bool]:
    """The machines the leader's suspicion pass has something to decide about: suspect or failed ones
    (declared lost, or reinstated when they heartbeat again) and, given `lapsed_before` (REST heartbeats),
    healthy or pending ones last heard from before it. Every other machine it would skip."""
    attention: ColumnElement[bool] = Machine.state.in_((MachineState.SUSPECT, MachineState.FAILED))
    if lapsed_before is not None:
        last_heard = func.coalesce(Machine.last_heartbeat_at, Machine.registered_at)
        unsuspected = Machine.state.in_((MachineState.HEALTHY, MachineState.PENDING))
        attention = or_(attention, and_(unsuspected, last_heard < lapsed_before))
    return attention


async def machines_to_judge(
    session: AsyncSession, job_id: uuid.UUID, lapsed_before: datetime | None
) -> Sequence[Machine]:
    """The job's machines that `needs_judging` selects, without their summaries and inventories (JSON
    documents the suspicion pass never reads): a pass over a 1,000-machine job with one suspect loads that
    machine, not the job's every row, at every tick."""
    query = (
        select(Machine)
        .options(defer(Machine.summary, raiseload=True), defer(Machine.inventory, raiseload=True))
        .where(Machine.job_id == job_id, needs_judging(lapsed_before))
        .order_by(Machine.rank)
    )
    return (await session.execute(query)).scalars().all()


async def replaced_machines(
    session: AsyncSession, job_id: uuid.UUID, *, limit: int
) -> tuple[Sequence[Machine], int]:
    """The job's `limit` most recently registered replaced machines (by rank), without their inventories,
    and how many it has."""
    where = (Machine.job_id == job_id, Machine.state == MachineState.REPLACED)
    newest = (
        select(Machine.id)
        .where(*where)
        .order_by(Machine.registered_at.desc(), Machine.id.desc())
        .limit(limit)
    )
    query = (
        select(Machine)
        .options(defer(Machine.inventory))
        .where(Machine.id.in_(newest.scalar_subquery()))
        .order_by(Machine.rank, Machine.registered_at)
    )
    total = int((await session.execute(select(func.count()).select_from(Machine).where(*where))).scalar_one())
    return (await session.execute(query)).scalars().all(), total


async def machines_by_ids(
    session: AsyncSession, job_id: uuid.UUID, *, ids: Sequence[int] = (), instance_ids: Sequence[str] = ()
) -> Sequence[Machine]:
    """The job's machines with these row ids or instance ids (a failure's page: the machines it names)."""
    if not ids and not instance_ids:
        return []
    query = (
        select(Machine)
        .options(defer(Machine.inventory))
        .where(
            Machine.job_id == job_id, Machine.id.in_(list(ids)) | Machine.instance_id.in_(list(instance_ids))
        )
    )
    return (await session.execute(query)).scalars().all()


async def get_plan(session: AsyncSession, job_id: uuid.UUID, plan_id: int) -> RecoveryPlan | None:
    query = select(RecoveryPlan).where(RecoveryPlan.job_id == job_id, RecoveryPlan.id == plan_id)
    return (await session.execute(query)).scalar_one_or_none()


# -- process-exit reports: a clean exit locks nothing; a crash locks the job row and reads what it needs only


async def lock_job(session: AsyncSession, job_id: uuid.UUID) -> Job | None:
    """The job row locked (see get_job), its attributes read afresh: a row the session read before the lock
    may have changed since."""
    query = (
        select(Job)
        .where(Job.id == job_id)
        .with_for_update(key_share=True)
        .execution_options(populate_existing=True)
    )
    return (await session.execute(query)).scalar_one_or_none()


async def suspect_machines(session: AsyncSession, job_id: uuid.UUID) -> Sequence[Machine]:
    """The job's suspect machines (not every machine's row with its summary and inventory)."""
    query = select(Machine).where(Machine.job_id == job_id, Machine.state == MachineState.SUSPECT)
    return (await session.execute(query)).scalars().all()


# -- persisted-shard reports: each writes its own shard's row; only a report that may complete its checkpoint
# locks the job row (flows.persistence.record_persisted) -----------------------------------------------------


def _insert_for(session: AsyncSession) -> Any:
    dialect = session.bind.dialect.name if session.bind is not None else "postgresql"
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


async def persisted_checkpoint_id(
    session: AsyncSession, job_id: uuid.UUID, iteration: int, location: str
) -> int:
    """The id of the job's persisted checkpoint of `iteration`, created if missing (its unique key: of
    several first reports at once one inserts it), its location set if it differs. Locks no row but a new
    one's, and the existing one's only when its location changes. An existing one that another report's
    expiry deletes between the two statements is inserted anew (each statement reads what has committed)."""
    insert = (
        _insert_for(session)(PersistedCheckpoint)
        .values(job_id=job_id, iteration=iteration, location=location)
        .on_conflict_do_nothing()
        .returning(PersistedCheckpoint.id)
    )
    query = select(PersistedCheckpoint.id).where(
        PersistedCheckpoint.job_id == job_id, PersistedCheckpoint.iteration == iteration
    )
    for _ in range(3):  # a deletion between the two statements each time: never twice in practice
        inserted: int | None = (await session.execute(insert)).scalar_one_or_none()
        if inserted is not None:
            return inserted
        checkpoint_id: int | None = (await session.execute(query)).scalar_one_or_none()
        if checkpoint_id is not None:
            break
    else:
        raise RuntimeError(f"persisted checkpoint {iteration} of job {job_id} kept vanishing while recorded")
    await session.execute(
        update(PersistedCheckpoint)
        .where(PersistedCheckpoint.id == checkpoint_id, PersistedCheckpoint.location != location)
        .values(location=location)
        .execution_options(synchronize_session=False)
    )
    return checkpoint_id


async def record_shard(
    session: AsyncSession,
    checkpoint_id: int,
    rank: int,
    *,
    key: str,
    digest: str,
    nbytes: int,
    generation: int,
) -> bool:
    """Rank `rank`'s shard of the checkpoint, in one upsert of its own row: a shard of an older generation
    than the one recorded (a late upload from before a rollback) changes nothing (False)."""
    statement = _insert_for(session)(PersistedShard).values(
        checkpoint_id=checkpoint_id, rank=rank, key=key, digest=digest, nbytes=nbytes, generation=generation
    )
    new = statement.excluded
    upsert = statement.on_conflict_do_update(
        index_elements=[PersistedShard.checkpoint_id, PersistedShard.rank],
        set_={
            "key": new.key,
            "digest": new.digest,
            "nbytes": new.nbytes,
            "generation": new.generation,
            "condemned": None,  # uploaded again: a restore may use it
        },
        where=PersistedShard.generation <= new.generation,
    ).returning(PersistedShard.id)
    return (await session.execute(upsert)).scalar_one_or_none() is not None


async def condemn_shard(
    session: AsyncSession, job_id: uuid.UUID, iteration: int, rank: int, digest: str, why: str
) -> bool:
    """Record that a restore could not use rank `rank`'s persisted shard of `iteration` with this digest
    (it failed its checksums); False when no such shard is recorded (expired, uploaded again)."""
    checkpoints = select(PersistedCheckpoint.id).where(
        PersistedCheckpoint.job_id == job_id, PersistedCheckpoint.iteration == iteration
    )
    statement = (
        update(PersistedShard)
        .where(
            PersistedShard.checkpoint_id.in_(checkpoints),
            PersistedShard.rank == rank,
            PersistedShard.digest == digest,
        )
        .values(condemned=why[:500])
        .returning(PersistedShard.id)
    )
    return (await session.execute(statement)).first() is not None


async def shard_count(session: AsyncSession, checkpoint_id: int) -> int:
    query = (
        select(func.count()).select_from(PersistedShard).where(PersistedShard.checkpoint_id == checkpoint_id)
    )
    return int((await session.execute(query)).scalar_one())


# -- retired metric totals: what deleted or folded failure events had added to the /metrics counters --------


async def retire_failures(session: AsyncSession, events: Sequence[FailureEvent]) -> None:
    """Add what `events`, about to be deleted, add to the /metrics counters to the retired totals, in the
    caller's transaction: a whole job's events, or events deleted apart from the rest of their job (folded
    into another), of which none is recovered, so none shares a recovery's iterations lost with one that
    stays."""
    recovered = [e for e in events if e.state == FailureState.RECOVERED]
    kinds = Counter(str(e.kind) for e in events)
    tiers = Counter(str(e.tier or "none") for e in recovered)
    await add_metric_totals(session, failure_counters(kinds, tiers, recovered))


async def retire_job_failures(session: AsyncSession, job_id: uuid.UUID) -> None:
    """Add what the job's failure events add to the /metrics counters to the retired totals, before the job
    is deleted (in the same transaction). A deletion is rare: the events are read whole."""
    events = (await session.execute(select(FailureEvent).where(FailureEvent.job_id == job_id))).scalars()
    await retire_failures(session, list(events))


async def add_metric_totals(session: AsyncSession, totals: Mapping[MetricKey, int]) -> None:
    """Add `totals` to the retired totals (metric_totals), in one upsert. Its rows are locked in one order
    (sorted), so that two transactions adding to the same rows wait for each other, never deadlock."""
    rows = [
        {"metric": metric, "label": label, "le": le, "value": int(value)}
        for (metric, label, le), value in sorted(totals.items())
        if value
    ]
    if not rows:
        return
    statement = _insert_for(session)(MetricTotal).values(rows)
    await session.execute(
        statement.on_conflict_do_update(
            index_elements=[MetricTotal.metric, MetricTotal.label, MetricTotal.le],
            set_={"value": MetricTotal.value + statement.excluded.value},
        )
    )


async def metric_totals(session: AsyncSession) -> Counter[MetricKey]:
    """The retired totals: what rows no longer in the database added to the /metrics counters."""
    query = select(MetricTotal.metric, MetricTotal.label, MetricTotal.le, MetricTotal.value)
    return Counter(
        {(metric, label, le): int(value) for metric, label, le, value in await session.execute(query)}
    )
