"""Driving every open recovery forward: each pass runs `flows.recovery.advance` for every active job (one
transaction per job, its row locked) and executes the cloud actions it decided (machine replacements)
outside the transaction, recording each outcome on its failure event. The recovery's states and their
transitions are domain.recovery_states; a new leader picks a recovery up where the database says it is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from sqlalchemy import select

from services.root.clients import CloudOperator, CloudOperatorError, ReplacementCancelled, ReplacementJournal
from services.root.db import repository as repo
from services.root.db.models import FailureEvent, FailureState, JobState, Machine, MachineState
from services.root.domain import replacement
from services.root.domain.recovery_states import RecoveryState
from services.root.flows import recovery
from services.root.orchestration.leadership import Deposed, Leadership
from services.root.orchestration.per_job import PerJob
from services.root.settings import Settings
from services.root.tasks import stopped

log = logging.getLogger(__name__)

TICK_S = 0.2


class RecoveryDriver:
    def __init__(self, leadership: Leadership, per_job: PerJob, settings: Settings, operator: CloudOperator):
        self.leadership = leadership
        self.per_job = per_job
        self.settings = settings
        self.operator = operator
        self._replacing: set[int] = set()  # failure events whose replacement is under way here
        # The recovery state each job was left in by its last step here (domain.recovery_states), so the
        # next step checks the moves made in between against the protocol's table. A new leader starts
        # without: it never saw the steps before it.
        self.states: dict[uuid.UUID, RecoveryState] = {}
        self.upload_waits: dict[uuid.UUID, recovery.UploadWait] = {}  # plans waiting for uploads in flight
        self._tasks: set[asyncio.Task[Any]] = set()
        # Jobs owed a completion check (recovery.complete_if_finished): a step closed their recovery and the
        # check after its commit has not yet run through. A new leader owes it to every job: the one before
        # may have stopped between the two.
        self._owed: set[uuid.UUID] = set()

    async def drive(self) -> None:
        self.states.clear()
        self.upload_waits.clear()
        first = True
        try:
            while True:
                try:
                    async with self.leadership.session() as session:
                        job_ids = list(await repo.active_job_ids(session))
                    if first:
                        self._owed, first = set(job_ids), False
                    self._owed &= set(job_ids)
                    for gone in self.states.keys() - set(job_ids):  # finished, stopped or deleted jobs
                        del self.states[gone]
                    for gone in self.upload_waits.keys() - set(job_ids):
                        del self.upload_waits[gone]
                    await self.per_job.each(job_ids, self.step)
                except Deposed:
                    return
                except Exception:
                    log.exception("orchestration pass failed; retrying")
                await asyncio.sleep(TICK_S)
        finally:
            await self._stop_replacements()

    async def _stop_replacements(self) -> None:
        """The leadership ended (or the root stops): the replacements under way here stop too. Fencing
        refuses their next cloud call anyway, but one waiting for an instance to come up (up to
        CASTOR_REPLACEMENT_TIMEOUT_S) kept polling the group alongside the new leader's, which continues
        the request from its failure event."""
        await stopped(*self._tasks)

    async def step(self, job_id: Any) -> None:
        try:
            async with self.leadership.session() as session:
                job = await repo.get_job(session, job_id, for_update=True)
                if job is None:
                    return
                recovering = job.state == JobState.RECOVERING
                actions = await recovery.advance(
                    session,
                    job,
                    self.settings,
                    seen=self.states,
                    in_flight=frozenset(self._replacing),
                    upload_waits=self.upload_waits,
                )
                closed = recovering and job.state == JobState.RUNNING
        except BaseException:
            self.states.pop(job_id, None)  # the step's state may not have been committed
            raise
        if closed or job_id in self._owed:  # once committed (see recovery.complete_if_finished)
            self._owed.add(job_id)
            await self._complete_if_finished(job_id)
            self._owed.discard(job_id)
        for action in actions:
            if action.event_id not in self._replacing:
                self._replacing.add(action.event_id)
                task = asyncio.create_task(self._replace(action))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _complete_if_finished(self, job_id: uuid.UUID) -> None:
        async with self.leadership.session() as session:
            generation = await repo.latest_generation(session, job_id)
            if generation is not None:
                await recovery.complete_if_finished(session, job_id, generation)

    async def _replace(self, action: recovery.ReplaceMachine) -> None:
        """Carry out one replacement request, recording each cloud call's intent on its failure event
        before the call (`_EventJournal`), then the outcome. The event stays in `_replacing` until its
        outcome is recorded: a request in the database that is in no leader's `_replacing` is one nobody
        carries out, and the next step continues it."""
        try:
            async with self.leadership.session() as session:
                # The failed machine alone (one per job and instance), not every machine's row: a thousand
                # machines' summaries and inventories decoded per replacement starved a 1,000-machine root.
                failed = await repo.machine_by_instance(session, action.job.id, action.machine.instance_id)
                # Not to hand out: instances machines hold or held (of every job: the group may serve
                # several) and those other replacements chose or launched (recorded on their failure
                # events: a new leader knows them too).
                held = (await session.execute(select(Machine.instance_id))).scalars()
                open_events = select(FailureEvent.id, FailureEvent.details).where(
                    FailureEvent.state.in_((FailureState.DETECTED, FailureState.RECOVERING))
                )
                others = (await session.execute(open_events)).all()
                bound = set(held) | replacement.claimed(d for i, d in others if i != action.event_id)
            if failed is not None and failed.state != MachineState.FAILED:
                log.info("machine %d was reinstated: not replacing it", action.machine.rank)
                self._replacing.discard(action.event_id)
                return
            journal = _EventJournal(self.leadership, action.event_id, action.intent)
            done = await self.operator.replace(action.job, action.machine, bound, journal)
            outcome: dict[str, Any] = {"instance_id": done.instance_id, "detail": done.detail, "error": None}
            log.info("replacing machine %d: %s", action.machine.rank, done.detail)
        except (Deposed, ReplacementCancelled) as exc:
            if isinstance(exc, ReplacementCancelled):
                log.info("replacing machine %d stopped: %s", action.machine.rank, exc)
            self._replacing.discard(action.event_id)
            return
        except Exception as exc:  # recorded and retried after a pause, whatever it was
            expected = isinstance(exc, CloudOperatorError | OSError)
            log.error(
                "replacing machine %d failed: %s",
                action.machine.rank,
                exc,
                exc_info=None if expected else exc,
            )
            outcome = {"instance_id": None, "detail": "", "error": str(exc) or type(exc).__name__}
        except BaseException:  # cancelled (the root shuts down): the next leader continues the request
            self._replacing.discard(action.event_id)
            raise
        try:
            with contextlib.suppress(Deposed):  # the new leader reconciles from the event's intent
                async with self.leadership.session() as session:
                    await recovery.record_replacement(session, action.event_id, **outcome)
        finally:
            self._replacing.discard(action.event_id)


class _EventJournal(ReplacementJournal):
    """A replacement's journal on its failure event: each intent is committed (in a fenced transaction: a
    deposed leader's is refused, and it acts no further) before the cloud call it announces."""

    def __init__(self, leadership: Leadership, event_id: int, intent: dict[str, Any]):
        super().__init__(key=f"failure-{event_id}", intent=intent)
        self.leadership, self.event_id = leadership, event_id

    async def record(self, intent: dict[str, Any]) -> None:
        async with self.leadership.session() as session:
            await recovery.record_intent(session, self.event_id, intent)
        await super().record(intent)
