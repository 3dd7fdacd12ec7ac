"""Moved to services.root.domain.phases (one module computes failure phases for the pages, /metrics, the
API and the CLI); re-exported here for the modules that still import it from web."""

from services.root.domain.phases import (
    PHASE_HELP,
    PHASES,
    EventTimes,
    Phase,
    RecoveryTimes,
    failed_at,
    failure_phases,
    is_finished,
    parse_timestamp,
    phases,
    recovery_seconds,
)

__all__ = [
    "PHASES",
    "PHASE_HELP",
    "EventTimes",
    "Phase",
    "RecoveryTimes",
    "failed_at",
    "failure_phases",
    "is_finished",
    "parse_timestamp",
    "phases",
    "recovery_seconds",
]
