"""Recovery orchestration: the state machine the leader drives, one step at a time, from the database.

A recovery is a recovery plan of a new generation:
1. collecting: every agent stops its training processes, checks the checksums of what it holds and reports
   its inventory; failed machines are replaced (the replacement registers, takes the rank, reports an
   empty inventory);
2. ready: the pure planner chose one iteration for every rank and a source per rank; agents restore
   (local memory, a peer, the persistent tier), restart training from that iteration and report
   "restored", then "resumed" once their first iteration after it completed.
Failures during step 1 join the recovery; failures during step 2 start a new generation. Every decision is
recorded, so a new leader picks up a recovery in progress where the previous one left it.

`advance` decides and records; it returns the cloud actions (machine replacements) for the caller to
execute outside the transaction.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Collection, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeGuard

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.clients import JobInfo, MachineInfo, ReplacementCancelled
from services.root.db import repository as repo
from services.root.db.database import Database, mark_changed
from services.root.db.models import (
    FailureEvent,
    FailureKind,
    FailureState,
    Job,
    JobState,
    Machine,
    MachineState,
    PlanStatus,
    RecoveryPlan,
    utcnow,
)
from services.root.domain import embedded, persisted, phases, recovery_states
from services.root.domain.ettr import iteration_seconds
from services.root.domain.recovery import (
    MemoryCopy,
    PersistedShard,
    RecoveryDecision,
    UploadInFlight,
    plan_recovery,
)
from services.root.domain.recovery_states import RecoveryState
from services.root.errors import Conflict, NotFound
from services.root.flows.directives import FINISHED_STATES, directive_changed
from services.root.flows.failures import machine_lost
from services.root.flows.machines import live_machine_at, schedule_persist
from services.root.flows.persistence import tier_of
from services.root.settings import Settings

log = logging.getLogger(__name__)

REPLACEMENT_RETRY_S = 10.0
REASON_LIMIT = 500  # RecoveryPlan.reason's column


@dataclass(frozen=True)
class ReplaceMachine:
    """Cloud action: replace `machine` of `job` (failure event `event_id` records the outcome). `intent`:
    what earlier tries recorded before their cloud calls (`replacement.intent`), to continue from."""

    job: JobInfo
    machine: MachineInfo
    event_id: int
    intent: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UploadWait:
    """The leader's memory of a plan waiting for uploads in flight (`_decide`): its generation, until when,
    and the shards it waits for, (iteration, rank, generation). Lost with the leadership: the next leader
    decides afresh and waits anew, at most upload_wait_s more."""

    generation: int
    until: datetime
    awaiting: frozenset[tuple[int, int, int]]


async def advance(
    session: AsyncSession,
    job: Job,
    settings: Settings,
    seen: MutableMapping[uuid.UUID, RecoveryState] | None = None,
    in_flight: Collection[int] | None = None,
    upload_waits: MutableMapping[uuid.UUID, UploadWait] | None = None,
) -> list[ReplaceMachine]:
    """One step of the job's recovery: derive its state (domain.recovery_states) from the database, do
    what that state calls for, and check the state it leaves the recovery in against the protocol's
    transition table. With `seen` (the driver's memory of the state each job was left in at its last
    step), the moves made between two steps (a failure recorded, a replacement registered, machines
    restored) are checked too. `in_flight`: the failure events whose replacement the caller is running
    (see `_replacements`). `upload_waits`: the driver's memory of the plans waiting for uploads in flight;
    without it a plan never waits for them."""
    step = await _step(session, job, settings, in_flight, upload_waits)
    if step is None:
        if seen is not None:
            seen.pop(job.id, None)
        return []
    before, after, actions = step
    if seen is not None:
        _moved(job, seen.get(job.id), before)
        if after is None:
            seen.pop(job.id, None)
        else:
            seen[job.id] = after
    _moved(job, before, after)
    return actions


async def _step(
    session: AsyncSession,
    job: Job,
    settings: Settings,
    in_flight: Collection[int] | None = None,
    upload_waits: MutableMapping[uuid.UUID, UploadWait] | None = None,
) -> tuple[RecoveryState | None, RecoveryState | None, list[ReplaceMachine]] | None:
    """What `advance` does: the state the step found, the state it left, the cloud actions it decided;
    None for a job whose recovery is not orchestrated (not running or recovering, embedded mode)."""
    if job.state not in (JobState.RUNNING, JobState.RECOVERING):
        return None
    if job.state == JobState.RUNNING and not await repo.has_fresh_failures(session, job.id):
        # Nothing to drive, and the leader looks every tick: loading the newest plan (every rank's source)
        # and every machine to find that out kept the root of an idle 1,000-machine job busy.
        return RecoveryState.RUNNING, RecoveryState.RUNNING, []
    now = utcnow()
    # Neither the plan's sources nor the machines' documents: a step runs 5 times a second during a
    # recovery, and at 1,000 machines decoding them took 18 % of the root's event loop. The plan's
    # decision reads the inventories once (_decide).
    plan = await repo.latest_plan(session, job.id, sources=False)
    assert plan is not None, "every job has a plan from its creation"
    events = list(await repo.open_failures(session, job.id))
    waiting = await _waiting_for_agents(session, job, plan, events, now, settings, upload_waits)
    if waiting is not None:
        return waiting, waiting, []
    live = list(await repo.live_machines(session, job.id))
    if any(m.embedded for m in live):
        # torchrun restarts embedded-mode training: failures are recorded, not orchestrated, and closed once
        # the relaunched training commits.
        if events:
            progress = await repo.live_progress(session, job.id)
            _close_relaunched(job, events, live, progress, await repo.last_charged(session, job.id))
        return None
    state = _state_of(job, plan, events, live)
    lost: list[FailureEvent | None] = []  # failures this step records (machines late to report)

    if state == RecoveryState.DETECTED:
        fresh = [e for e in events if e.state == FailureState.DETECTED]
        if job.state == JobState.RECOVERING and plan.status == PlanStatus.READY:
            # A failure before every rank resumed: this recovery failed. In a row, that is a crash loop
            # (or a source that cannot deliver), which restarting again will not fix.
            job.failed_recoveries += 1
            if job.failed_recoveries >= settings.max_failed_recoveries:
                _give_up(session, job, events, now)
                return state, _state_of(job, plan, events, live), []
        if job.state == JobState.RUNNING or plan.status != PlanStatus.COLLECTING:
            plan = await _open_recovery(session, job, plan, fresh)
        for event in events:  # new failures join; those of a superseded restore move along
            if event.plan_id is not None and event.plan_id != plan.id:
                event.restored_at = None  # the new plan restores again: its phases are this one's
            event.state, event.plan_id = FailureState.RECOVERING, plan.id
        await session.flush()
        return (
            state,
            _state_of(job, plan, events, live),
            _replacements(job, live, events, now, settings, in_flight),
        )

    if state == RecoveryState.REPLACING:
        return (
            state,
            state,
            _replacements(job, live, events, now, settings, in_flight),
        )  # replacements to register

    if state == RecoveryState.COLLECTING:
        missing = [m for m in live if m.inventory_generation != plan.generation]
        if not missing:
            await _decide(session, job, plan, live, events, now, settings, upload_waits)
        late = [m for m in missing if _inventory_overdue(plan, m.registered_at, now, settings)]
        for machine in late:
            lost.append(await machine_lost(session, job, machine, "did not report its inventory in time"))

    elif state in (RecoveryState.PLANNED, RecoveryState.RESUMING):
        # The machines' own rows say who restored and resumed; their progress rows (read after them, so
        # every report they count is there) say when the last report arrived.
        if all(m.restored_generation == plan.generation for m in live) and any(
            e.restored_at is None for e in events
        ):
            restored = await _last_report(session, job, plan.generation, now, resumed=False)
            for event in events:
                event.restored_at = event.restored_at or restored
        if all(_resumed(m, plan.generation) for m in live):
            resumed = await _last_report(session, job, plan.generation, now, resumed=True)
            _finish_recovery(job, plan, events, resumed)
        elif _resume_overdue(plan, now, settings):
            for machine in live:
                if not _resumed(machine, plan.generation):
                    lost.append(await machine_lost(session, job, machine, "did not resume training in time"))
    return state, _state_of(job, plan, [*events, *(e for e in lost if e is not None)], live), []


async def _waiting_for_agents(
    session: AsyncSession,
    job: Job,
    plan: RecoveryPlan,
    events: list[FailureEvent],
    now: datetime,
    settings: Settings,
    upload_waits: Mapping[uuid.UUID, UploadWait] | None = None,
) -> RecoveryState | None:
    """The recovery's state when the step below would find nothing to do but wait for the agents'
    reports (inventories, restores, resumes, uploads a plan waits for), none of them overdue; else None
    (the full step runs). Found with one aggregate query instead of every machine's row: a recovery waits
    like this most of its time. Only the common cases: no fresh failure, no failed or embedded machine."""
    if job.state != JobState.RECOVERING or plan.status not in (PlanStatus.COLLECTING, PlanStatus.READY):
        return None
    if any(e.state == FailureState.DETECTED for e in events):
        return None
    progress = await repo.recovery_progress(session, job.id, plan.generation)
    if progress.any_failed or progress.any_embedded:
        return None
    if plan.status == PlanStatus.COLLECTING:
        if not progress.not_inventoried:
            # Every inventory is in: decide, or, where the plan waits for uploads, once they all arrived
            # (the decision reads every inventory and every persisted shard: not 5 times a second).
            if not await _awaiting_uploads(session, job.id, plan, now, upload_waits):
                return None
        else:
            assert progress.oldest_not_inventoried_registered_at is not None
            if _inventory_overdue(plan, progress.oldest_not_inventoried_registered_at, now, settings):
                return None
    else:
        if not progress.not_resumed:
            return None  # every rank resumed: finish
        if not progress.not_restored and any(e.restored_at is None for e in events):
            return None  # every rank restored: record when
        if plan.ready_at is None or _resume_overdue(plan, now, settings):
            return None
    return recovery_states.derive(
        job.state,
        plan.status,
        fresh_failures=False,
        machine_failed=False,
        all_restored=not progress.not_restored,
    )


async def _awaiting_uploads(
    session: AsyncSession,
    job_id: uuid.UUID,
    plan: RecoveryPlan,
    now: datetime,
    upload_waits: Mapping[uuid.UUID, UploadWait] | None,
) -> bool:
    """The plan waits for uploads in flight, not all of which have arrived, and its wait is not over (until
    they all are, nothing restorable changes: deciding again at each arrival of a thousand would read
    everything at every step while they trickle in)."""
    wait = upload_waits.get(job_id) if upload_waits is not None else None
    if wait is None or wait.generation != plan.generation or now >= wait.until:
        return False
    arrived = await repo.persisted_shard_keys(session, job_id, wait.awaiting)
    return not wait.awaiting <= arrived


def _resumed(machine: Machine, generation: int) -> bool:
    """The machine trained in `generation`: it said "resumed" (its first iteration after the restore), or
    "finished" (restored at the last iteration, it had none left to run)."""
    return generation in (machine.resumed_generation, machine.finished_generation)


def _inventory_overdue(
    plan: RecoveryPlan, registered_at: datetime, now: datetime, settings: Settings
) -> bool:
    """A machine registered at `registered_at` owes this collecting plan its inventory by now. A
    replacement's clock starts when it registered: EC2 takes minutes to deliver one."""
    return now - max(plan.created_at, registered_at) > timedelta(seconds=settings.inventory_timeout_s)


def _resume_overdue(plan: RecoveryPlan, now: datetime, settings: Settings) -> bool:
    """The ready plan's ranks should all have resumed by now."""
    return plan.ready_at is not None and now - plan.ready_at > timedelta(seconds=settings.restore_timeout_s)


def _state_of(
    job: Job, plan: RecoveryPlan, events: list[FailureEvent], live: list[Machine]
) -> RecoveryState | None:
    return recovery_states.derive(
        job.state,
        plan.status,
        fresh_failures=any(e.state == FailureState.DETECTED for e in events),
        machine_failed=any(m.state == MachineState.FAILED for m in live),
        all_restored=all(m.restored_generation == plan.generation for m in live),
    )


def _moved(job: Job, source: RecoveryState | None, target: RecoveryState | None) -> None:
    """A step moved the recovery from `source` to `target`: checked against the protocol's table. A
    transition it lacks is a bug, logged loudly; the step's decisions stand (refusing them would leave the
    job's recovery stuck on every pass)."""
    if source is None or target is None or source == target:
        return
    try:
        recovery_states.check(source, target)
    except recovery_states.IllegalTransition as exc:
        log.error("job %s: %s (a bug: the recovery protocol has no such transition)", job.name, exc)
        return
    log.debug("job %s: recovery %s -> %s", job.name, source, target)


async def _open_recovery(
    session: AsyncSession, job: Job, previous: RecoveryPlan, causes: list[FailureEvent]
) -> RecoveryPlan:
    plan = RecoveryPlan(
        job_id=job.id,
        generation=previous.generation + 1,
        iteration=None,
        status=PlanStatus.COLLECTING,
        reason="; ".join(e.cause for e in causes)[:500],
        sources=[],
    )
    session.add(plan)
    await session.flush()  # its id, for the failure events
    job.state = JobState.RECOVERING
    directive_changed(session, job)
    log.info("job %s: recovery generation %d opened: %s", job.name, plan.generation, plan.reason)
    return plan


def _replacements(
    job: Job,
    live: list[Machine],
    events: list[FailureEvent],
    now: datetime,
    settings: Settings,
    in_flight: Collection[int] | None = None,
) -> list[ReplaceMachine]:
    """Replacement requests for failed machines that have none under way: none asked for yet, the last
    one failed (after a pause), a request no one is carrying out (with `in_flight`, the events whose
    replacement this leader runs: a request outside it was left by a leader that died, or a try that
    ended without an outcome, and is continued at once), or a launched machine that has not registered
    replacement_timeout_s after it was asked for (without `in_flight`, a request too). A request keeps the
    intent its earlier tries recorded, so the operator continues it from the cloud's state; a machine that
    was launched and never registered is itself replaced."""
    info = JobInfo(job.id, job.name, job.num_machines, job.launch)
    actions = []
    for machine in live:
        if machine.state != MachineState.FAILED:
            continue
        event = next(
            (e for e in events if e.machine_id == machine.id and e.kind == FailureKind.HARDWARE), None
        )
        if event is None:
            continue
        request = event.details.get("replacement", {})
        status, retry_at = request.get("status"), request.get("retry_at")
        asked_at = datetime.fromisoformat(request["at"]) if "at" in request else now
        timed_out = now - asked_at >= timedelta(seconds=settings.replacement_timeout_s)
        if status == "requested" and in_flight is not None:
            under_way = event.id in in_flight
        else:
            under_way = status in ("requested", "launched") and not timed_out
        if under_way or (retry_at and datetime.fromisoformat(retry_at) > now):
            continue
        intent = dict(request.get("intent") or {})
        if status == "launched":
            # The machine it launched never registered: that instance is replaced in turn.
            intent = {"replacing": request["instance"]} if request.get("instance") else {}
        event.details = {
            **event.details,
            "replacement": {
                "status": "requested",
                "at": now.isoformat(),
                "attempts": request.get("attempts", 0),
                **({"intent": intent} if intent else {}),
            },
        }
        actions.append(
            ReplaceMachine(
                info, MachineInfo(machine.rank, machine.instance_id, machine.address), event.id, intent
            )
        )
    return actions


async def record_intent(session: AsyncSession, event_id: int, intent: dict[str, Any]) -> None:
    """What a replacement is about to ask of the cloud, on its failure event, before it asks. Raises
    ReplacementCancelled when the replacement is no longer wanted: the event is gone or closed, its request
    was cancelled (the machine was reinstated) or its rank has a new holder already."""
    event = await _locked_event(session, event_id)
    request = (event.details.get("replacement") or {}) if event is not None else {}
    if event is None or event.state not in (FailureState.DETECTED, FailureState.RECOVERING):
        raise ReplacementCancelled(f"failure {event_id} is closed")
    if request.get("status") == "cancelled":
        raise ReplacementCancelled(f"the replacement of failure {event_id} was cancelled")
    if event.replaced_at is not None:
        raise ReplacementCancelled(f"the rank of failure {event_id} has a new holder already")
    event.details = {**event.details, "replacement": {**request, "intent": intent}}


async def _locked_event(session: AsyncSession, event_id: int) -> FailureEvent | None:
    """The failure event, read under its job's row lock: every writer of a job's events (the leader's
    step, the worker API) holds that lock, so this read-modify-write of the details loses no one's
    update and no one loses it."""
    event = await session.get(FailureEvent, event_id)
    if event is None:
        return None
    await repo.get_job(session, event.job_id, for_update=True)
    await session.refresh(event)
    return event


async def record_replacement(
    session: AsyncSession, event_id: int, *, instance_id: str | None, detail: str, error: str | None
) -> None:
    """The outcome of a replacement request, on its failure event (the intent its tries recorded stays)."""
    event = await _locked_event(session, event_id)
    if event is None:
        return
    now = utcnow()
    request = event.details.get("replacement", {})
    if error is None:
        outcome: dict[str, Any] = {"status": "launched", "instance": instance_id, "detail": detail}
    else:
        retry = now + timedelta(seconds=REPLACEMENT_RETRY_S)
        outcome = {"status": "error", "error": error, "retry_at": retry.isoformat()}
    attempts = request.get("attempts", 0) + 1
    if request.get("status") == "cancelled":
        # The machine was reinstated while its replacement was being started: the request stays cancelled.
        outcome = {**outcome, "status": "cancelled", "outcome": outcome["status"]}
    kept = {"intent": request["intent"]} if request.get("intent") else {}
    event.details = {
        **event.details,
        "replacement": {**outcome, "attempts": attempts, "at": now.isoformat(), **kept},
    }


async def _decide(
    session: AsyncSession,
    job: Job,
    plan: RecoveryPlan,
    live: list[Machine],
    events: list[FailureEvent],
    now: datetime,
    settings: Settings,
    upload_waits: MutableMapping[uuid.UUID, UploadWait] | None = None,
) -> None:
    """Every machine reported: choose the iteration and the sources, and release the plan; or wait, while
    uploads the machines have in flight would let every rank resume from a newer iteration, up to
    settings.upload_wait_s from the first decision that found them."""
    tier = tier_of(settings)
    inventories = await repo.live_inventories(session, job.id)
    holdings = [(m, h) for m in live for h in inventories.get(m.rank, {}).get("holdings", [])]
    uploading = [
        UploadInFlight(int(u["rank"]), int(u["iteration"]), int(u["generation"]), m.rank)
        for m in live
        for u in inventories.get(m.rank, {}).get("uploading", [])
    ]
    decision = plan_recovery(
        world_size=job.num_machines * job.procs_per_machine,
        procs_per_machine=job.procs_per_machine,
        live_machines=[m.rank for m in live],
        copies=[
            MemoryCopy(
                rank=int(h["rank"]),
                iteration=int(h["iteration"]),
                machine=m.rank,
                digest=str(h["digest"]),
                verified=h.get("verified"),
                generation=int(h.get("generation") or 1),
            )
            for m, h in holdings
        ],
        persisted=[
            # The key is computed again, never read back: a row stored before the root computed keys
            # could name another job's objects.
            PersistedShard(
                shard.rank,
                checkpoint.iteration,
                persisted.shard_of(tier, str(job.id), checkpoint.iteration, shard.rank, shard.generation),
                shard.digest,
                shard.generation,
                condemned=shard.condemned is not None,
            )
            for checkpoint, shard in await repo.persisted_shards(session, job.id)
        ],
        resumed_from=await repo.resumed_from(session, job.id),
        reached=await _reached(session, job, holdings, events),
        uploading=uploading,
    )
    if upload_waits is not None:
        # Left in place once decided (the driver forgets a job's when it ends): a step that fails to commit
        # after taking it out would give the next step a fresh deadline.
        wait = upload_waits.get(job.id)
        if decision.waits_for:
            if wait is None or wait.generation != plan.generation:
                wait = UploadWait(
                    plan.generation, now + timedelta(seconds=settings.upload_wait_s), frozenset()
                )
            if now < wait.until:
                awaiting = frozenset((u.iteration, u.rank, u.generation) for u in decision.waits_for)
                upload_waits[job.id] = dataclasses.replace(wait, awaiting=awaiting)
                _note_upload_wait(job, plan, decision, settings)
                return
    by_rank = {m.rank: m for m in live}
    plan.iteration = decision.iteration
    plan.sources = [_source_json(s, by_rank) for s in decision.sources]
    plan.reason = _reason_then(plan.reason, decision.reason)
    plan.status, plan.ready_at = PlanStatus.READY, now
    rank0 = by_rank[0]
    plan.rendezvous = {"master_addr": rank0.address, "master_port": rank0.rendezvous_port}
    tiers = {str(s.rank): s.tier for s in decision.sources}
    for event in events:
        event.tier = decision.slowest_tier or "none"
        # At most what its column holds: a restart from scratch after iteration 2**31 - 1 loses one more.
        lost = decision.iterations_lost
        event.iterations_lost = min(lost, schemas.INT32_MAX) if lost is not None else None
        event.details = {
            **event.details,
            "plan_generation": plan.generation,
            "tiers": tiers,
            "iteration": decision.iteration,
            # Copies that failed their checksums: the reason a rank came from a slower tier.
            "corrupt": [
                {
                    "machine": m.rank,
                    "rank": h["rank"],
                    "iteration": h["iteration"],
                    "tier": h.get("tier"),
                    "problem": h.get("problem"),
                }
                for m, h in holdings
                if h.get("verified") is False
            ],
        }
    directive_changed(session, job)
    log.info("job %s: generation %d ready: %s", job.name, plan.generation, decision.reason)
    # The new generation's persist target goes out in the same directive, before any rank restarts. Chosen
    # from the restore point, not the machines' reports: those are of the history left behind (past the
    # restore point after a rollback), and the ranks commit nothing of the new one until they resume.
    await session.flush()  # the plan released: the schedule reads its restore point
    in_flight = [(u.rank, u.iteration, u.generation) for u in uploading]
    await schedule_persist(
        session, job, [], plan.generation, latency_s=0.0, releasing=True, uploading=in_flight
    )


def _note_upload_wait(job: Job, plan: RecoveryPlan, decision: RecoveryDecision, settings: Settings) -> None:
    """Say on the plan, once per iteration hoped for, what it waits for (the plans page and API show the
    reason)."""
    newer = decision.waits_for[0].iteration
    note = (
        f"waiting up to {settings.upload_wait_s:g} s for uploads in flight that would make iteration "
        f"{newer} restorable (now: {decision.iteration})"
    )
    if not plan.reason.endswith(note):
        plan.reason = _reason_then(plan.reason, note)
        log.info("job %s: generation %d %s", job.name, plan.generation, note)


def _reason_then(reason: str, then: str) -> str:
    """`reason -> then` within the plan's 500 characters, `then` whole: what the plan decided is never the
    part cut off (a long failure cause is)."""
    joined = f"{reason} -> {then}"
    if len(joined) <= REASON_LIMIT:
        return joined
    keep = max(0, REASON_LIMIT - len(then) - len("... -> "))
    return f"{reason[:keep]}... -> {then}"[:REASON_LIMIT]


def _source_json(source: Any, by_rank: dict[int, Machine]) -> dict[str, Any]:
    machine = by_rank.get(source.machine) if source.machine is not None else None
    return schemas.PlanSource(
        rank=source.rank,
        tier=source.tier,
        source_rank=source.machine,
        address=machine.address if machine else None,
        data_port=machine.data_port if machine else None,
        location=source.location,
        digest=source.digest,
    ).model_dump()


async def _reached(
    session: AsyncSession,
    job: Job,
    holdings: list[tuple[Machine, dict[str, Any]]],
    events: list[FailureEvent],
) -> int | None:
    """The newest iteration any rank committed before the failure: inventories of the survivors
    (`holdings`: each live machine's) and the last heartbeat of every live machine and of the machines of
    this recovery's failures (replaced by now)."""
    failed = [e.machine_id for e in events if e.machine_id is not None]
    newest = await repo.newest_summary_iterations(session, job.id, failed)
    newest += [int(h["iteration"]) for _, h in holdings if h.get("tier") == "local"]
    return max(newest) if newest else None


def _give_up(session: AsyncSession, job: Job, events: list[FailureEvent], now: datetime) -> None:
    """max_failed_recoveries recoveries in a row failed before training resumed: the job has failed. Its
    agents stop (the directive says finished) and keep their shared memory, to salvage."""
    why = (
        f"{job.failed_recoveries} recoveries in a row failed before training resumed; the job is marked "
        "failed (CASTOR_MAX_FAILED_RECOVERIES)"
    )
    for event in events:
        event.state = FailureState.UNRECOVERABLE
        event.details = {**event.details, "unrecoverable": why}
    job.state, job.finished_at = JobState.FAILED, now
    directive_changed(session, job)
    log.error("job %s: %s", job.name, why)


# How the API and the pages show a recovery's progress reports on its failure events (the keys their
# details carried before the reports got rows of their own, migration 0008): machine rank -> when its
# "restored" and "resumed" reports arrived (ISO time; a "finished" before any "resumed" counts as one),
# and the details of its restore.
RESTORED_AT = "restored_reported_at"
RESUMED_AT = "resumed_reported_at"
RESTORE = "restore"


async def _last_report(
    session: AsyncSession, job: Job, generation: int, now: datetime, *, resumed: bool
) -> datetime:
    """When the last machine's first "restored" (`resumed`: "resumed") report of `generation` arrived: a
    phase ends at the last machine's report, not at the leader's next pass, which trails it (`now` if none
    was recorded)."""
    return await repo.last_progress(session, job.id, generation, resumed=resumed) or now


async def progress_notes(
    session: AsyncSession, job_id: uuid.UUID, plan_ids: Collection[int | None]
) -> dict[int, dict[str, dict[str, Any]]]:
    """Per plan id, its machines' progress reports as the failure events' details show them: RESTORED_AT,
    RESUMED_AT and RESTORE, each machine rank (a string) -> its value; a plan with no report is absent."""
    notes: dict[int, dict[str, dict[str, Any]]] = {}
    wanted = sorted({plan_id for plan_id in plan_ids if plan_id is not None})
    for plan_id, row in await repo.plan_progress(session, job_id, wanted):
        note = notes.setdefault(plan_id, {})
        rank = str(row.rank)
        if row.restored_at is not None:
            note.setdefault(RESTORED_AT, {})[rank] = row.restored_at.isoformat()
            note.setdefault(RESTORE, {})[rank] = row.restore
        if row.resumed_at is not None:
            note.setdefault(RESUMED_AT, {})[rank] = row.resumed_at.isoformat()
    return notes


def with_progress(event: FailureEvent, notes: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The event's details with its plan's progress reports (progress_notes) merged in."""
    details = dict(event.details or {})
    if event.plan_id is not None:
        details.update(notes.get(event.plan_id, {}))
    return details


def _finish_recovery(job: Job, plan: RecoveryPlan, events: list[FailureEvent], now: datetime) -> None:
    """Every rank completed an iteration after the restore (`now`: when the last one reported it): the
    failures are recovered."""
    started = min(e.detected_at for e in events) if events else plan.created_at
    iteration_s = iteration_seconds(job.checkpoints_per_minute) or 0.0
    lost = max((e.iterations_lost or 0) for e in events) if events else 0
    for event in events:
        event.restored_at = event.restored_at or now
        event.resumed_at = now
        event.state = FailureState.RECOVERED
    job.wasted_time_s += (now - started).total_seconds() + lost * iteration_s
    job.state, job.failed_recoveries = JobState.RUNNING, 0
    log.info("job %s: recovered at generation %d", job.name, plan.generation)


NOTHING_SAID = embedded.Progress(0)  # a machine whose summary is not its registered session's


def _close_relaunched(
    job: Job,
    events: list[FailureEvent],
    live: list[Machine],
    progress: dict[int, embedded.Progress],
    charged: embedded.Charged,
) -> None:
    """Embedded mode: the failures whose machine trains again since torchrun relaunched it are recovered,
    and those of a machine that came back without a relaunch (embedded.came_back)."""
    by_id = {event.id: event for event in events}
    holders = {m.rank: m for m in live}
    came_back = embedded.came_back(events, holders, progress)
    back = {r.event_id for r in came_back}
    closing = embedded.resumed_after_relaunch(events, holders, progress) + came_back
    for found in sorted(closing, key=lambda r: (r.at, by_id[r.event_id].detected_at, r.event_id)):
        event = by_id[found.event_id]
        if found.event_id in back:
            why = "its heartbeats resumed without a relaunch: its training never stopped"
            event.iterations_lost = 0  # no restore: nothing rolled back
        else:
            why = "its training committed again after the relaunch"
        charged = _close_embedded(job, event, found.at, why, charged, found.restored, found.reached)


def _close_embedded(
    job: Job,
    event: FailureEvent,
    at: datetime,
    why: str,
    charged: embedded.Charged,
    restored: int | None = None,
    reached: int | None = None,
) -> embedded.Charged:
    """Close one embedded-mode failure at `at`, its relaunched training having restored `restored` while
    holding up to `reached` (see embedded.rollback). `charged`: what the failures closed before it charged
    the job. A failure that began (phases.failed_at, as the ETTR counts it) at or before the last resume is
    part of that crash: the job is charged the downtime its detection and resume add to the crash's span,
    and the crash's rollback once, its largest. Returns what is charged after this one."""
    # No plan, no per-rank reports: the restore (torchrun's relaunch, the ranks agreeing on the newest
    # iteration they all hold) ends where the first commit after it is seen.
    at = max(at, event.detected_at)
    event.restored_at = event.restored_at or at
    event.resumed_at = at
    event.state = FailureState.RECOVERED
    noted = event.details.get(embedded.REACHED)
    tier, lost = embedded.rollback(embedded.newer(noted if type(noted) is int else None, reached), restored)
    if tier is not None:
        event.tier = tier
        event.iterations_lost = min(lost, schemas.INT32_MAX) if lost is not None else None
    detected, until = event.detected_at, charged.until
    same_crash = until is not None and charged.crash is not None and phases.failed_at(event) <= until
    crash = charged.crash if same_crash and charged.crash is not None else event.id
    before = charged.lost if same_crash else 0
    crash_lost = max(before, event.iterations_lost or 0)
    since = min(detected, charged.since or detected) if same_crash else detected
    # Downtime: what this failure adds before the crash's span (detected earlier than any before it) and
    # after it (resumed later).
    down = max(0.0, (at - max(detected, until or detected)).total_seconds())
    if same_crash and charged.since is not None and detected < charged.since:
        down += (charged.since - detected).total_seconds()
    event.details = {
        **event.details,
        "embedded_recovery": why,
        embedded.CRASH: crash,
        embedded.CRASH_LOST: crash_lost,
        embedded.CRASH_SINCE: since.isoformat(),
    }
    iteration_s = iteration_seconds(job.checkpoints_per_minute) or 0.0
    job.wasted_time_s += down + (crash_lost - before) * iteration_s
    log.info("job %s: failure %d recovered (embedded mode: %s)", job.name, event.id, why)
    return embedded.Charged(max(at, until or at), crash, crash_lost, since)


async def complete_if_finished(session: AsyncSession, job_id: uuid.UUID, generation: int) -> None:
    """Complete the running job once every live machine reported "finished" for `generation`: a conditional
    UPDATE, so of several callers at once exactly one completes it. Called after each "finished" report
    commits, and by the leader after a step that closed a recovery commits: where training ended right after
    a recovery, every "finished" can come while the job is still recovering (the agent sends its "resumed"
    in the background, so the last one may come after them), and none of those reports can complete it.
    Both after their own commit: on Postgres an UPDATE whose WHERE the committed row fails skips that row
    without waiting for the transaction that holds it, so a check inside the leader's transaction would miss
    a "finished" that commits after its count and tries to complete before its commit."""
    if await repo.unfinished_machines(session, job_id, generation) == 0 and (
        name := await repo.complete_job(session, job_id, utcnow())
    ):
        mark_changed(session, job_id)  # the directive says finished: wake the long polls
        log.info("job %s: every machine finished; the job is complete", name)
        await _close_at_completion(session, job_id)


async def _close_at_completion(session: AsyncSession, job_id: uuid.UUID) -> None:
    """An embedded-mode job completes while running, with any failure torchrun's relaunch recovered from
    still open when its relaunched training finished before a heartbeat showed a commit: every machine
    finished, so each is over. (A job whose recovery the root orchestrates completes only once recovered.)"""
    events = list(await repo.open_failures(session, job_id))
    if not events or not any(m.embedded for m in await repo.live_machines(session, job_id)):
        return
    job = await repo.get_job(session, job_id, for_update=True)
    assert job is not None
    now = utcnow()
    charged = await repo.last_charged(session, job_id)
    progress = await repo.live_progress(session, job_id)
    for event in sorted(events, key=lambda e: e.detected_at):
        # What the machine's training restored says nothing of a failure it was not relaunched for (a
        # silence it came back from).
        relaunched = embedded.RELAUNCHED_AT in event.details
        said = (
            progress.get(event.rank, NOTHING_SAID) if relaunched and event.rank is not None else NOTHING_SAID
        )
        why = "the job completed after the relaunch"
        charged = _close_embedded(job, event, now, why, charged, said.restored, said.reached)


# -- what agents report during a recovery ------------------------------------------------------------------


async def record_inventory(
    database: Database, job_id: uuid.UUID, rank: int, report: schemas.InventoryReport
) -> None:
    """A machine's inventory for the recovery being collected: one statement that writes its own row if the
    job's newest plan is that generation and still collecting (nothing shared locked, the job row not
    read: a thousand of these come at once). A report that races the plan's decision is harmless: the
    leader decides only once every machine's inventory of the generation is in, read from these rows."""
    values: dict[str, Any] = {
        "inventory": {
            "holdings": [h.model_dump() for h in report.holdings],
            "uploading": [u.model_dump() for u in report.uploading],
        },
        "inventory_generation": report.generation,
    }
    if report.rendezvous_port is not None:
        values["rendezvous_port"] = report.rendezvous_port
    async with database.single_statement() as connection:
        marked = await repo.mark_machine_if_collecting(
            connection, job_id, rank, report.instance_id, report.generation, **values
        )
    if marked is not None:
        return
    async with database.session() as session:  # why not: off the hot path
        latest = await repo.latest_plan_head(session, job_id)
        await _live_machine_of(session, job_id, rank, report.instance_id)  # a zombie gets its 409
        if latest is None or (latest.generation, latest.status) != (report.generation, PlanStatus.COLLECTING):
            return  # a late report for a recovery that has moved on
    raise Conflict(f"instance {report.instance_id!r} is not machine {rank}", code="not_registered")


async def _live_machine_of(session: AsyncSession, job_id: uuid.UUID, rank: int, instance_id: str) -> None:
    """A report whose own statements found no machine: why, as the API says it (404 for a job that does not
    exist, 409 for an instance that is not, or no longer, machine `rank`). Off the hot path."""
    job = await repo.get_job(session, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist", code="job_not_found")
    await live_machine_at(session, job, rank, instance_id)


async def record_progress(
    database: Database, job_id: uuid.UUID, rank: int, report: schemas.ProgressReport
) -> None:
    """An agent's progress through the current plan: this machine's row and its progress row for the
    generation, in one statement (Postgres; two on SQLite) that locks nothing shared and reads no job row,
    no failure event (the pages and the leader read the progress rows). After "finished" commits, the job
    completes when every live machine finished: a conditional UPDATE of the job row, so of several last
    reports at once exactly one completes it. A "finished" is also the machine's resumed time, unless it
    said "resumed" first: a machine restored at the last iteration says only "finished", and the recovery
    ends at the last machine's report."""
    if report.event == "restore_failed":
        async with database.session() as session:
            job = await repo.get_job(session, job_id)
            if job is None:
                raise NotFound(f"job {job_id} does not exist", code="job_not_found")
            await _restore_failed(session, job, rank, report)
        return
    async with database.single_statement() as connection:
        marked = await repo.mark_progress(
            connection,
            job_id,
            rank,
            report.instance_id,
            report.generation,
            report.event,
            utcnow(),
            restore=report.details if report.event == "restored" else None,
        )
    if marked is None:
        async with database.session() as session:
            await _live_machine_of(session, job_id, rank, report.instance_id)  # says why (404, 409)
        raise Conflict(f"instance {report.instance_id!r} is not machine {rank}", code="not_registered")
    if report.event == "finished":
        # After this machine's row committed: of the last machines reporting at once, at least the one
        # that commits last sees every machine finished, and the conditional UPDATE (a running job only)
        # lets one of them win.
        async with database.session() as session:
            await complete_if_finished(session, job_id, report.generation)


async def _restore_failed(session: AsyncSession, job: Job, rank: int, report: schemas.ProgressReport) -> None:
    """A source could not deliver: a failure of its own, recorded under the job row's lock as the other
    writers of a job's failure events do (rare: not a hot path). Only for the job's current plan: a restore
    of a plan a newer one replaced (its source died and the newer recovery covers that) would count as
    that recovery failing and restart the job again, and a finished job has nothing to recover."""
    await repo.get_job(session, job.id, for_update=True)  # refreshed under the lock
    machine = await live_machine_at(session, job, rank, report.instance_id)
    head = await repo.latest_plan_head(session, job.id)
    current = head.generation if head is not None else None
    if job.state in FINISHED_STATES or current != report.generation:
        log.info(
            "job %s: machine %d could not restore plan %d; ignored (the job is %s at plan %s)",
            job.name,
            rank,
            report.generation,
            job.state,
            current,
        )
        return
    now = utcnow()
    session.add(
        FailureEvent(
            job_id=job.id,
            machine_id=machine.id,
            rank=rank,
            kind=FailureKind.UNKNOWN,
            detected_at=now,
            classified_at=now,
            cause=f"machine {rank} could not restore: {report.details.get('error', '?')}"[:500],
            details=report.details,
        )
    )
    hosted = persisted.hosted_ranks(rank, job.procs_per_machine)
    for shard in unusable_persisted(report.details):
        if shard.rank in hosted and await repo.condemn_shard(
            session, job.id, shard.iteration, shard.rank, shard.digest, shard.problem
        ):
            log.warning(
                "job %s: rank %d's persisted shard of iteration %d could not be restored (%s): no plan "
                "names it again",
                job.name,
                shard.rank,
                shard.iteration,
                shard.problem,
            )


@dataclass(frozen=True)
class UnusableShard:
    rank: int
    iteration: int
    digest: str
    problem: str


DIGEST_MAX = 64  # persisted_shards.digest


def _is_count(value: Any) -> TypeGuard[int]:
    return type(value) is int and 0 <= value <= schemas.INT32_MAX


def unusable_persisted(details: dict[str, Any]) -> list[UnusableShard]:
    """The persisted shards a `restore_failed` report says were missing or failed their checksums
    (`unusable_persisted`: [{"rank", "iteration", "digest", "problem"}]); malformed entries are skipped."""
    entries = details.get("unusable_persisted")
    found = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        rank, iteration, digest = entry.get("rank"), entry.get("iteration"), entry.get("digest")
        # Free-form details: bounded here as the columns they are matched against are (an out-of-range
        # integer would fail the statement, and with it the report that records the failure).
        if (
            _is_count(rank)
            and _is_count(iteration)
            and isinstance(digest, str)
            and 0 < len(digest) <= DIGEST_MAX
        ):
            found.append(UnusableShard(rank, iteration, digest, str(entry.get("problem") or "unusable")))
    return found
