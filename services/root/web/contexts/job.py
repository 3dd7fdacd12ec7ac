"""One job's page (/jobs/{id}): its machines and replication groups, checkpoints, recovery plans and
the timeline of its failures."""

from __future__ import annotations

import math
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.models import Job, Machine, MachineState, PlanStatus
from services.root.domain.retention import is_complete_counted
from services.root.flows import jobs as job_flows
from services.root.web import charts, queries
from services.root.web.contexts.common import (
    LIVE_JOB_STATES,
    TIMELINE_LIMIT,
    FailureRow,
    as_number,
    failure_row,
    job_href,
)
from services.root.web.sampler import IterationHistory

# What the page lists of a job's history, newest first; it says how many more there are (the API pages
# through them all).
REPLACED_LIMIT = 100
PLAN_LIMIT = TIMELINE_LIMIT
CHECKPOINT_LIMIT = 20
# The machines' boxes: a job of up to MACHINES_PER_PAGE machines has all of them drawn; a larger one has
# them paged by rank (?machines=N), with every machine that is not healthy (up to ATTENTION_LIMIT of them,
# lowest rank first) drawn above the pages and the machines counted by state.
MACHINES_PER_PAGE = 64
ATTENTION_LIMIT = 48

__all__ = [
    "ATTENTION_LIMIT",
    "MACHINES_PER_PAGE",
    "CheckpointRow",
    "GroupView",
    "JobPage",
    "MachineBox",
    "MachineOverview",
    "MachinePager",
    "PlanRow",
    "Probability",
    "Timeline",
    "job_page",
    "machine_box",
]


@dataclass(frozen=True)
class MachineBox:
    rank: int
    registered: bool  # False: no machine has taken this rank yet
    state: str
    instance_id: str
    hostname: str
    address: str
    local_iteration: int | None  # the oldest of its ranks' newest committed iterations
    local_detail: str
    replica_iteration: int | None  # the oldest of the newest replicas it holds for its peers
    replica_detail: str
    warm_spares: int | None
    replication_lag_s: float | None
    last_heartbeat_at: datetime | None
    sends_to: list[int]
    replicas_skipped: int = 0  # commits no replication round sent; not saves skipped
    store_filesystem: str | None = None  # its checkpoint directory's filesystem, when storage (not memory)


@dataclass(frozen=True)
class GroupView:
    index: int
    kind: str
    machines: list[MachineBox]  # those on the page shown (a ring may span pages)
    healthy: int  # of all its members
    size: int = 0  # all its members

    @property
    def partial(self) -> bool:
        return len(self.machines) < self.size


@dataclass(frozen=True)
class MachinePager:
    """Which ranks the page draws: page `page` of `pages`, ranks first_rank..last_rank."""

    page: int
    pages: int
    first_rank: int
    last_rank: int

    @staticmethod
    def href(page: int) -> str:
        return f"?machines={page}#placement"

    @property
    def prev_href(self) -> str | None:
        return self.href(self.page - 1) if self.page > 1 else None

    @property
    def next_href(self) -> str | None:
        return self.href(self.page + 1) if self.page < self.pages else None


@dataclass(frozen=True)
class MachineOverview:
    """A large job's machines at a glance: counted by state, and the ones that are not healthy."""

    counts: list[tuple[str, int]]  # (state, machines), healthy first; "unregistered": ranks nobody took
    attention: list[MachineBox]  # not healthy, lowest rank first, at most ATTENTION_LIMIT
    attention_total: int
    pager: MachinePager
    page_of: dict[int, int]  # rank -> its page, for the attention boxes' links

    @property
    def attention_hidden(self) -> int:
        return self.attention_total - len(self.attention)


@dataclass(frozen=True)
class Probability:
    k: int
    value: float
    width: float  # 0..1000


@dataclass(frozen=True)
class Timeline:
    rows: list[FailureRow]
    scale_s: float  # the full width of a bar
    hidden: int  # older failures not drawn


@dataclass(frozen=True)
class CheckpointRow:
    iteration: int
    location: str
    created_at: datetime
    shards: int
    world_size: int
    nbytes: int
    complete: bool  # every rank's shard is there, on the current timeline (domain.retention)


@dataclass(frozen=True)
class PlanRow:
    generation: int
    status: str
    iteration: int | None
    reason: str
    created_at: datetime
    ready_at: datetime | None
    tiers: str  # "local x3, peer x1"


@dataclass(frozen=True)
class JobPage:
    job: schemas.JobOut
    href: str
    world_size: int
    groups: list[GroupView]
    replaced: list[MachineBox]
    probabilities: list[Probability]
    open_failure: FailureRow | None
    last_failure: FailureRow | None
    timeline: Timeline
    chart: charts.IterationChart
    checkpoints: list[CheckpointRow]
    plans: list[PlanRow]
    live: bool
    sampling_since: datetime
    now: datetime = field(default_factory=lambda: datetime.now(UTC))
    replaced_total: int = 0  # replaced machines in all (the newest REPLACED_LIMIT are listed)
    plans_hidden: int = 0  # older plans not listed
    checkpoints_hidden: int = 0  # older persisted checkpoints not listed
    # Commits the live machines' replication never sent (the job's saves skipped are counted apart).
    replicas_skipped: int = 0
    overview: MachineOverview | None = None  # a job of more than MACHINES_PER_PAGE machines
    # (rank, filesystem) of the live machines whose checkpoint directory is on storage, not in memory.
    stores_on_storage: list[tuple[int, str]] = field(default_factory=list)

    @property
    def title(self) -> str:
        return self.job.name


def _iterations(values: dict[str, Any]) -> tuple[int | None, str]:
    parsed = {}
    for rank, iteration in values.items():
        try:
            parsed[int(rank)] = int(iteration)
        except (TypeError, ValueError):
            continue
    if not parsed:
        return None, ""
    detail = ", ".join(f"rank {r}: {i}" for r, i in sorted(parsed.items()))
    return min(parsed.values()), detail


def machine_box(rank: int, machine: Machine | None, sends_to: list[int]) -> MachineBox:
    if machine is None:
        return MachineBox(
            rank, False, "unregistered", "", "", "", None, "", None, "", None, None, None, sends_to
        )
    summary = machine.summary or {}
    local, local_detail = _iterations(summary.get("local") or {})
    replica, replica_detail = _iterations(summary.get("replicas") or {})
    spares = as_number(summary.get("warm_spares"))
    return MachineBox(
        rank=rank,
        registered=True,
        state=machine.state,
        instance_id=machine.instance_id,
        hostname=machine.hostname,
        address=f"{machine.address}:{machine.data_port}",
        local_iteration=local,
        local_detail=local_detail,
        replica_iteration=replica,
        replica_detail=replica_detail,
        warm_spares=int(spares) if spares is not None else None,
        replication_lag_s=as_number(summary.get("replication_lag_s")),
        last_heartbeat_at=machine.last_heartbeat_at,
        sends_to=sends_to,
        replicas_skipped=int(as_number(summary.get("replicas_skipped")) or 0),
        store_filesystem=filesystem
        if isinstance(filesystem := summary.get("store_filesystem"), str)
        else None,
    )


def _tier_summary(counts: dict[str, int]) -> str:
    """A plan's sources by tier ("local x3, peer x1"), from the counts the database made."""
    order = ["local", "peer", "persistent"]
    return ", ".join(f"{t} x{counts[t]}" for t in sorted(counts, key=lambda t: [*order, t].index(t)))


# Tier counts of ready plans, by (plan id, job, generation, ready at): a ready plan's sources never change,
# and counting them makes the database parse each plan's per-rank JSON (8,000 sources for 1,000 machines of
# 8 processes: 50 such plans took it most of a second). Each root process counts a plan once.
_TIERS_KEPT = 4096
_ready_tiers: OrderedDict[tuple[int, uuid.UUID, int, datetime | None], dict[str, int]] = OrderedDict()


async def _plan_tiers(
    session: AsyncSession, job_id: uuid.UUID, plans: Sequence[repo.PlanLine]
) -> dict[int, dict[str, int]]:
    """Per plan id, its sources counted by tier: ready plans from what this process counted before, the
    others (and ready ones it has not seen) by the database."""

    def key(plan: repo.PlanLine) -> tuple[int, uuid.UUID, int, datetime | None]:
        return (plan.id, job_id, plan.generation, plan.ready_at)

    found: dict[int, dict[str, int]] = {}
    for plan in plans:
        if plan.status == PlanStatus.READY and key(plan) in _ready_tiers:
            _ready_tiers.move_to_end(key(plan))
            found[plan.id] = _ready_tiers[key(plan)]
    counted = await repo.plan_tier_counts(session, [p.id for p in plans if p.id not in found])
    for plan in plans:
        if plan.id not in found:
            found[plan.id] = counted.get(plan.id, {})
            if plan.status == PlanStatus.READY:
                _ready_tiers[key(plan)] = found[plan.id]
    while len(_ready_tiers) > _TIERS_KEPT:
        _ready_tiers.popitem(last=False)
    return found


async def job_page(
    session: AsyncSession,
    job: Job,
    history: IterationHistory,
    now: datetime | None = None,
    machines_page: int = 1,
) -> JobPage:
    """The page's context. Its reads are bounded by what it shows: the full rows of the machines drawn
    (one page of ranks, and those that need attention), of the others only their rank and state."""
    now = now or datetime.now(UTC)
    job_out = await job_flows.job_out(session, job)
    placement = await job_flows.load_placement(session, job)
    states = await queries.machine_states(session, job.id)
    state_of = {rank: state for rank, state, _, _ in states}
    replicas_skipped = sum(int(as_number(skipped) or 0) for _, _, skipped, _ in states)
    stores_on_storage = [(rank, fs) for rank, _, _, fs in states if isinstance(fs, str) and fs]
    n = job.num_machines
    pages = max(1, math.ceil(n / MACHINES_PER_PAGE))
    page = min(max(1, machines_page), pages)
    first, last = (page - 1) * MACHINES_PER_PAGE, min(n, page * MACHINES_PER_PAGE) - 1
    # One page: every machine is drawn in its group. More: those not healthy are drawn above the pages.
    attention = [r for r in range(n) if state_of.get(r) != MachineState.HEALTHY] if pages > 1 else []
    drawn = sorted({*range(first, last + 1), *attention[:ATTENTION_LIMIT]})
    machine_rows = {m.rank: m for m in await queries.live_machines_at(session, job.id, drawn)}

    def box(rank: int) -> MachineBox:
        return machine_box(rank, machine_rows.get(rank), list(placement.sends_to(rank)))

    groups = []
    for group in placement.groups:
        members = [r for r in group.members if first <= r <= last]
        if members:
            healthy = sum(1 for r in group.members if state_of.get(r) == MachineState.HEALTHY)
            groups.append(
                GroupView(group.index, group.kind, [box(r) for r in members], healthy, len(group.members))
            )
    overview = None
    if pages > 1:
        counted = Counter(state_of.values())
        counted["unregistered"] = n - len(state_of)
        order = [MachineState.HEALTHY, MachineState.SUSPECT, MachineState.FAILED, MachineState.PENDING]
        overview = MachineOverview(
            counts=[
                (str(state), counted[state])
                for state in sorted(counted, key=lambda s: ([*order, s].index(s), s))
                if counted[state]
            ],
            attention=[box(r) for r in attention[:ATTENTION_LIMIT]],
            attention_total=len(attention),
            pager=MachinePager(page, pages, first, last),
            page_of={r: r // MACHINES_PER_PAGE + 1 for r in attention[:ATTENTION_LIMIT]},
        )
    replaced_rows, replaced_total = await repo.replaced_machines(session, job.id, limit=REPLACED_LIMIT)
    replaced = [machine_box(m.rank, m, []) for m in replaced_rows]
    probabilities = [
        Probability(int(k), float(p), round(1000 * float(p), 1))
        for k, p in sorted((job.recovery_probabilities or {}).items(), key=lambda kv: int(kv[0]))
    ]

    # The newest TIMELINE_LIMIT failures (newest first) and how many there are: LIMIT and count() in SQL.
    found = await repo.failures_page(session, job.id, limit=TIMELINE_LIMIT)
    shown, total_failures = (list(found[0]), found[1]) if found is not None else ([], 0)
    numbers = await repo.failure_numbers_of(session, job.id, [e.id for e in shown])
    rows = [failure_row(job.id, e, now, numbers.get(e.id)) for e in shown]
    scale = max([r.elapsed_s for r in rows] + [1.0])  # the longest recovery fills the width
    rows = [replace(r, segments=charts.phase_segments(r.phases, scale)) for r in rows]
    timeline = Timeline(rows, scale, max(0, total_failures - len(shown)))
    open_failure = next((r for r in reversed(rows) if r.open), None)  # the oldest open one drives
    last_failure = next((r for r in rows if not r.open), None)

    # The newest PLAN_LIMIT plans without their per-rank sources; their tiers counted by the database.
    plans, total_plans = await repo.plan_lines(session, job.id, limit=PLAN_LIMIT)
    tiers = await _plan_tiers(session, job.id, plans)
    live = job.state in LIVE_JOB_STATES
    chart = charts.iteration_chart(
        [(s.at, s.iteration) for s in history.samples(job.id)],
        [
            charts.ChartFailure(
                r.id,
                r.kind,
                r.failed_at,
                r.phases[-1].end if r.recovery_s is not None else None,
                r.href,
                r.number,
            )
            for r in rows
        ],
        [
            charts.ChartResume(p.ready_at, p.iteration, p.generation)
            for p in plans
            if p.ready_at is not None and p.iteration is not None and p.generation > 1
        ],
        now=now,
        live=live,
    )
    world_size = job.num_machines * job.procs_per_machine
    lines, total_checkpoints = await repo.checkpoint_lines(session, job.id, limit=CHECKPOINT_LIMIT)
    resumed_from = await repo.resumed_from(session, job.id) if lines else {}
    checkpoints = [
        CheckpointRow(
            iteration=c.iteration,
            location=c.location,
            created_at=c.created_at,
            shards=c.shards,
            world_size=world_size,
            nbytes=c.nbytes,
            complete=is_complete_counted(
                c.iteration,
                shards=c.shards,
                generations=c.generations,
                world_size=world_size,
                resumed_from=resumed_from,
            ),
        )
        for c in lines
    ]
    plan_rows = [
        PlanRow(
            p.generation,
            p.status,
            p.iteration,
            p.reason,
            p.created_at,
            p.ready_at,
            _tier_summary(tiers.get(p.id, {})),
        )
        for p in plans
    ]
    return JobPage(
        job=job_out,
        href=job_href(job.id),
        world_size=world_size,
        groups=groups,
        replaced=replaced,
        probabilities=probabilities,
        open_failure=open_failure,
        last_failure=last_failure,
        timeline=timeline,
        chart=chart,
        checkpoints=checkpoints,
        plans=plan_rows,
        live=live,
        replaced_total=replaced_total,
        plans_hidden=max(0, total_plans - len(plan_rows)),
        checkpoints_hidden=max(0, total_checkpoints - len(checkpoints)),
        replicas_skipped=replicas_skipped,
        overview=overview,
        stores_on_storage=stores_on_storage,
        sampling_since=history.started_at,
        now=now,
    )
