"""The states a job's recovery passes through, and the transitions between them: the protocol the leader's
recovery driver (orchestration.recovery_driver -> flows.recovery.advance) follows, written down as a table.

Pure: the state is derived from what the database holds (`derive`: the job's state, its latest recovery
plan's status, its open failure events and its machines), so a new leader finds a recovery where the last
one left it. `advance` validates each transition it makes against `TRANSITIONS` (`check`).

    RUNNING ─▶ DETECTED ─▶ REPLACING ─▶ COLLECTING ─▶ PLANNED ─▶ RESUMING ─▶ RUNNING
                  │  ▲            │              │             │           │
                  │  └────────────┴──────────────┴─────────────┴───────────┘  a new failure
                  ▼
                FAILED   (max_failed_recoveries recoveries in a row failed before training resumed)

(DETECTED -> COLLECTING when no machine is lost; COLLECTING -> REPLACING when a machine late with its
inventory is lost and its peers' exits, already in the generation, fold into it; PLANNED -> RUNNING when
every rank restored and resumed between two passes.)

A failure during REPLACING or COLLECTING joins the generation under way; one during PLANNED or RESUMING
(before every rank resumed) ends it as a failed recovery and opens the next generation, or gives up.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class RecoveryState(enum.StrEnum):
    RUNNING = "running"  # no recovery open: training runs (before any failure, or the last one recovered)
    DETECTED = "detected"  # failures recorded that no generation took up yet
    REPLACING = "replacing"  # a generation collects; a failed machine waits for its replacement
    COLLECTING = "collecting"  # every machine present; waiting for the inventories of this generation
    PLANNED = "planned"  # the plan is decided (iteration, a source per rank); machines restore
    RESUMING = "resuming"  # every machine restored; waiting for every rank's first iteration after it
    FAILED = "failed"  # given up: too many recoveries in a row failed before training resumed


S = RecoveryState

# Allowed transitions, each with why it happens. The agents' reports and the failure flows move a
# recovery as well as the driver (a failure recorded -> DETECTED, a machine restored -> RESUMING).
TRANSITIONS: Mapping[RecoveryState, Mapping[RecoveryState, str]] = {
    S.RUNNING: {
        S.DETECTED: "a failure was recorded (a process exit, a machine declared lost)",
    },
    S.DETECTED: {
        S.REPLACING: "a generation opened (or the one collecting took the failures up); a machine is lost",
        S.COLLECTING: "a generation opened (or the one collecting took the failures up); no machine lost",
        S.FAILED: "a failure before training resumed, max_failed_recoveries in a row: the job failed",
    },
    S.REPLACING: {
        S.COLLECTING: "the replacements registered (or a suspect machine was reinstated)",
        S.DETECTED: "another failure: it joins this generation",
    },
    S.COLLECTING: {
        S.PLANNED: "every machine reported its inventory: the plan is decided",
        S.DETECTED: "another failure (or a machine late with its inventory): it joins this generation",
        S.REPLACING: "a machine late with its inventory was lost; its peers' exits (this generation) fold in",
    },
    S.PLANNED: {
        S.RESUMING: "every machine restored the plan's iteration and restarted training",
        S.RUNNING: "every rank completed an iteration after the restore: recovered",
        S.DETECTED: "a failure before every rank resumed (or a machine late to resume): a failed recovery",
    },
    S.RESUMING: {
        S.RUNNING: "every rank completed an iteration after the restore: recovered",
        S.DETECTED: "a failure before every rank resumed (or a machine late to resume): a failed recovery",
    },
    S.FAILED: {},
}


class IllegalTransition(RuntimeError):
    """A step tried to move a recovery along a transition the protocol does not have (a bug)."""


def allowed(source: RecoveryState, target: RecoveryState) -> bool:
    return target in TRANSITIONS[source]


def check(source: RecoveryState, target: RecoveryState) -> RecoveryState:
    """`target` if the protocol allows `source -> target` (staying in a state is always allowed: a pass
    that changed nothing); IllegalTransition otherwise."""
    if source != target and not allowed(source, target):
        raise IllegalTransition(f"a recovery cannot go from {source} to {target}")
    return target


def derive(
    job_state: str,
    plan_status: str | None,
    *,
    fresh_failures: bool,
    machine_failed: bool,
    all_restored: bool,
) -> RecoveryState | None:
    """The recovery state of a job from what the database holds: its state (JobState value), its latest
    plan's status (PlanStatus value), whether failure events are still `detected` (no generation took them
    up), whether a live machine is `failed` (its replacement has not registered) and whether every live
    machine restored the latest plan's generation. None: no recovery to drive (a job pending, completed,
    stopped; or recovering with a plan in no recovery status)."""
    if job_state == "failed":
        return S.FAILED
    if job_state not in ("running", "recovering"):
        return None
    if fresh_failures:
        return S.DETECTED
    if job_state == "running":
        return S.RUNNING
    if plan_status == "collecting":
        return S.REPLACING if machine_failed else S.COLLECTING
    if plan_status == "ready":
        return S.RESUMING if all_restored else S.PLANNED
    return None
