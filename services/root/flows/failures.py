"""Failures as they are detected: a training process's exit (reported by its agent at once), a machine
that stopped heartbeating or whose etcd lease expired, an instance the cloud reports unhealthy.

Classification follows who is still there: a process died on a machine whose agent reports it, so the
machine is fine (software); the agent itself is gone (hardware). A failure while a recovery is being
prepared joins that recovery; a process exit then is usually a consequence (the ranks waiting on a dead
peer's collective fail too) and is recorded on the open event rather than as a failure of its own, as is
an exit of a process from a generation a recovery has already replaced (reported late: `join_exit`).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from services.root import schemas
from services.root.db import repository as repo
from services.root.db.models import (
    FailureEvent,
    FailureKind,
    FailureState,
    Job,
    JobState,
    Machine,
    MachineState,
    PlanStatus,
    utcnow,
)
from services.root.domain import embedded
from services.root.domain.suspicion import implicates_a_peer
from services.root.flows.machines import live_machine_at

ACTIVE_STATES = (JobState.RUNNING, JobState.RECOVERING)
# How long before a lost machine's last heartbeat a peer's crash still counts as its consequence (the
# heartbeat is periodic: the machine may have died up to one interval after it).
SYMPTOM_SLACK = timedelta(seconds=2)


async def record_exit(
    session: AsyncSession, job: Job, rank: int, request: schemas.ExitReport
) -> FailureEvent | None:
    """A training process ended. A clean exit is not a failure; anything else is a software failure (the
    agent reporting it is alive), or part of the recovery already open.

    `job` is read without a lock: a clean exit (or one after the job ended) writes nothing and locks
    nothing. A crash writes failure events and may declare a suspect lost, as the leader does: it takes
    the job row's lock first (every training process of a job can fail at once, in a collective: each
    exit's transaction reads the suspects, the open failures and the newest plan's status, not every
    machine or the plan's sources)."""
    machine = await live_machine_at(session, job, rank, request.instance_id)
    if request.exit_code == 0 or job.state not in ACTIVE_STATES:
        return None
    locked = await repo.lock_job(session, job.id)
    if locked is None or locked.state not in ACTIVE_STATES:
        return None  # the job ended (or was deleted) meanwhile
    job = locked
    # A peer whose heartbeats lapsed is what this process was waiting on in a collective: the second
    # signal that declares it lost. Its failure opens first, so this exit joins it as a consequence. One
    # exit explains one suspect, the longest silent (another suspect may merely be slow). An exit that
    # says nothing of its peers (its own ValueError, an OOM kill) leaves a slow suspect to the grace.
    error = request.error.model_dump() if request.error is not None else None
    suspects = (
        [m for m in await repo.suspect_machines(session, job.id) if m.id != machine.id]
        if implicates_a_peer(request.exit_code, error)
        else []
    )
    if suspects:
        suspect = min(suspects, key=lambda m: m.last_heartbeat_at or m.registered_at)
        await machine_lost(
            session,
            job,
            suspect,
            "stopped heartbeating, and its peers' training processes failed",
            details={"suspected_at": _iso(suspect.suspected_at), "silent": True},
        )
    now = utcnow()
    what = exit_cause(request.global_rank, request.exit_code, request.error)
    details: dict[str, Any] = {
        "exit_code": request.exit_code,
        "global_rank": request.global_rank,
        "local_rank": request.local_rank,
        "instance_id": request.instance_id,
        "machine_rank": rank,
    }
    if request.error is not None:
        details["error"] = error
    current: Sequence[FailureEvent] = await joinable_failures(session, job)
    if not current and request.generation is not None:
        current = await _failures_that_replaced(session, job, request.generation)
    if current:
        # Of several open failures (a recovery that failed and the one that followed it), the one this exit
        # would name the cause of, if any: a late exit belongs with the failure its collective opened.
        joined = next((e for e in current if _takes_cause(e, details)), current[0])
        join_exit(joined, machine, rank, what, details, now)
        return joined
    event = FailureEvent(
        job_id=job.id,
        machine_id=machine.id,
        rank=rank,
        kind=FailureKind.SOFTWARE,
        cause=what,
        detected_at=now,
        classified_at=now,
        details=details,
    )
    session.add(event)
    await session.flush()
    return event


async def _failures_that_replaced(session: AsyncSession, job: Job, generation: int) -> Sequence[FailureEvent]:
    """The failures of the newest plan when it replaced `generation` (an exit of an older generation's
    process reported late: its agent stopped it for that recovery, or saw it fail only then). The recovery
    already restarts every rank: the exit is part of it, not a failure of its own."""
    plan = await repo.latest_plan_head(session, job.id)
    if plan is None or plan.generation <= generation:
        return []
    return await repo.failures_of_plan(session, plan.id)


# The details an exit report writes on the failure it opens (record_exit); the rest (a replacement, the
# restore's tiers, a cascade) belong to the failure, whichever exit it names.
_EXIT_DETAILS = ("exit_code", "global_rank", "local_rank", "instance_id", "machine_rank", "error")


def join_exit(
    event: FailureEvent, machine: Machine, rank: int, cause: str, details: dict[str, Any], now: datetime
) -> None:
    """A process exit joins the open failure `event` as part of its cascade, with its own cause.

    Which exit reaches the root first is a race: a process that fails for a reason of its own (a corrupt
    checkpoint, a ValueError) takes its peers down in their next collective, and one of theirs (a gloo
    error) can arrive first and open the failure. An exit that says nothing of its peers
    (`implicates_a_peer`) is then the likelier cause: it becomes the failure's cause, and the peer's exit
    that opened it moves into the cascade. A machine's loss (a hardware failure) stays the cause."""
    entry = {"cause": cause, **details, "at": now.isoformat()}
    cascade = list(event.details.get("cascade", []))
    if not _takes_cause(event, details):
        event.details = {**event.details, "cascade": [*cascade, entry]}
        return
    opener = {k: event.details[k] for k in _EXIT_DETAILS if k in event.details}
    kept = {k: v for k, v in event.details.items() if k not in _EXIT_DETAILS and k != "cascade"}
    event.details = {
        **kept,
        **details,
        "cascade": [{"cause": event.cause, **opener, "at": event.detected_at.isoformat()}, *cascade],
    }
    event.cause, event.rank, event.machine_id = cause, rank, machine.id


def _takes_cause(event: FailureEvent, details: dict[str, Any]) -> bool:
    """Whether an exit with `details` becomes the cause of `event` when it joins it (see join_exit)."""
    return (
        event.kind == FailureKind.SOFTWARE
        and is_peer_symptom(event)
        and not implicates_a_peer(details["exit_code"], details.get("error"))
    )


async def machine_lost(
    session: AsyncSession,
    job: Job,
    machine: Machine,
    cause: str,
    *,
    details: dict[str, Any] | None = None,
) -> FailureEvent | None:
    """The machine is gone (agent, processes and memory): a hardware failure; it will be replaced.

    Training processes on other machines that crashed after this machine's last sign of life in a way that
    points at a peer (`is_peer_symptom`) were waiting on it in a collective: they are symptoms, not
    failures of their own. Their events fold into this one, whose detection time becomes the first
    symptom's (the failure was noticed then; it is classified now).
    """
    if machine.state in (MachineState.FAILED, MachineState.REPLACED) or job.state not in ACTIVE_STATES:
        return None
    now = utcnow()
    machine.state = MachineState.FAILED
    last_seen = machine.last_heartbeat_at or now
    symptoms = [
        e
        for e in await joinable_failures(session, job)
        if is_peer_symptom(e) and e.machine_id != machine.id and e.detected_at >= last_seen - SYMPTOM_SLACK
    ]
    # Read apart: the leader and the detector load machines without their summaries (a thousand of them).
    at_loss = await repo.session_progress(session, machine.id) if machine.embedded else None
    event = FailureEvent(
        job_id=job.id,
        machine_id=machine.id,
        rank=machine.rank,
        kind=FailureKind.HARDWARE,
        cause=f"machine {machine.rank} ({machine.instance_id}) {cause}",
        detected_at=min([now, *(e.detected_at for e in symptoms)]),
        classified_at=now,
        state=symptoms[0].state if symptoms else FailureState.DETECTED,
        plan_id=symptoms[0].plan_id if symptoms else None,
        details={
            "instance_id": machine.instance_id,
            "last_heartbeat_at": machine.last_heartbeat_at.isoformat() if machine.last_heartbeat_at else None,
            # Embedded mode: a machine back without a relaunch is over once its training committed again.
            **({embedded.COMMITTED_AT_LOSS: at_loss.committed} if at_loss is not None else {}),
            **(details or {}),
            "cascade": [{"cause": e.cause, "at": e.detected_at.isoformat(), **e.details} for e in symptoms],
        },
    )
    # The symptoms stop being failures of their own: what they counted in /metrics stays (retired).
    if symptoms:
        await repo.retire_failures(session, symptoms)
    for symptom in symptoms:
        await session.delete(symptom)
    session.add(event)
    await session.flush()
    return event


def is_peer_symptom(event: FailureEvent) -> bool:
    """A process's failure that may be its waiting on a dead peer (see suspicion.implicates_a_peer)."""
    details = event.details or {}
    return event.kind == FailureKind.SOFTWARE and implicates_a_peer(
        details.get("exit_code"), details.get("error")
    )


async def joinable_failures(session: AsyncSession, job: Job) -> list[FailureEvent]:
    """Open failures a new one may be part of: those not yet planned for, or whose recovery is still
    collecting. Once a plan is ready, ranks are restoring and restarting: a failure then is a new one,
    and the recovery it cuts short has failed (a new generation follows)."""
    plan = await repo.latest_plan_head(session, job.id)  # not its per-rank sources
    collecting = plan.id if plan is not None and plan.status == PlanStatus.COLLECTING else None
    return [
        e
        for e in await repo.open_failures(session, job.id)
        if e.state == FailureState.DETECTED or (collecting is not None and e.plan_id == collecting)
    ]


def reinstate(machine: Machine, why: str, loss: FailureEvent | None = None) -> None:
    """A suspect or failed machine's heartbeats resumed: it is healthy again. A failed one's loss (its
    newest open one declared for its silence, see latest_silent_losses: the caller has the job's open
    failures in hand) records the reinstatement and its replacement request is cancelled (a replacement
    already started that later registers finds the rank taken). The recovery it opened goes on: training
    stopped for it, and the reinstated machine reports what it holds like every survivor."""
    machine.state, machine.suspected_at = MachineState.HEALTHY, None
    if loss is None:
        return
    replacement = loss.details.get("replacement")
    loss.details = {
        **loss.details,
        "reinstated": {"at": utcnow().isoformat(), "why": why},
        **({"replacement": {**replacement, "status": "cancelled"}} if replacement else {}),
    }


# What a replacement's intent records just before the cloud call it names (domain.replacement.Intent; the
# local operator's started agent): once one is recorded the call may have happened.
_COMMITTING_CALLS = ("terminate_at", "exit_standby_at", "chosen")


def replacement_committed(loss: FailureEvent) -> bool:
    """Whether the loss's replacement has gone past the point of no return: the cloud was asked to terminate
    the machine's instance or to bring another into service, or one was launched. Such a machine is not
    reinstated when its heartbeats resume: it is being terminated, or another machine is about to take its
    rank (and would find it taken, the instance paid for and unused)."""
    request = loss.details.get("replacement") or {}
    intent = request.get("intent") or {}
    called = [call for call in _COMMITTING_CALLS if intent.get(call)]
    if intent.get("exit_standby_refused"):  # AWS refused that call: it changed nothing
        called = [call for call in called if call != "exit_standby_at"]
    return request.get("status") == "launched" or bool(called)


def latest_silent_losses(events: Sequence[FailureEvent]) -> dict[int, FailureEvent]:
    """Per machine id, its newest open loss declared for its silence and not reinstated yet: what a heartbeat
    must come after to reinstate it. (An older one, already reinstated, precedes the late heartbeat that
    reinstated it: measured against it, every later loss would be reinstated at once.) One pass over the
    events: the leader asks for every failed machine of a job each tick, and a scan of every open event per
    machine took a fifth of the root's CPU when hundreds of machines were failed at once."""
    newest: dict[int, FailureEvent] = {}
    for event in events:
        if (
            event.machine_id is not None
            and event.kind == FailureKind.HARDWARE
            and event.details.get("silent")
            and "reinstated" not in event.details
        ):
            known = newest.get(event.machine_id)
            if known is None or _classified(event) > _classified(known):
                newest[event.machine_id] = event
    return newest


def _classified(event: FailureEvent) -> Any:
    return event.classified_at or event.detected_at


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def exit_cause(global_rank: int, exit_code: int, error: schemas.ProcessError | None) -> str:
    """A failed process's one line (the pages' and the CLI's cause, within the column's 500 characters).

    The exception itself, not only the exit code, when the process left one (the whole traceback stays in
    the details). A process that raised and was then killed while exiting (its agent stopped it for a
    recovery that reached it first) failed for its exception, not for the signal: the exception leads. A
    hang's report is the agent's own words for the kill it made, and stays after it."""
    what = f"training process rank {global_rank} {describe_exit(exit_code)}"
    if error is None:
        return what
    if exit_code < 0 and error.type != schemas.HANG_ERROR_TYPE:
        what = f"training process rank {global_rank} failed ({describe_exit(exit_code)} while exiting)"
    return f"{what}: {error.message}"[:500]


def describe_exit(exit_code: int) -> str:
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def is_open(event: FailureEvent) -> bool:
    return event.state in (FailureState.DETECTED, FailureState.RECOVERING)
