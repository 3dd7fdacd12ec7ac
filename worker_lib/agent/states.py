"""The worker agent's state machine: its states, their transition table, and `decide`.

The agent runs a monitor -> decide -> act loop in the shape of torch.distributed.elastic's `_invoke_run`
(`Agent._invoke_run` in agent.py): monitors turn what happens into facts (a new directive from the root, a
training process's exit, a rank's commit, a lost heartbeat lease, a signal, the outcome of an action);
`decide(status, fact)` is a pure function of the agent's status and the fact, returning the next status and
the actions to take; the agent performs them in order. Nothing here does I/O, so every decision is a unit
test away (tests/unit/worker_lib/test_agent_states.py).

The states, as the root's directives drive them (the README's Recovery section has the root's side):

    REGISTERING -> IDLE                       registered, warm spares started; nothing trains yet
    IDLE/...    -> COLLECTING                 a recovery (directive `collecting`, a new generation): stop
                                              training, pause replication, report the inventory (checked
                                              in the background until the plan comes)
    ...         -> RESTORING                  a plan (`ready`, a new generation): stop training, bring the
                                              plan's iteration into every local rank's store
    RESTORING   -> RESUMING | RESTORE_FAILED  started the processes from it (reported `restored`), or a
                                              source or the start failed (reported `restore_failed`)
    RESUMING    -> RUNNING                    every local rank committed past the restored iteration
                                              (reported `resumed`); the spares warm up for the next restart
    RESUMING/RUNNING -> FINISHED              every local process exited 0 (reported `finished`)
    any         -> STOPPING -> STOPPED        a signal (forwarded to the processes; the agent exits with
                                              their status); the job ended (`finished`), this machine was
                                              replaced, or the job deleted: STOPPED, and the agent exits
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any


class AgentState(enum.Enum):
    REGISTERING = "registering"  # killing stale processes, registering, prewarming spares
    IDLE = "idle"  # registered; no plan has started training here yet
    COLLECTING = "collecting"  # a recovery: training stopped, the inventory reported; waiting for the plan
    RESTORING = "restoring"  # a plan is ready: its iteration is coming into the local stores
    RESTORE_FAILED = "restore_failed"  # the plan's restore or start failed (reported); waiting for the next
    RESUMING = "resuming"  # the plan's processes run; not every local rank committed since the restore
    RUNNING = "running"  # training: every local rank committed since the restore
    FINISHED = "finished"  # every local process of this generation exited 0 (reported)
    STOPPING = "stopping"  # a signal: the processes have it, the agent exits once they did
    STOPPED = "stopped"  # terminal: the agent exits


S = AgentState
# Where each state may go. Staying in a state is always allowed (a fact that changes nothing). A recovery
# can begin from any state where training may run or has ended; a signal, the job's end, a replacement or
# the job's deletion can end the agent from any state once it is registered.
_ENDS = frozenset({S.STOPPING, S.STOPPED})
TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    S.REGISTERING: frozenset({S.IDLE}),
    S.IDLE: frozenset({S.COLLECTING, S.RESTORING}) | _ENDS,
    S.COLLECTING: frozenset({S.RESTORING}) | _ENDS,
    S.RESTORING: frozenset({S.RESUMING, S.RESTORE_FAILED}) | _ENDS,
    S.RESTORE_FAILED: frozenset({S.COLLECTING, S.RESTORING}) | _ENDS,
    S.RESUMING: frozenset({S.RUNNING, S.FINISHED, S.COLLECTING, S.RESTORING}) | _ENDS,
    S.RUNNING: frozenset({S.FINISHED, S.COLLECTING, S.RESTORING}) | _ENDS,
    S.FINISHED: frozenset({S.COLLECTING, S.RESTORING}) | _ENDS,
    S.STOPPING: frozenset({S.STOPPED}),
    S.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: AgentState, new: AgentState) -> AgentState:
    """`new`, when the table allows going there from `current`; raises IllegalTransition otherwise."""
    if new is not current and new not in TRANSITIONS[current]:
        raise IllegalTransition(f"the agent cannot go from {current.name} to {new.name}")
    return new


@dataclass(frozen=True)
class Resuming:
    """After a restore: the plan's generation and iteration, and the local ranks yet to commit past it."""

    generation: int
    iteration: int | None
    waiting: frozenset[int]


@dataclass(frozen=True)
class AgentStatus:
    state: AgentState = AgentState.REGISTERING
    local_ranks: frozenset[int] = frozenset()  # this machine's global ranks (known once registered)
    generation: int = 0  # the plan generation whose training runs here
    collected: int = 0  # the last recovery generation this machine reported its inventory for
    resuming: Resuming | None = None
    # Local ranks whose process of the running generation exited 0 (cleared when a new generation starts:
    # a rank that finished before a recovery runs again, and must finish again)
    clean: frozenset[int] = frozenset()


# -- facts (what the monitors saw) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    local_ranks: frozenset[int]


@dataclass(frozen=True)
class DirectiveSeen:
    """A new revision of the root's directive. `replaced_by`: the other instance the directive names for
    this machine's rank (it was declared failed and replaced), else None. `directive` is passed on to the
    actions that need the whole of it (the restore's sources, the launch's rendezvous)."""

    status: str  # pending | collecting | ready | finished
    generation: int
    iteration: int | None
    job_state: str
    replaced_by: str | None = None
    machines: Any = None
    directive: Any = None


@dataclass(frozen=True)
class JobDeleted:
    pass


@dataclass(frozen=True)
class HeartbeatReplaced:
    reason: str


@dataclass(frozen=True)
class Signalled:
    signum: int


@dataclass(frozen=True)
class ProcessExited:
    """A training process ended. `running`: the generation the agent ran when the exit was seen."""

    generation: int
    global_rank: int
    exit_code: int
    expected: bool
    running: int
    exit: Any = None  # the launcher's ProcessExit, for the report


@dataclass(frozen=True)
class Committed:
    rank: int
    iteration: int


@dataclass(frozen=True)
class Hung:
    """The hang watchdog (watchdog.py) found a local rank of `generation` silent past its limit."""

    generation: int
    rank: int
    reason: str


# Outcomes of the agent's own actions, decided on at once (before any other fact).
@dataclass(frozen=True)
class RestoreDone:
    generation: int
    iteration: int | None  # the plan's iteration (None: from scratch)
    details: dict[str, Any]  # rank -> tier, seconds, source; or {"from_scratch": True}
    directive: Any = None  # the plan's directive, for the launch


@dataclass(frozen=True)
class RestoreFailed:
    generation: int
    error: str
    details: dict[str, Any] = field(default_factory=dict)  # reported with the error (unusable_persisted)


@dataclass(frozen=True)
class StartDone:
    generation: int
    restored: dict[str, Any]


@dataclass(frozen=True)
class StartFailed:
    generation: int
    error: str


Fact = (
    Registered
    | DirectiveSeen
    | JobDeleted
    | HeartbeatReplaced
    | Signalled
    | ProcessExited
    | Committed
    | Hung
    | RestoreDone
    | RestoreFailed
    | StartDone
    | StartFailed
)


# -- actions (what the agent does) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Exit:
    """Stop the agent with this exit code (STOPPED). `job_over`: nothing will restore from this memory."""

    code: int
    reason: str
    job_over: bool = False


@dataclass(frozen=True)
class UpdateAddresses:
    machines: Any


@dataclass(frozen=True)
class StopWorkers:
    pass


@dataclass(frozen=True)
class PauseReplication:
    pass


@dataclass(frozen=True)
class ResumeReplication:
    """Replication goes on after a restore of `iteration` (None: from scratch, or no restore) as the plan's
    `directive` named it (its per-rank digests)."""

    iteration: int | None = None
    directive: Any = None


@dataclass(frozen=True)
class ReportInventory:
    generation: int


@dataclass(frozen=True)
class Restore:
    """Bring the plan's iteration into each local rank's store; the outcome is RestoreDone/RestoreFailed."""

    generation: int
    iteration: int | None
    directive: Any


@dataclass(frozen=True)
class StartWorkers:
    """Start the plan's processes; the outcome is StartDone/StartFailed."""

    generation: int
    directive: Any
    restored: dict[str, Any]


@dataclass(frozen=True)
class ReportProgress:
    generation: int
    event: str  # restored | resumed | restore_failed
    details: dict[str, Any] = field(default_factory=dict)
    background: bool = False  # not awaited: the loop goes on deciding


@dataclass(frozen=True)
class StopHung:
    """Ask the hung process for its stacks, then kill it (in the background); its exit is reported as a
    failure, with the reason, and the root recovers."""

    rank: int
    reason: str


@dataclass(frozen=True)
class ReportExit:
    """Report a process's exit to the root (in the background)."""

    exit: Any
    global_rank: int
    exit_code: int


@dataclass(frozen=True)
class ReportFinished:
    """Every local process exited 0: flush replication, then tell the root (in the background)."""

    generation: int


@dataclass(frozen=True)
class Prewarm:
    """Warm spare interpreters up for the next restart (in the background)."""


@dataclass(frozen=True)
class ForwardSignal:
    signum: int


@dataclass(frozen=True)
class ExitAfterWorkers:
    """Wait for the processes (killing them after the grace period), then exit with their status."""


Action = (
    Exit
    | UpdateAddresses
    | StopWorkers
    | PauseReplication
    | ResumeReplication
    | ReportInventory
    | Restore
    | StartWorkers
    | ReportProgress
    | StopHung
    | ReportExit
    | ReportFinished
    | Prewarm
    | ForwardSignal
    | ExitAfterWorkers
)


@dataclass(frozen=True)
class Decision:
    status: AgentStatus
    actions: tuple[Action, ...] = ()


def decide(status: AgentStatus, fact: Fact) -> Decision:
    """The agent's next status and actions. Pure: the same status and fact always give the same decision.
    Raises IllegalTransition when the result would break the transition table."""
    decision = _decide(status, fact)
    check_transition(status.state, decision.status.state)
    return decision


def _to(status: AgentStatus, state: AgentState, **changes: Any) -> AgentStatus:
    return replace(status, state=state, **changes)


def _decide(status: AgentStatus, fact: Fact) -> Decision:
    if status.state is S.STOPPED:
        return Decision(status)  # the agent is on its way out: nothing more to do
    match fact:
        case Registered(local_ranks=ranks):
            return Decision(_to(status, S.IDLE, local_ranks=ranks))
        case JobDeleted():
            return Decision(_to(status, S.STOPPED), (Exit(1, "the job was deleted"),))
        case HeartbeatReplaced(reason=reason):
            return Decision(_to(status, S.STOPPED), (Exit(1, f"this machine was replaced ({reason})"),))
        case Signalled(signum=signum):
            return Decision(_to(status, S.STOPPING), (ForwardSignal(signum), ExitAfterWorkers()))
        case DirectiveSeen():
            return _on_directive(status, fact)
        case ProcessExited():
            return _on_exit(status, fact)
        case Committed(rank=rank, iteration=iteration):
            return _on_commit(status, rank, iteration)
        case Hung():
            return _on_hang(status, fact)
        case RestoreDone() | RestoreFailed() | StartDone() | StartFailed():
            return _on_outcome(status, fact)
    raise TypeError(f"not a fact: {fact!r}")


def _on_directive(status: AgentStatus, fact: DirectiveSeen) -> Decision:
    if fact.replaced_by is not None:
        # Declared failed and replaced (a false alarm, or etcd unreachable from here for a while): training
        # on as this rank would collide with the machine that holds it now.
        return Decision(
            _to(status, S.STOPPED),
            (Exit(1, f"the rank is now {fact.replaced_by}: this machine was replaced"),),
        )
    addresses = UpdateAddresses(fact.machines)
    if fact.status == "finished":
        return Decision(
            _to(status, S.STOPPED),
            (
                addresses,
                StopWorkers(),
                Exit(
                    0 if fact.job_state == "completed" else 1,
                    f"the job is {fact.job_state}",
                    job_over=fact.job_state in ("completed", "stopped"),
                ),
            ),
        )
    if status.state is S.STOPPING:
        # A signal stops this agent: no training starts again here (the processes have the signal).
        return Decision(status, (addresses,))
    if fact.status == "collecting" and fact.generation != status.collected:
        # A recovery: stop training (the survivors too: every rank rolls back together), then say what
        # this machine holds, every checksum verified. No replication round while the plan is built from
        # these inventories (it resumes with the plan's processes).
        return Decision(
            _to(status, S.COLLECTING, collected=fact.generation, resuming=None),
            (addresses, PauseReplication(), StopWorkers(), ReportInventory(fact.generation)),
        )
    if fact.status == "ready" and fact.generation != status.generation:
        return Decision(
            _to(status, S.RESTORING),
            (addresses, StopWorkers(), Restore(fact.generation, fact.iteration, fact.directive)),
        )
    return Decision(status, (addresses,))  # pending, or a generation already acted on


def _on_exit(status: AgentStatus, fact: ProcessExited) -> Decision:
    if fact.expected or fact.generation != fact.running:
        return Decision(status)  # the agent stopped it, or it belonged to a generation before this one
    actions: list[Action] = [ReportExit(fact.exit, fact.global_rank, fact.exit_code)]
    if fact.exit_code == 0:
        status = replace(status, clean=status.clean | {fact.global_rank})
        # Not after a signal to the agent (a preemption): a training script that exits 0 on the SIGTERM
        # passed on to it has not finished, and every agent stopped so would mark the job completed.
        if status.clean >= status.local_ranks and status.state is not S.STOPPING:
            actions.append(ReportFinished(fact.generation))
            if status.state in (S.RESUMING, S.RUNNING):
                status = _to(status, S.FINISHED)
    return Decision(status, tuple(actions))


def _on_hang(status: AgentStatus, fact: Hung) -> Decision:
    """A rank of the training that runs here stopped committing: stop it, so its exit starts a recovery.
    Not once a recovery, a signal or the end has taken over (the processes are being stopped anyway), nor
    for a rank that already exited cleanly."""
    training = status.state in (S.RESUMING, S.RUNNING)
    if not training or fact.generation != status.generation or fact.rank in status.clean:
        return Decision(status)
    if fact.rank not in status.local_ranks:
        return Decision(status)
    return Decision(status, (StopHung(fact.rank, fact.reason),))


def _on_commit(status: AgentStatus, rank: int, iteration: int) -> Decision:
    """The first iteration after a restore completed on every local rank: training resumed."""
    resuming = status.resuming
    if resuming is None:
        return Decision(status)
    waiting = resuming.waiting
    if resuming.iteration is None or iteration > resuming.iteration:
        waiting = waiting - {rank}
    if waiting:
        return Decision(replace(status, resuming=replace(resuming, waiting=waiting)))
    state = S.RUNNING if status.state is S.RESUMING else status.state
    return Decision(
        _to(status, state, resuming=None),
        # Training runs again: now warm up the spares for the next restart.
        (
            ReportProgress(resuming.generation, "resumed", {"iteration": iteration}, background=True),
            Prewarm(),
        ),
    )


def _on_outcome(status: AgentStatus, fact: RestoreDone | RestoreFailed | StartDone | StartFailed) -> Decision:
    """The outcome of a plan's restore or start (RESTORING). A signal that came meanwhile (STOPPING) lets no
    training start; failures are still reported."""
    failed = S.RESTORE_FAILED if status.state is S.RESTORING else status.state
    match fact:
        case RestoreDone(generation=generation, iteration=iteration, details=details, directive=directive):
            if status.state is S.STOPPING:
                return Decision(status)
            # The processes start as this generation; their commits count towards `resumed`.
            resuming = Resuming(generation, iteration, status.local_ranks)
            return Decision(
                replace(status, generation=generation, resuming=resuming, clean=frozenset()),
                (ResumeReplication(iteration, directive), StartWorkers(generation, directive, details)),
            )
        case RestoreFailed(generation=generation, error=error, details=details):
            report = {"error": error[:1000], **details}
            return Decision(_to(status, failed), (ReportProgress(generation, "restore_failed", report),))
        case StartDone(generation=generation, restored=restored):
            resumed = S.RESUMING if status.state is S.RESTORING else status.state
            return Decision(_to(status, resumed), (ReportProgress(generation, "restored", restored),))
        case StartFailed(generation=generation, error=error):
            error = f"cannot start training: {error}"
            return Decision(
                _to(status, failed),
                (ReportProgress(generation, "restore_failed", {"error": error[:1000]}),),
            )
