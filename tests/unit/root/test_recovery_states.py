"""The recovery protocol's transition table (domain.recovery_states): every allowed transition is
accepted, every other one refused, and the state derived from the database's fields is the one each
branch of flows.recovery.advance handles."""

from __future__ import annotations

import itertools

import pytest

from services.root.domain import recovery_states
from services.root.domain.recovery_states import TRANSITIONS, IllegalTransition, RecoveryState

S = RecoveryState
ALLOWED = {(source, target) for source, targets in TRANSITIONS.items() for target in targets}
REFUSED = {
    (source, target)
    for source, target in itertools.product(S, S)
    if source != target and (source, target) not in ALLOWED
}


def test_the_table_names_every_state_and_only_states() -> None:
    assert set(TRANSITIONS) == set(S)
    for targets in TRANSITIONS.values():
        assert set(targets) <= set(S)
        assert all(why for why in targets.values()), "each transition says why it happens"


@pytest.mark.parametrize(("source", "target"), sorted(ALLOWED))
def test_every_allowed_transition_is_accepted(source: RecoveryState, target: RecoveryState) -> None:
    assert recovery_states.allowed(source, target)
    assert recovery_states.check(source, target) == target


@pytest.mark.parametrize(("source", "target"), sorted(REFUSED))
def test_every_other_transition_is_refused(source: RecoveryState, target: RecoveryState) -> None:
    assert not recovery_states.allowed(source, target)
    with pytest.raises(IllegalTransition, match=f"from {source} to {target}"):
        recovery_states.check(source, target)


def test_the_protocol_as_the_readme_describes_it() -> None:
    # The way through a machine loss, and the ways out of each state that the driver relies on.
    path = [S.RUNNING, S.DETECTED, S.REPLACING, S.COLLECTING, S.PLANNED, S.RESUMING, S.RUNNING]
    for source, target in itertools.pairwise(path):
        recovery_states.check(source, target)
    assert not TRANSITIONS[S.FAILED], "a failed job stays failed"
    for state in (S.REPLACING, S.COLLECTING, S.PLANNED, S.RESUMING):
        assert recovery_states.allowed(state, S.DETECTED), f"a failure during {state} is taken up"
    assert not recovery_states.allowed(S.RUNNING, S.PLANNED), "no plan without collecting inventories"
    assert not recovery_states.allowed(S.COLLECTING, S.RUNNING), "no recovery without a restore"
    assert not recovery_states.allowed(S.REPLACING, S.FAILED), "only the driver gives up, on a failure"


def test_staying_in_a_state_is_a_pass_that_changed_nothing() -> None:
    for state in S:
        assert recovery_states.check(state, state) == state


@pytest.mark.parametrize(
    ("job", "plan", "fresh", "failed", "restored", "expected"),
    [
        ("running", "ready", False, False, True, S.RUNNING),
        ("running", "ready", True, True, False, S.DETECTED),
        ("recovering", "ready", True, False, True, S.DETECTED),  # a failure during the restore
        ("recovering", "collecting", True, False, False, S.DETECTED),  # joins the generation
        ("recovering", "collecting", False, True, False, S.REPLACING),
        ("recovering", "collecting", False, False, False, S.COLLECTING),
        ("recovering", "ready", False, False, False, S.PLANNED),
        ("recovering", "ready", False, False, True, S.RESUMING),
        ("failed", "ready", True, True, False, S.FAILED),
        ("recovering", "pending", False, False, False, None),
        ("pending", "pending", True, False, False, None),
        ("completed", "ready", False, False, True, None),
        ("stopped", "collecting", False, False, False, None),
    ],
)
def test_the_state_derived_from_the_database(
    job: str, plan: str, fresh: bool, failed: bool, restored: bool, expected: RecoveryState | None
) -> None:
    state = recovery_states.derive(
        job, plan, fresh_failures=fresh, machine_failed=failed, all_restored=restored
    )
    assert state == expected
