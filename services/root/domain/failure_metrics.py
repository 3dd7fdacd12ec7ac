"""The /metrics counters that failure events make, as pure sums over the events: the scrape counts the
current rows with them, and a job's deletion or a fold retires what its rows counted (metric_totals), so the
counters never go down (services/root/metrics.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from services.root.domain import phases
from services.root.domain.embedded import crash_of

# The recovery histograms' bucket bounds (seconds).
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# A sample of a counter /metrics renders from failure events: its name, the value of its one label ("" when
# it has none) and a histogram bucket's bound ("" for other samples). A histogram's _count is its +Inf bucket.
MetricKey = tuple[str, str, str]
FAILURES = "castor_failures_total"
RECOVERIES = "castor_recoveries_total"
ITERATIONS_LOST = "castor_iterations_lost_total"
PHASE_SECONDS = "castor_recovery_phase_seconds"
RECOVERY_SECONDS = "castor_recovery_seconds"


def failure_counters(
    kinds: Mapping[str, int], tiers: Mapping[str, int], recovered: Iterable[Any]
) -> Counter[MetricKey]:
    """The counter samples of /metrics that failure events make: `kinds` counts events by kind, `tiers`
    recovered ones by tier ("none" for None), `recovered` are the recovered events (FailureEvent rows, or
    web.queries.FailureTimes). Histogram sums are in integer microseconds. Every sample is a sum over the
    events, so the samples of a set of events are those of its parts added up, as long as the events of one
    recovery plan, or of one embedded-mode crash, stay together (the iterations lost count once per plan
    or crash): a whole job's events, or events not recovered yet."""
    totals: Counter[MetricKey] = Counter()
    for kind, count in kinds.items():
        totals[(FAILURES, kind, "")] += count
    for tier, count in tiers.items():
        totals[(RECOVERIES, tier, "")] += count
    lost_by_recovery: dict[object, int] = {}
    for event in recovered:
        for phase in phases.phases(event, finished=True):
            _observe(totals, PHASE_SECONDS, phase.name, phase.seconds)
        seconds = phases.recovery_seconds(event)
        if seconds is not None:
            _observe(totals, RECOVERY_SECONDS, event.kind, seconds)
        # Failures that joined one recovery (a lost group: one event per machine) share its rollback, as do
        # the embedded-mode failures of one crash.
        recovery = (
            event.plan_id if event.plan_id is not None else ("crash", crash_of(event.id, event.details))
        )
        lost_by_recovery[recovery] = max(lost_by_recovery.get(recovery, 0), event.iterations_lost or 0)
    totals[(ITERATIONS_LOST, "", "")] += sum(lost_by_recovery.values())
    return totals


def _observe(totals: Counter[MetricKey], histogram: str, label: str, seconds: float) -> None:
    for bound in PHASE_BUCKETS:
        if seconds <= bound:
            totals[(f"{histogram}_bucket", label, repr(bound))] += 1
    totals[(f"{histogram}_bucket", label, "+Inf")] += 1
    totals[(f"{histogram}_sum", label, "")] += round(seconds * 1_000_000)
