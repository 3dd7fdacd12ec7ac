"""Page contexts: typed, ready-to-draw views of what the repository reads, one dataclass per page.

The routes stay thin (authenticate, read, render); the templates only format and draw what is here.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.models import FailureEvent, FailureState, Job, JobState, Machine, RecoveryPlan
from services.root.domain import phases
from services.root.flows import jobs as job_flows
from services.root.web import charts, queries
from services.root.web.sampler import IterationHistory

LIVE_JOB_STATES = frozenset({JobState.PENDING, JobState.RUNNING, JobState.RECOVERING})
JOB_STATES = tuple(state.value for state in JobState)
TIMELINE_LIMIT = 50

CLASSIFICATION = {
    "software": "A training process ended abnormally while its machine's agent stayed up: the machine and "
    "its memory are intact, so its ranks restart there from local memory.",
    "hardware": "The machine itself was lost (no heartbeat, an expired lease, or the cloud reported it "
    "unhealthy): it is replaced, and its ranks come back from a peer's memory, or from the persistent tier "
    "when its whole placement group was lost.",
    "unknown": "Castor could not tell what failed (for example, a restore that could not complete); the "
    "cause says what was seen.",
}

TIER_MEANING = {
    "local": "every rank restored from its own machine's memory",
    "peer": "at least one rank was fetched from a peer machine's memory",
    "persistent": "at least one rank came from the persistent tier (a whole placement group was lost)",
    "none": "nothing restorable: training restarted from scratch",
}


def job_href(job_id: uuid.UUID) -> str:
    return f"/jobs/{job_id}"


def failure_href(job_id: uuid.UUID, failure_id: int) -> str:
    return f"/jobs/{job_id}/failures/{failure_id}"


# -- jobs list ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StateTab:
    label: str
    state: str | None
    count: int
    href: str
    active: bool


@dataclass(frozen=True)
class JobRow:
    id: uuid.UUID
    name: str
    href: str
    state: str
    machines: int
    machines_healthy: int
    replicas: int
    placement_strategy: str
    newest_iteration: int | None
    checkpoints_per_minute: float | None
    failures: int
    wasted_time_s: float
    created_at: datetime


@dataclass(frozen=True)
class JobsPage:
    rows: list[JobRow]
    tabs: list[StateTab]
    state: str | None
    page: int
    pages: int
    total: int
    per_page: int
    prev_href: str | None
    next_href: str | None
    live: bool
    notice: str | None = None
    title: str = "Jobs"


def _list_href(state: str | None, page: int = 1) -> str:
    params: dict[str, str | int] = {}
    if state:
        params["state"] = state
    if page > 1:
        params["page"] = page
    return "/" + ("?" + urlencode(params) if params else "")


async def jobs_page(
    session: AsyncSession, *, state: str | None, page: int, per_page: int, notice: str | None = None
) -> JobsPage:
    counts = await queries.jobs_by_state(session)
    total_all = sum(counts.values())
    jobs, total = await repo.list_jobs(session, state=state, limit=per_page, offset=(page - 1) * per_page)
    rows = [
        JobRow(
            id=job.id,
            name=job.name,
            href=job_href(job.id),
            state=job.state,
            machines=job.machines,
            machines_healthy=job.machines_healthy,
            replicas=job.replicas,
            placement_strategy=job.placement_strategy,
            newest_iteration=job.newest_iteration,
            checkpoints_per_minute=job.checkpoints_per_minute,
            failures=job.failures,
            wasted_time_s=job.wasted_time_s,
            created_at=job.created_at,
        )
        for job in await job_flows.jobs_out(session, jobs)
    ]
    tabs = [StateTab("all", None, total_all, _list_href(None), state is None)]
    tabs += [StateTab(s, s, counts.get(s, 0), _list_href(s), state == s) for s in JOB_STATES]
    pages = max(1, math.ceil(total / per_page))
    return JobsPage(
        rows=rows,
        tabs=tabs,
        state=state,
        page=page,
        pages=pages,
        total=total,
        per_page=per_page,
        prev_href=_list_href(state, page - 1) if page > 1 else None,
        next_href=_list_href(state, page + 1) if page < pages else None,
        live=any(r.state in LIVE_JOB_STATES for r in rows),
        notice=notice,
    )


# -- pieces shared by the job and failure pages ------------------------------------------------------------


@dataclass(frozen=True)
class FailureRow:
    id: int
    href: str
    kind: str
    state: str
    cause: str
    rank: int | None
    instance_id: str | None
    detected_at: datetime
    failed_at: datetime
    tier: str | None
    iterations_lost: int | None
    recovery_s: float | None  # detection to training resumed (phases.recovery_seconds); None until then
    elapsed_s: float  # so far, or in all
    phases: list[phases.Phase]
    segments: list[charts.Segment]
    current_phase: str | None  # the phase under way
    open: bool
    generation: int | None
    resumed_iteration: int | None
    number: int | None = None  # within the job (#3), as shown; the id is global and skips numbers

    @property
    def label(self) -> str:
        return f"#{self.number if self.number is not None else self.id}"

    @property
    def tier_meaning(self) -> str:
        return TIER_MEANING.get(self.tier or "", "")


def failure_row(
    job_id: uuid.UUID, event: FailureEvent, now: datetime, number: int | None = None
) -> FailureRow:
    is_open = event.state in (FailureState.DETECTED, FailureState.RECOVERING)
    steps = phases.phases(event, now, finished=not is_open)
    elapsed = sum(p.seconds for p in steps)
    current = steps[-1].name if steps and steps[-1].end is None else None
    details = event.details or {}
    return FailureRow(
        id=event.id,
        href=failure_href(job_id, event.id),
        kind=event.kind,
        state=event.state,
        cause=event.cause,
        rank=event.rank,
        instance_id=details.get("instance_id"),
        detected_at=event.detected_at,
        failed_at=phases.failed_at(event),
        tier=event.tier,
        iterations_lost=event.iterations_lost,
        recovery_s=phases.recovery_seconds(event),
        elapsed_s=elapsed,
        phases=steps,
        segments=charts.phase_segments(steps, elapsed),
        current_phase=current,
        open=is_open,
        generation=details.get("plan_generation"),
        resumed_iteration=details.get("iteration"),
        number=number,
    )


# -- job page ----------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class GroupView:
    index: int
    kind: str
    machines: list[MachineBox]
    healthy: int


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

    @property
    def complete(self) -> bool:
        return self.shards == self.world_size


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

    @property
    def title(self) -> str:
        return self.job.name

    @property
    def replicas_skipped(self) -> int:
        """Commits the live machines' replication never sent (the job's saves skipped are counted apart)."""
        return sum(m.replicas_skipped for group in self.groups for m in group.machines)


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


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def machine_box(rank: int, machine: Machine | None, sends_to: list[int]) -> MachineBox:
    if machine is None:
        return MachineBox(
            rank, False, "unregistered", "", "", "", None, "", None, "", None, None, None, sends_to
        )
    summary = machine.summary or {}
    local, local_detail = _iterations(summary.get("local") or {})
    replica, replica_detail = _iterations(summary.get("replicas") or {})
    spares = _number(summary.get("warm_spares"))
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
        replication_lag_s=_number(summary.get("replication_lag_s")),
        last_heartbeat_at=machine.last_heartbeat_at,
        sends_to=sends_to,
        replicas_skipped=int(_number(summary.get("replicas_skipped")) or 0),
    )


def _tier_summary(sources: Sequence[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for source in sources:
        counts[str(source.get("tier"))] = counts.get(str(source.get("tier")), 0) + 1
    order = ["local", "peer", "persistent"]
    return ", ".join(f"{t} x{counts[t]}" for t in sorted(counts, key=lambda t: [*order, t].index(t)))


async def job_page(
    session: AsyncSession, job: Job, history: IterationHistory, now: datetime | None = None
) -> JobPage:
    now = now or datetime.now(UTC)
    job_out = await job_flows.job_out(session, job)
    placement = await job_flows.job_placement(session, job)
    machines = await repo.all_machines(session, job.id)
    live_by_rank = {m.rank: m for m in machines if m.state != "replaced"}
    sends = {r.rank: r.sends_to for r in placement.ranks}
    groups = []
    for group in placement.groups:
        boxes = [machine_box(r, live_by_rank.get(r), list(sends.get(r, []))) for r in group.members]
        groups.append(
            GroupView(group.index, group.kind, boxes, sum(1 for b in boxes if b.state == "healthy"))
        )
    replaced = [machine_box(m.rank, m, []) for m in machines if m.state == "replaced"]
    probabilities = [
        Probability(int(k), float(p), round(1000 * float(p), 1))
        for k, p in sorted(placement.recovery_probability.items(), key=lambda kv: int(kv[0]))
    ]

    events = list(await repo.list_failures(session, job.id))  # newest first
    shown = events[:TIMELINE_LIMIT]
    numbers = await repo.failure_numbers(session, job.id)
    rows = [failure_row(job.id, e, now, numbers.get(e.id)) for e in shown]
    scale = max([r.elapsed_s for r in rows] + [1.0])  # the longest recovery fills the width
    rows = [replace(r, segments=charts.phase_segments(r.phases, scale)) for r in rows]
    timeline = Timeline(rows, scale, len(events) - len(shown))
    open_failure = next((r for r in reversed(rows) if r.open), None)  # the oldest open one drives
    last_failure = next((r for r in rows if not r.open), None)

    plans = list(await repo.list_plans(session, job.id))
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
    checkpoints = [
        CheckpointRow(
            iteration=c.iteration,
            location=c.location,
            created_at=c.created_at,
            shards=len(c.shards),
            world_size=world_size,
            nbytes=sum(s.nbytes for s in c.shards),
        )
        for c in await repo.list_persisted(session, job.id)
    ]
    plan_rows = [
        PlanRow(
            p.generation, p.status, p.iteration, p.reason, p.created_at, p.ready_at, _tier_summary(p.sources)
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
        sampling_since=history.started_at,
        now=now,
    )


# -- failure page ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseRow:
    name: str
    start: datetime
    end: datetime | None
    seconds: float
    help: str


@dataclass(frozen=True)
class InvolvedMachine:
    role: str
    rank: int | None
    instance_id: str
    state: str
    address: str
    note: str


@dataclass(frozen=True)
class CascadeRow:
    cause: str
    machine_rank: int | None
    global_rank: int | None
    exit_code: int | None
    instance_id: str
    at: datetime | None


@dataclass(frozen=True)
class SourceRow:
    rank: int
    tier: str
    source_rank: int | None
    address: str
    location: str
    digest: str
    restored_by: int | None  # the machine that restored this rank
    seconds: float | None  # how long its restore took


@dataclass(frozen=True)
class PlanView:
    generation: int
    status: str
    iteration: int | None
    reason: str
    created_at: datetime
    ready_at: datetime | None
    sources: list[SourceRow]


@dataclass(frozen=True)
class JobRef:
    id: uuid.UUID
    name: str
    state: str
    href: str


@dataclass(frozen=True)
class FailurePage:
    job: JobRef
    failure: FailureRow
    phases: list[PhaseRow]
    classification: str
    machines: list[InvolvedMachine]
    cascade: list[CascadeRow]
    plan: PlanView | None
    joined: list[FailureRow]  # the other failures this recovery handled
    replacement: dict[str, Any]
    exit_code: int | None
    details_json: str
    live: bool
    now: datetime
    # The training process's uncaught exception, when its error file had one: {type, message, traceback}.
    error: dict[str, Any] | None = None

    @property
    def title(self) -> str:
        return f"Failure #{self.failure.id} · {self.job.name}"


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _plan_view(plan: RecoveryPlan, restore: dict[str, Any]) -> PlanView:
    timings: dict[int, tuple[int | None, float | None]] = {}
    for machine_rank, ranks in (restore or {}).items():
        if not isinstance(ranks, dict):
            continue
        for rank, info in ranks.items():
            if isinstance(info, dict) and _int(rank) is not None:
                timings[int(rank)] = (_int(machine_rank), _number(info.get("seconds")))
    sources = []
    for source in sorted(plan.sources or [], key=lambda s: int(s.get("rank", 0))):
        rank = int(source.get("rank", 0))
        by, seconds = timings.get(rank, (None, None))
        address = f"{source['address']}:{source['data_port']}" if source.get("address") else ""
        sources.append(
            SourceRow(
                rank=rank,
                tier=str(source.get("tier", "")),
                source_rank=_int(source.get("source_rank")),
                address=address,
                location=str(source.get("location") or ""),
                digest=str(source.get("digest") or ""),
                restored_by=by,
                seconds=seconds,
            )
        )
    return PlanView(
        plan.generation, plan.status, plan.iteration, plan.reason, plan.created_at, plan.ready_at, sources
    )


async def failure_page(
    session: AsyncSession, job: Job, event: FailureEvent, now: datetime | None = None
) -> FailurePage:
    now = now or datetime.now(UTC)
    numbers = await repo.failure_numbers(session, job.id)
    row = failure_row(job.id, event, now, numbers.get(event.id))
    details = event.details or {}
    machines = await repo.all_machines(session, job.id)
    by_id = {m.id: m for m in machines}
    by_instance = {m.instance_id: m for m in machines}

    involved: list[InvolvedMachine] = []

    def add(role: str, machine: Machine | None, instance: str, note: str = "") -> None:
        if machine is None:
            involved.append(InvolvedMachine(role, None, instance, "unknown", "", note))
        else:
            address = f"{machine.address}:{machine.data_port}"
            involved.append(
                InvolvedMachine(role, machine.rank, machine.instance_id, machine.state, address, note)
            )

    failed = by_id.get(event.machine_id) if event.machine_id is not None else None
    if failed is not None or details.get("instance_id"):
        role = "lost machine" if event.kind == "hardware" else "machine of the failed process"
        add(role, failed, str(details.get("instance_id", "")))
    replacement = details.get("replacement") if isinstance(details.get("replacement"), dict) else {}
    replaced_by = details.get("replaced_by") or (replacement or {}).get("instance")
    if replaced_by:
        add("replacement", by_instance.get(str(replaced_by)), str(replaced_by), "took the failed rank")
    cascade = []
    for entry in details.get("cascade") or []:
        if not isinstance(entry, dict):
            continue
        cascade.append(
            CascadeRow(
                cause=str(entry.get("cause", "")),
                machine_rank=_int(entry.get("machine_rank")),
                global_rank=_int(entry.get("global_rank")),
                exit_code=_int(entry.get("exit_code")),
                instance_id=str(entry.get("instance_id", "")),
                at=phases.parse_timestamp(entry.get("at")),
            )
        )
        instance = str(entry.get("instance_id", ""))
        if instance and all(m.instance_id != instance for m in involved):
            add("a process ended as a consequence", by_instance.get(instance), instance)

    plan = None
    joined: list[FailureRow] = []
    if event.plan_id is not None:
        plans = {p.id: p for p in await repo.list_plans(session, job.id)}
        found = plans.get(event.plan_id)
        if found is not None:
            plan = _plan_view(found, details.get("restore") or {})
            joined = [
                failure_row(job.id, other, now, numbers.get(other.id))
                for other in await repo.failures_of_plan(session, found.id)
                if other.id != event.id
            ]
    return FailurePage(
        job=JobRef(job.id, job.name, job.state, job_href(job.id)),
        failure=row,
        phases=[PhaseRow(p.name, p.start, p.end, p.seconds, phases.PHASE_HELP[p.name]) for p in row.phases],
        classification=CLASSIFICATION.get(event.kind, ""),
        machines=involved,
        cascade=cascade,
        plan=plan,
        joined=joined,
        replacement=replacement or {},
        exit_code=_int(details.get("exit_code")),
        details_json=json.dumps(details, indent=2, sort_keys=True, default=str),
        live=row.open or job.state in LIVE_JOB_STATES,
        now=now,
        error=details["error"] if isinstance(details.get("error"), dict) else None,
    )
