"""The replacement's next cloud call, decided from its recorded intent and the group's actual state
(domain.replacement.decide): never a second termination, never a second Standby instance or launch, an
instance the group already launched adopted; and, replayed against a simulated group with the try cut short
at every point (before or after each call), one replacement whoever continues it."""

from __future__ import annotations

import itertools

import pytest

from services.root.domain.replacement import (
    Action,
    AwaitNew,
    Done,
    ExitStandby,
    Intent,
    Member,
    Terminate,
    claimed,
    decide,
    group_state,
    instance_alive,
)

OLD, SPARE, PEER, NEW = "i-old", "i-spare", "i-peer", "i-new"
AT = "2026-11-26T23:00:00+00:00"
IN_SERVICE, STANDBY = Member("InService"), Member("Standby")


def group(**states: str) -> dict[str, Member]:
    """The group: PEER in service (a machine of the job) plus `states` by instance name."""
    names = {"old": OLD, "spare": SPARE, "new": NEW, "new2": "i-new2"}
    members = {PEER: IN_SERVICE}
    for name, state in states.items():
        lifecycle, _, health = state.partition("/")
        members[names[name]] = Member(lifecycle, health != "Unhealthy")
    return members


NOTHING = Intent(OLD)
STANDBY_CHOSEN = Intent(OLD, standby=SPARE, exit_standby_at=AT)
TERMINATED = Intent(OLD, terminate_at=AT)
REFUSED = STANDBY_CHOSEN.standby_refused(
    "ValidationError: New SetDesiredCapacity value 3 is above max value 2"
)
TAKEN = frozenset({PEER, OLD})


@pytest.mark.parametrize(
    ("intent", "members", "taken", "expected"),
    [
        # Nothing recorded yet: a Standby instance first, else terminate the failed one (the group launches).
        (NOTHING, group(old="InService", spare="Standby"), TAKEN, ExitStandby(SPARE)),
        (NOTHING, group(old="InService"), TAKEN, Terminate(OLD, decrement=False)),
        (NOTHING, group(old="InService/Unhealthy"), TAKEN, Terminate(OLD, decrement=False)),
        # A Standby instance another replacement chose is not handed out again.
        (NOTHING, group(old="InService", spare="Standby"), TAKEN | {SPARE}, Terminate(OLD, decrement=False)),
        # The group replaced the unhealthy instance itself: its new instance is adopted, nothing terminated.
        (NOTHING, group(old="Terminating", new="InService"), TAKEN, Done(NEW, standby=False)),
        (NOTHING, group(new="InService"), TAKEN, Done(NEW, standby=False)),
        # The chosen Standby instance: moved again only while the group still shows it in Standby.
        (STANDBY_CHOSEN, group(old="InService", spare="Standby"), TAKEN, ExitStandby(SPARE)),
        (STANDBY_CHOSEN, group(old="InService", spare="InService"), TAKEN, Terminate(OLD, decrement=True)),
        (STANDBY_CHOSEN, group(old="InService", spare="Pending"), TAKEN, Terminate(OLD, decrement=True)),
        (STANDBY_CHOSEN, group(old="Terminating", spare="InService"), TAKEN, Done(SPARE, standby=True)),
        (STANDBY_CHOSEN, group(spare="InService"), TAKEN, Done(SPARE, standby=True)),
        # ... and it left the group meanwhile: decided again (the failed instance terminated, a launch).
        (STANDBY_CHOSEN, group(old="InService"), TAKEN, Terminate(OLD, decrement=False)),
        # A termination requested (the launch of a new instance): never a Standby instance after it, never
        # another termination once the group shows it; the new instance adopted or waited for.
        (TERMINATED, group(new="InService", spare="Standby"), TAKEN, Done(NEW, standby=False)),
        (TERMINATED, group(old="Terminating:Wait", spare="Standby"), TAKEN, AwaitNew(TAKEN)),
        (TERMINATED, group(old="Terminating"), TAKEN, AwaitNew(TAKEN)),
        (TERMINATED, group(new="Pending"), TAKEN, AwaitNew(TAKEN)),
        (TERMINATED, group(new="InService/Unhealthy"), TAKEN, AwaitNew(TAKEN)),
        (TERMINATED, group(new="InService"), TAKEN | {NEW}, AwaitNew(TAKEN | {NEW})),
        # The request was recorded but the call never reached AWS: the same instance, never another.
        (TERMINATED, group(old="InService", spare="Standby"), TAKEN, Terminate(OLD, decrement=False)),
        # AWS refused to move the chosen Standby instance into service (the group's MaxSize, no IAM
        # permission): no Standby instance again, not even another one; the failed instance is terminated
        # without a decrement (the group launches), or the group's launch adopted or waited for.
        (REFUSED, group(old="InService", spare="Standby"), TAKEN, Terminate(OLD, decrement=False)),
        (
            REFUSED,
            group(old="InService", spare="Standby", new2="Standby"),
            TAKEN,
            Terminate(OLD, decrement=False),
        ),
        (REFUSED.terminating(AT), group(old="Terminating", spare="Standby"), TAKEN, AwaitNew(TAKEN)),
        (REFUSED.terminating(AT), group(spare="Standby", new="InService"), TAKEN, Done(NEW, standby=False)),
        # ... unless the group shows it in service after all (an earlier attempt of the call landed).
        (REFUSED, group(old="InService", spare="InService"), TAKEN, Terminate(OLD, decrement=True)),
        # The group is replacing the failed instance itself (its own health check terminates it, Castor
        # requested no termination): its launch takes the rank, no Standby instance is moved into service
        # (the group would stay one instance over its desired capacity).
        (NOTHING, group(old="Terminating/Unhealthy", spare="Standby", new="Pending"), TAKEN, AwaitNew(TAKEN)),
        (NOTHING, group(old="Terminating:Wait", spare="Standby"), TAKEN, AwaitNew(TAKEN)),
        (NOTHING, group(old="Terminated", spare="Standby", new="InService"), TAKEN, Done(NEW, standby=False)),
        (STANDBY_CHOSEN, group(old="Terminating", spare="Standby"), TAKEN, AwaitNew(TAKEN)),
        # ... or it is gone from the group already (nothing terminated it for Castor): the same.
        (NOTHING, group(spare="Standby"), TAKEN, AwaitNew(TAKEN)),
        (NOTHING, group(spare="Standby", new="InService"), TAKEN, Done(NEW, standby=False)),
    ],
)
def test_decide(intent: Intent, members: dict[str, Member], taken: frozenset[str], expected: Action) -> None:
    assert decide(intent, members, taken) == expected


def test_without_standby_use_the_failed_instance_is_terminated() -> None:
    members = group(old="InService", spare="Standby")
    assert decide(NOTHING, members, TAKEN, use_standby=False) == Terminate(OLD, decrement=False)


def test_the_intent_round_trips_through_the_event_details() -> None:
    intent = Intent(OLD, standby=SPARE, exit_standby_at=AT, terminate_at=AT)
    assert Intent.from_json(intent.to_json(), replacing="other") == intent
    assert Intent.from_json(REFUSED.to_json(), replacing="other") == REFUSED
    assert REFUSED.to_json()["exit_standby_refused"].startswith("ValidationError")
    assert Intent.from_json(None, replacing=OLD) == NOTHING
    assert Intent(OLD).to_json() == {"replacing": OLD}


def test_group_state_reads_describe_auto_scaling_groups() -> None:
    described = [
        {"InstanceId": OLD, "LifecycleState": "InService", "HealthStatus": "Unhealthy"},
        {"InstanceId": SPARE, "LifecycleState": "Standby", "HealthStatus": "Healthy"},
    ]
    assert group_state(described) == {OLD: Member("InService", False), SPARE: STANDBY}


def test_claimed_instances_are_those_other_replacements_chose_launched_or_registered() -> None:
    details = [
        {"replacement": {"status": "requested", "intent": {"replacing": OLD, "standby": SPARE}}},
        {"replacement": {"status": "launched", "instance": NEW}},
        {"replacement": {"status": "requested", "intent": {"replacing": "x~1", "chosen": "x~2"}}},
        {"replaced_by": "i-registered"},
        {"replacement": "not a mapping"},
        {},
    ]
    assert claimed(details) == {SPARE, NEW, "x~2", "i-registered"}


def test_a_standby_instance_aws_refused_to_move_is_no_longer_claimed() -> None:
    details = [{"replacement": {"status": "requested", "intent": REFUSED.to_json()}}]
    assert claimed(details) == set()


class SimulatedGroup:
    """An Auto Scaling Group's effects: exit_standby puts the instance in service (desired + 1); a
    termination removes the instance and, without a decrement, launches a new InService one."""

    def __init__(self, members: dict[str, Member], desired: int):
        self.members, self.desired = dict(members), desired
        self.launches = itertools.count()
        self.calls: list[Action] = []

    def apply(self, action: Action) -> None:
        self.calls.append(action)
        if isinstance(action, ExitStandby):
            assert self.members[action.instance].lifecycle == "Standby", "moved out of Standby twice"
            self.members[action.instance] = IN_SERVICE
            self.desired += 1
        elif isinstance(action, Terminate):
            assert action.instance in self.members, "terminated twice"
            del self.members[action.instance]
            if action.decrement:
                self.desired -= 1
            else:
                self.members[f"i-launched{next(self.launches)}"] = IN_SERVICE


def run(intent: Intent, sim: SimulatedGroup, cut: int | None, after_call: bool) -> tuple[Intent, str | None]:
    """One try of the operator's loop (decide, record, act) against the simulated group, cut short at
    its `cut`-th cloud call (before it, with only the intent recorded, or right after it)."""
    for calls in range(5):
        action = decide(intent, sim.members, TAKEN)
        if isinstance(action, Done):
            return intent, action.instance
        if isinstance(action, AwaitNew):
            fresh = sorted(i for i, m in sim.members.items() if m.lifecycle == "InService" and i not in TAKEN)
            assert fresh, "the simulated group launches at once"
            return intent, fresh[0]
        if isinstance(action, ExitStandby):
            intent = intent.exiting_standby(action.instance, AT)
        else:
            intent = intent.terminating(AT)
        if calls == cut and not after_call:
            return intent, None  # the leader died with the intent recorded, before the call
        sim.apply(action)
        if calls == cut:
            return intent, None  # ... or right after the call
    raise AssertionError("no outcome")


@pytest.mark.parametrize("spare", [True, False])
@pytest.mark.parametrize("cut", [0, 1])
@pytest.mark.parametrize("after_call", [False, True])
def test_a_replacement_cut_short_anywhere_and_continued_is_one_replacement(
    spare: bool, cut: int, after_call: bool
) -> None:
    members = group(old="InService", **({"spare": "Standby"} if spare else {}))
    sim = SimulatedGroup(members, desired=2)
    intent, outcome = run(Intent(OLD), sim, cut, after_call)
    if outcome is None:  # the next try (a new leader) continues from the recorded intent
        intent, outcome = run(intent, sim, None, False)
    assert outcome == (SPARE if spare else "i-launched0")
    assert OLD not in sim.members, "the failed instance is gone"
    assert [c for c in sim.calls if isinstance(c, ExitStandby)] == ([ExitStandby(SPARE)] if spare else [])
    assert [c.instance for c in sim.calls if isinstance(c, Terminate)] == [OLD], "one termination, of it"
    assert sim.desired == 2 and next(sim.launches) == (0 if spare else 1), "one replacement, not two"
    assert sorted(i for i, m in sim.members.items() if m.lifecycle == "InService") == sorted([PEER, outcome])


@pytest.mark.parametrize(
    ("lifecycle", "health", "alive"),
    [
        ("InService", "Healthy", True),
        ("Pending", "Healthy", True),
        # A launch lifecycle hook holds a new instance here while its agent boots and registers: before,
        # the cloud health check declared it lost within seconds and the root terminated it.
        ("Pending:Wait", "Healthy", True),
        ("Pending:Proceed", "Healthy", True),
        ("Warmed:Running", "Healthy", True),
        ("InService", "Unhealthy", False),
        ("Terminating", "Healthy", False),
        ("Terminating:Wait", "Healthy", False),
        ("Terminated", "Healthy", False),
        ("Detaching", "Healthy", False),
        (None, "Healthy", False),
    ],
)
def test_the_cloud_health_check_counts_an_instance_alive_unless_it_is_leaving_or_unhealthy(
    lifecycle: str | None, health: str, alive: bool
) -> None:
    assert instance_alive(lifecycle, health) is alive
