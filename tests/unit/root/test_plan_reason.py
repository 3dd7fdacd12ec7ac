"""A plan's reason (500 characters in its column) keeps what the plan decided whole: a long failure cause
is what gets shortened. Before, `(causes + " -> " + decision)[:500]` cut the decision off."""

from __future__ import annotations

from services.root.flows.recovery import REASON_LIMIT, _reason_then


def test_a_short_reason_is_joined_as_it_is() -> None:
    assert _reason_then("rank 1 exited", "iteration 40: every rank has an intact copy") == (
        "rank 1 exited -> iteration 40: every rank has an intact copy"
    )


def test_a_long_cause_is_shortened_and_the_decision_kept_whole() -> None:
    cause = "RuntimeError: Connection closed by peer " * 20
    decision = "iteration 40: every rank has an intact copy (2 local, 2 persistent)"
    reason = _reason_then(cause, decision)
    assert len(reason) == REASON_LIMIT and reason.endswith(" -> " + decision)
    assert reason.startswith(cause[:100])
