"""One failure's page (/jobs/{id}/failures/{n}): its phases, the machines involved, the cascade it
folded in, the plan that recovered it and where each rank came from."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from services.root.db import repository as repo
from services.root.db.models import FailureEvent, Job, Machine, RecoveryPlan
from services.root.domain import phases
from services.root.flows import recovery
from services.root.web.contexts.common import (
    CLASSIFICATION,
    LIVE_JOB_STATES,
    FailureRow,
    as_number,
    failure_row,
    job_href,
)

__all__ = [
    "CascadeRow",
    "FailurePage",
    "InvolvedMachine",
    "JobRef",
    "PhaseRow",
    "PlanView",
    "SourceRow",
    "failure_page",
]


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
                timings[int(rank)] = (_int(machine_rank), as_number(info.get("seconds")))
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
    plan_found = await repo.get_plan(session, job.id, event.plan_id) if event.plan_id is not None else None
    others = await repo.failures_of_plan(session, plan_found.id) if plan_found is not None else []
    numbers = await repo.failure_numbers_of(session, job.id, [event.id, *(o.id for o in others)])
    row = failure_row(job.id, event, now, numbers.get(event.id))
    # With the machines' progress reports of its plan (their own rows), as the API shows it.
    details = recovery.with_progress(event, await recovery.progress_notes(session, job.id, [event.plan_id]))
    # The machines the failure names (its own, its replacement, those of its cascade), not the job's all.
    replacement = details.get("replacement") if isinstance(details.get("replacement"), dict) else {}
    replaced_by = details.get("replaced_by") or (replacement or {}).get("instance")
    named = [str(details.get("instance_id") or ""), str(replaced_by or "")]
    named += [str(e.get("instance_id", "")) for e in details.get("cascade") or [] if isinstance(e, dict)]
    machines = await repo.machines_by_ids(
        session,
        job.id,
        ids=[event.machine_id] if event.machine_id is not None else [],
        instance_ids=sorted({name for name in named if name}),
    )
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
    if plan_found is not None:
        plan = _plan_view(plan_found, details.get("restore") or {})
        joined = [
            failure_row(job.id, other, now, numbers.get(other.id)) for other in others if other.id != event.id
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
