"""Replacing a failed machine in an Auto Scaling Group: decided before it is acted on, from what was recorded
and what the group holds (pure).

A replacement is a few cloud calls (move a Standby instance into service; mark the failed instance
Unhealthy and terminate it, decrementing the desired capacity or not) and a wait for the instance that takes
the rank. A call can fail, and a leader can die, between any two of them. The next try (this leader's after a
pause, or a new leader's at once) must then neither terminate another instance nor request a second
replacement (a second Standby instance, or a second launch). So every call is preceded by a record of what
it is about to do, the `Intent`, on the failure event, and every try decides its next call from that record
and the group's actual state alone: `decide(intent, group, taken)`. Each call is asked for only while the
group shows it has not happened: an instance already terminating is not terminated again, a chosen Standby
instance already in service is not moved again, and a new InService instance no machine holds is adopted
instead of waited for a second time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, replace
from typing import Any

# Lifecycle states of an instance on its way out of the group (or out already, when the group still lists it).
LEAVING = frozenset(
    {"Terminating", "Terminating:Wait", "Terminating:Proceed", "Terminated", "Detaching", "Detached"}
)
# States in which an instance waits in the group's Standby pool (EnteringStandby: on its way there).
STANDBY = frozenset({"Standby", "EnteringStandby"})


def instance_alive(lifecycle: str | None, health: str | None) -> bool:
    """Whether the group's view of an instance leaves its machine alive: healthy and not leaving the group.
    Every other lifecycle state counts as alive, the launch lifecycle hook's `Pending:Wait` and
    `Pending:Proceed` and a warm pool's `Warmed:*` included: an agent boots and registers in them, and a
    check that knew only InService and Pending declared such a new machine lost within seconds, so the
    root terminated it and the next one the same way."""
    return health == "Healthy" and lifecycle is not None and lifecycle not in LEAVING


@dataclass(frozen=True)
class Member:
    """One instance of the group as DescribeAutoScalingGroups lists it."""

    lifecycle: str
    healthy: bool = True


def group_state(instances: Iterable[Mapping[str, Any]]) -> dict[str, Member]:
    """The group's instances (DescribeAutoScalingGroups' `Instances`) by instance id."""
    return {
        str(i["InstanceId"]): Member(str(i["LifecycleState"]), i.get("HealthStatus", "Healthy") == "Healthy")
        for i in instances
    }


@dataclass(frozen=True)
class Intent:
    """What the failure event records of a replacement before each cloud call (its `replacement.intent`).

    `replacing`: the instance being replaced (the failed machine's; or a replacement that never registered,
    when that one is replaced in turn). `standby`: the Standby instance chosen to take the rank, recorded
    with `exit_standby_at` before it is moved into service. `terminate_at`: when terminating `replacing` was
    requested; without a Standby instance that termination (without decrementing the desired capacity) is
    the replacement request itself: the group launches the new instance. `exit_standby_refused`: why AWS
    refused to move `standby` into service (the group's MaxSize, a missing IAM permission: an answer a
    retry does not change); the replacement then goes without a Standby instance."""

    replacing: str
    standby: str | None = None
    exit_standby_at: str | None = None
    terminate_at: str | None = None
    exit_standby_refused: str | None = None

    def to_json(self) -> dict[str, str]:
        return {key: value for key, value in self.__dict__.items() if value is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, *, replacing: str) -> Intent:
        """The recorded intent (`replacing` when nothing was recorded, or a record from before intents)."""
        data = data or {}

        def text(key: str) -> str | None:
            value = data.get(key)
            return str(value) if value else None

        return cls(
            replacing=text("replacing") or replacing,
            standby=text("standby"),
            exit_standby_at=text("exit_standby_at"),
            terminate_at=text("terminate_at"),
            exit_standby_refused=text("exit_standby_refused"),
        )

    def exiting_standby(self, instance: str, at: str) -> Intent:
        return replace(self, standby=instance, exit_standby_at=at)

    def terminating(self, at: str) -> Intent:
        return replace(self, terminate_at=at)

    def standby_refused(self, why: str) -> Intent:
        return replace(self, exit_standby_refused=why)


@dataclass(frozen=True)
class ExitStandby:
    """Move this Standby instance into service (the desired capacity goes up by one)."""

    instance: str


@dataclass(frozen=True)
class Terminate:
    """Mark this instance Unhealthy and terminate it; without decrementing the desired capacity the group
    launches a new instance in its place."""

    instance: str
    decrement: bool


@dataclass(frozen=True)
class AwaitNew:
    """Wait for a new InService instance outside `exclude` (the group is launching it)."""

    exclude: frozenset[str]


@dataclass(frozen=True)
class Done:
    """`instance` takes the rank: nothing left to ask of the cloud."""

    instance: str
    standby: bool


Action = ExitStandby | Terminate | AwaitNew | Done


def decide(
    intent: Intent, group: Mapping[str, Member], taken: Set[str], *, use_standby: bool = True
) -> Action:
    """The next step of a replacement, from its recorded intent and the group's current state. `taken`:
    instances no replacement of this one may hand out (held by machines of the job, chosen by its other
    replacements)."""
    old = group.get(intent.replacing)
    old_in_service = old is not None and old.lifecycle not in LEAVING
    # The group replaces the failed instance itself (its health check terminates it, or it is already gone:
    # a spot interruption, an instance retired; Castor requested no termination): its launch takes the rank.
    # A Standby instance moved into service would raise the desired capacity and leave the group one
    # instance over it for good.
    group_replacing = intent.terminate_at is None and (old is None or old.lifecycle.startswith("Terminat"))
    # AWS refused to move the chosen Standby instance into service: a retry, or another Standby instance,
    # would be refused alike (the group's MaxSize, a missing permission); the group launches one instead.
    no_standby = group_replacing or intent.exit_standby_refused is not None
    if intent.standby is not None:
        chosen = group.get(intent.standby)
        if chosen is not None and chosen.lifecycle in STANDBY:
            if not no_standby:
                return ExitStandby(intent.standby)  # recorded, and the call did not land (or not yet)
            # Still in Standby, and not to be moved: decided below without it.
        elif chosen is not None and chosen.lifecycle not in LEAVING:
            # In service (or on its way): the group grew by one, so the failed instance goes with a decrement.
            if old_in_service:
                return Terminate(intent.replacing, decrement=True)
            return Done(intent.standby, standby=True)
        # The chosen instance left the group meanwhile: decided again below as if none had been chosen.
    if intent.terminate_at is None and use_standby and not no_standby:
        # No launch requested yet: a Standby instance takes the rank in seconds instead of minutes.
        spares = sorted(
            i
            for i, m in group.items()
            if m.lifecycle == "Standby" and i not in taken and i not in (intent.replacing, intent.standby)
        )
        if spares:
            return ExitStandby(spares[0])
    if old_in_service:
        return Terminate(intent.replacing, decrement=False)
    # The failed instance is gone (our termination, or the group replacing an unhealthy instance itself): a
    # new InService instance that no machine holds is the one launched in its place.
    exclude = frozenset(taken | {intent.replacing})
    fresh = sorted(
        i for i, m in group.items() if m.lifecycle == "InService" and m.healthy and i not in exclude
    )
    if fresh:
        return Done(fresh[0], standby=False)
    return AwaitNew(exclude)


def claimed(details: Iterable[Mapping[str, Any]]) -> set[str]:
    """Instances the replacements recorded on these failure events' details hold: chosen (a Standby
    instance, a local agent), launched (the instance a replacement returned) or registered (the rank's new
    holder). Another replacement must not hand them out, even from a new leader that never saw them
    chosen."""
    held: set[str] = set()
    for detail in details:
        request = detail.get("replacement")
        request = request if isinstance(request, Mapping) else {}
        intent = request.get("intent")
        intent = intent if isinstance(intent, Mapping) else {}
        # A Standby instance AWS refused to move into service stays in the pool: no one holds it.
        standby = None if intent.get("exit_standby_refused") else intent.get("standby")
        chosen = (standby, intent.get("chosen"))
        for value in (request.get("instance"), *chosen, detail.get("replaced_by")):
            if isinstance(value, str) and value:
                held.add(value)
    return held
