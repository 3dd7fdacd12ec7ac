"""The worker agent's state machine (worker_lib/agent/states.py): the transition table and `decide`."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from worker_lib.agent.states import (
    TRANSITIONS,
    AgentState,
    AgentStatus,
    Committed,
    DirectiveSeen,
    Exit,
    ExitAfterWorkers,
    Fact,
    ForwardSignal,
    HeartbeatReplaced,
    Hung,
    IllegalTransition,
    JobDeleted,
    PauseReplication,
    Prewarm,
    ProcessExited,
    Registered,
    ReportExit,
    ReportFinished,
    ReportInventory,
    ReportProgress,
    Restore,
    RestoreDone,
    RestoreFailed,
    ResumeReplication,
    Resuming,
    Signalled,
    StartDone,
    StartFailed,
    StartWorkers,
    StopHung,
    StopWorkers,
    UpdateAddresses,
    check_transition,
    decide,
)

S = AgentState
RANKS = frozenset({2, 3})  # machine 1 of a job with 2 processes per machine
MACHINES = [{"rank": 1, "instance_id": "me"}]


def directive(
    status: str, generation: int, iteration: int | None = 7, job_state: str = "running"
) -> DirectiveSeen:
    raw = {"status": status, "generation": generation, "iteration": iteration}
    return DirectiveSeen(status, generation, iteration, job_state, machines=MACHINES, directive=raw)


def step(status: AgentStatus, fact: Fact) -> tuple[AgentStatus, tuple[Any, ...]]:
    decision = decide(status, fact)
    return decision.status, decision.actions


def registered() -> AgentStatus:
    status, actions = step(AgentStatus(), Registered(RANKS))
    assert status.state is S.IDLE and status.local_ranks == RANKS and actions == ()
    return status


def running(generation: int = 1, iteration: int | None = 7) -> AgentStatus:
    return AgentStatus(S.RUNNING, RANKS, generation=generation, collected=generation)


def exited(
    rank: int, code: int, generation: int = 1, *, running: int = 1, expected: bool = False
) -> ProcessExited:
    return ProcessExited(generation, rank, code, expected, running, exit=f"exit-{rank}")


# -- the transition table ----------------------------------------------------------------------------------


def test_every_state_is_reachable_from_registering_and_stopped_is_the_only_end() -> None:
    assert set(TRANSITIONS) == set(AgentState)
    seen, frontier = {S.REGISTERING}, [S.REGISTERING]
    while frontier:
        for nxt in TRANSITIONS[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(AgentState)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    assert TRANSITIONS[S.STOPPING] == {S.STOPPED}
    # Once registered, the agent can always stop: a replacement, the job's end or deletion.
    assert all(
        S.STOPPED in TRANSITIONS[state] for state in AgentState if state not in (S.REGISTERING, S.STOPPED)
    )


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (S.IDLE, S.RUNNING),  # training runs only after a restore
        (S.COLLECTING, S.RESUMING),  # a plan is restored before its processes start
        (S.STOPPING, S.RESTORING),  # nothing starts again once a signal stops the agent
        (S.STOPPED, S.IDLE),
        (S.REGISTERING, S.RESTORING),
    ],
)
def test_check_transition_refuses_what_the_table_does_not_allow(current: AgentState, new: AgentState) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(current, new)
    assert check_transition(current, current) is current  # staying is always allowed


def sample_facts() -> list[Fact]:
    return [
        Registered(RANKS),
        directive("pending", 0),
        directive("collecting", 2),
        directive("ready", 2),
        directive("finished", 2, job_state="completed"),
        replace(directive("ready", 2), replaced_by="other"),
        JobDeleted(),
        HeartbeatReplaced("lease lost"),
        Signalled(15),
        exited(2, 0),
        exited(3, 1),
        Committed(2, 9),
        Hung(1, 2, "rank 2 is silent"),
        RestoreDone(2, 7, {}),
        RestoreFailed(2, "gone"),
        StartDone(2, {}),
        StartFailed(2, "no such file"),
    ]


@pytest.mark.parametrize("state", list(AgentState))
def test_decide_never_leaves_the_table_from_a_state_it_can_be_in(state: AgentState) -> None:
    """Every fact a registered agent can see, in every state: the decision's state is one the table allows
    (decide raises IllegalTransition otherwise)."""
    resuming = Resuming(1, 7, RANKS)
    for fact, resumes in itertools.product(sample_facts(), (None, resuming)):
        if state is S.REGISTERING and not isinstance(fact, Registered):
            continue  # the loops start once registered
        if isinstance(fact, RestoreDone | RestoreFailed | StartDone | StartFailed) and state not in (
            S.RESTORING,
            S.STOPPING,
            S.STOPPED,
        ):
            continue  # outcomes of a restore are decided on at once, while RESTORING (or a signal came)
        if isinstance(fact, Registered) and state is not S.REGISTERING:
            continue
        if state is S.RESTORING and isinstance(fact, DirectiveSeen | ProcessExited | Committed):
            if isinstance(fact, DirectiveSeen) and fact.replaced_by is not None:
                pass  # decided at once, like a signal
            else:
                continue  # queued facts wait until the restore's outcome moved the agent on
        status = AgentStatus(state, RANKS, generation=1, collected=1, resuming=resumes)
        new = decide(status, fact).status.state
        assert new is state or new in TRANSITIONS[state], (state, fact)


# -- decide: a recovery, as the root's directives drive it -------------------------------------------------


def test_a_plan_is_restored_started_and_resumed_once_every_local_rank_committed_past_it() -> None:
    status, actions = step(registered(), directive("ready", 1))
    assert status.state is S.RESTORING and status.generation == 0
    assert actions == (
        UpdateAddresses(MACHINES),
        StopWorkers(),
        Restore(1, 7, directive("ready", 1).directive),
    )

    status, actions = step(status, RestoreDone(1, 7, {"2": {"tier": "local"}}, "the directive"))
    assert status.state is S.RESTORING and status.generation == 1
    assert status.resuming == Resuming(1, 7, RANKS)
    assert actions == (
        ResumeReplication(7, "the directive"),
        StartWorkers(1, "the directive", {"2": {"tier": "local"}}),
    )

    status, actions = step(status, StartDone(1, {"2": {"tier": "local"}}))
    assert status.state is S.RESUMING
    assert actions == (ReportProgress(1, "restored", {"2": {"tier": "local"}}),)

    # A commit of the restored iteration itself is no progress; past it, one rank of two.
    status, actions = step(status, Committed(2, 7))
    status, actions = step(status, Committed(2, 8))
    assert status.state is S.RESUMING and actions == ()
    assert status.resuming is not None and status.resuming.waiting == {3}

    status, actions = step(status, Committed(3, 8))
    assert status.state is S.RUNNING and status.resuming is None
    assert actions == (ReportProgress(1, "resumed", {"iteration": 8}, background=True), Prewarm())

    # Later commits are ordinary training.
    assert step(status, Committed(2, 9)) == (status, ())


def test_from_scratch_every_commit_counts_as_resumed() -> None:
    status = replace(running(), state=S.RESUMING, resuming=Resuming(1, None, RANKS))
    status, _ = step(status, Committed(2, 0))
    status, actions = step(status, Committed(3, 0))
    assert status.state is S.RUNNING and actions[0] == ReportProgress(
        1, "resumed", {"iteration": 0}, background=True
    )


def test_a_recovery_stops_training_pauses_replication_and_reports_the_inventory_once_per_generation() -> None:
    status = replace(running(), state=S.RESUMING, resuming=Resuming(1, 7, RANKS))
    status, actions = step(status, directive("collecting", 2))
    assert status.state is S.COLLECTING and status.collected == 2 and status.resuming is None
    assert actions == (UpdateAddresses(MACHINES), PauseReplication(), StopWorkers(), ReportInventory(2))
    # A new revision of the same recovery (e.g. a machine's address changed): only the addresses.
    assert step(status, directive("collecting", 2)) == (status, (UpdateAddresses(MACHINES),))
    # Its plan: the processes stop (already stopped) and the plan's iteration comes in.
    status, actions = step(status, directive("ready", 2))
    assert status.state is S.RESTORING and Restore(2, 7, directive("ready", 2).directive) in actions


def test_a_failed_restore_is_reported_and_the_same_generation_can_be_tried_again() -> None:
    status, _ = step(registered(), directive("ready", 1))
    status, actions = step(status, RestoreFailed(1, "x" * 5000))
    assert status.state is S.RESTORE_FAILED and status.generation == 0
    assert actions == (ReportProgress(1, "restore_failed", {"error": "x" * 1000}),)
    status, actions = step(status, directive("ready", 1))
    assert status.state is S.RESTORING and isinstance(actions[-1], Restore)


def test_a_failed_restore_reports_the_persisted_shards_it_could_not_use() -> None:
    status, _ = step(registered(), directive("ready", 1))
    unusable = [{"rank": 0, "iteration": 40, "digest": "ab" * 8, "problem": "stripe 2: checksum"}]
    status, actions = step(status, RestoreFailed(1, "corrupt", {"unusable_persisted": unusable}))
    assert actions == (
        ReportProgress(1, "restore_failed", {"error": "corrupt", "unusable_persisted": unusable}),
    )


def test_a_failed_start_is_reported_as_a_failed_restore_of_that_generation() -> None:
    status, _ = step(registered(), directive("ready", 1))
    status, _ = step(status, RestoreDone(1, None, {"from_scratch": True}))
    status, actions = step(status, StartFailed(1, "[Errno 2] No such file or directory: 'trian.py'"))
    assert status.state is S.RESTORE_FAILED and status.generation == 1
    assert actions == (
        ReportProgress(
            1,
            "restore_failed",
            {"error": "cannot start training: [Errno 2] No such file or directory: 'trian.py'"},
        ),
    )
    # The same plan is not started again; the next recovery is.
    assert step(status, directive("ready", 1))[0].state is S.RESTORE_FAILED
    assert step(status, directive("collecting", 2))[0].state is S.COLLECTING


# -- decide: process exits ---------------------------------------------------------------------------------


def test_exits_the_agent_caused_or_of_an_older_generation_are_not_reported() -> None:
    status = running(generation=2)
    assert step(status, exited(2, -9, generation=2, running=2, expected=True)) == (status, ())
    assert step(status, exited(2, 1, generation=1, running=2)) == (status, ())
    # As the exit was seen: a crash of generation 1 seen while generation 1 ran is reported.
    assert step(status, exited(2, 1, generation=1, running=1))[1] == (ReportExit("exit-2", 2, 1),)


def test_a_crash_is_reported_and_training_finishes_once_every_local_process_exited_cleanly() -> None:
    status = running()
    status, actions = step(status, exited(3, 1))
    assert status.state is S.RUNNING and actions == (ReportExit("exit-3", 3, 1),)
    status, actions = step(status, exited(2, 0))
    assert status.state is S.RUNNING and actions == (ReportExit("exit-2", 2, 0),)
    status, actions = step(status, exited(3, 0))
    assert status.state is S.FINISHED
    assert actions == (ReportExit("exit-3", 3, 0), ReportFinished(1))


def test_a_clean_exit_after_a_forwarded_signal_does_not_finish_the_job() -> None:
    """A training script that exits 0 on the SIGTERM passed on to it (a preemption handler) has not
    finished: before, every agent stopped so reported "finished" and the job was marked completed."""
    status, _ = step(running(), Signalled(15))
    status, actions = step(status, exited(2, 0))
    status, actions = step(status, exited(3, 0))
    assert status.state is S.STOPPING and actions == (ReportExit("exit-3", 3, 0),)


def test_a_rank_that_finished_before_a_recovery_must_finish_again() -> None:
    """Rank 2 exited 0 in generation 1 while rank 3 crashed; both run again in generation 2. Before, the
    first clean exit of generation 2 reported "finished" while the other rank of generation 2 still ran."""
    status = running()
    status, _ = step(status, exited(2, 0))
    status, _ = step(status, exited(3, 1))
    status, _ = step(status, directive("collecting", 2))
    status, _ = step(status, directive("ready", 2))
    status, _ = step(status, RestoreDone(2, 7, {}))
    status, _ = step(status, StartDone(2, {}))
    status, actions = step(status, exited(3, 0, generation=2, running=2))
    assert ReportFinished(2) not in actions and status.state is not S.FINISHED
    status, actions = step(status, exited(2, 0, generation=2, running=2))
    assert actions[-1] == ReportFinished(2)


# -- decide: the agent's end -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_state", "code", "job_over"), [("completed", 0, True), ("stopped", 1, True), ("failed", 1, False)]
)
def test_the_jobs_end_stops_the_processes_then_the_agent(job_state: str, code: int, job_over: bool) -> None:
    status, actions = step(running(), directive("finished", 1, job_state=job_state))
    assert status.state is S.STOPPED
    assert actions == (
        UpdateAddresses(MACHINES),
        StopWorkers(),
        Exit(code, f"the job is {job_state}", job_over),
    )
    # Nothing after that.
    assert step(status, directive("ready", 5)) == (status, ())


@pytest.mark.parametrize(
    "fact",
    [replace(directive("ready", 2), replaced_by="i-new"), HeartbeatReplaced("lease lost"), JobDeleted()],
)
def test_a_replaced_machine_or_a_deleted_job_stops_the_agent_without_touching_anything(fact: Fact) -> None:
    status, actions = step(running(), fact)
    assert status.state is S.STOPPED
    assert (
        len(actions) == 1
        and isinstance(actions[0], Exit)
        and actions[0].code == 1
        and not actions[0].job_over
    )


def test_a_signal_is_forwarded_and_no_training_starts_again_while_the_agent_stops() -> None:
    status, actions = step(running(), Signalled(15))
    assert status.state is S.STOPPING and actions == (ForwardSignal(15), ExitAfterWorkers())
    assert step(status, directive("ready", 2)) == (status, (UpdateAddresses(MACHINES),))
    assert step(status, directive("collecting", 2)) == (status, (UpdateAddresses(MACHINES),))
    # A restore that was under way when the signal came starts nothing; its failure is still reported.
    assert step(status, RestoreDone(2, 7, {})) == (status, ())
    assert step(status, RestoreFailed(2, "gone"))[0].state is S.STOPPING
    # The job's end still decides the exit code.
    assert step(status, directive("finished", 1, job_state="completed"))[0].state is S.STOPPED


# -- decide: the hang watchdog -----------------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.RUNNING, S.RESUMING])
def test_a_hung_rank_of_the_running_generation_is_stopped(state: AgentState) -> None:
    status = replace(running(generation=3), state=state)
    assert step(status, Hung(3, 2, "rank 2 is silent")) == (status, (StopHung(2, "rank 2 is silent"),))


@pytest.mark.parametrize(
    ("status", "fact"),
    [
        (running(generation=3), Hung(2, 2, "an older generation's rank")),
        (replace(running(generation=3), state=S.COLLECTING), Hung(3, 2, "a recovery stops it anyway")),
        (replace(running(generation=3), state=S.STOPPING), Hung(3, 2, "a signal stops it anyway")),
        (replace(running(generation=3), clean=frozenset({2})), Hung(3, 2, "it already exited cleanly")),
        (running(generation=3), Hung(3, 7, "not a rank of this machine")),
    ],
)
def test_a_hang_is_not_acted_on_once_nothing_trains_as_that_rank(status: AgentStatus, fact: Hung) -> None:
    assert step(status, fact) == (status, ())
