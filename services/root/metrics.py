"""Prometheus metrics at /metrics (text format 0.0.4), unauthenticated.

Why no token: the only credential the root knows is the admin token, which also creates and deletes jobs;
handing it to every Prometheus would be worse than what /metrics shows (counts, durations, job names; never
a token, address or cause). Expose the port only where your scrapers are, as usual for /metrics.

Two sources:
- the database, read at scrape time (a custom collector): jobs, machines and failures by state and kind,
  recovery phase durations, per-job counters from the agents' heartbeat summaries. Every root replica
  reads the same rows, so any replica answers the same and nothing is lost when one restarts. The counters
  and histograms over every job's failure events (castor_failures_total, castor_recoveries_total,
  castor_iterations_lost_total, castor_recovery_phase_seconds, castor_recovery_seconds) add what rows
  since deleted had counted (a deleted job's, a process exit folded into a machine's loss), kept in
  metric_totals (repository.retire_failures): they never go down, which Prometheus would read as a reset.
  The per-job and per-machine families end with their job (a series that stops is no reset);
- this process: API latency by route template and method (a middleware histogram), the process's own
  CPU and memory, whether this replica is the leader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.models import (
    FailureKind,
    JobState,
    MachineState,
    PersistedCheckpoint,
    PersistedShard,
    Tier,
)
from services.root.domain import failure_metrics, phases
from services.root.domain.ettr import MeasuredEttr
from services.root.domain.retention import is_complete_counted
from services.root.flows import ettr as ettr_flows
from services.root.middleware import KNOWN_METHODS
from services.root.web import queries

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
UNMATCHED = "unmatched"
OTHER_METHOD = "other"


class ProcessMetrics:
    """What this process measures itself, in a registry of its own app (tests run several apps)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "castor_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template, method and status (long polls included).",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)


def route_template(scope: Scope) -> str:
    """The matched route's path template (/api/v1/jobs/{job_id}), never the raw path: ids would make a
    new series per job."""
    route = scope.get("route")
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return str(path) if path else UNMATCHED


def method_label(scope: Scope) -> str:
    """The request's method when it is one HTTP defines, else "other": any client can send an invented
    method, and each would be a new series without bound."""
    method = scope.get("method", "")
    return method if method in KNOWN_METHODS else OTHER_METHOD


class LatencyMiddleware:
    """Pure ASGI (no buffering of streamed responses): times each HTTP request to its last byte."""

    def __init__(self, app: ASGIApp, metrics: ProcessMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        method = method_label(scope)  # before the app: HeadMiddleware answers HEAD as a GET
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.latency.labels(route_template(scope), method, str(status)).observe(
                time.perf_counter() - started
            )


class RowsFamily:
    """A counter or gauge family with a sample per machine, rendered straight to the text format.
    prometheus_client's families build a Sample and a label dict per row, and generate_latest then checks
    and escapes every label name of every sample: at 1,000 machines its four per-machine families were a
    third of a scrape's CPU. The text is what generate_latest writes for the same family, byte for byte
    (tests/unit/root/test_metrics_rows.py)."""

    def __init__(self, name: str, documentation: str, kind: str, labels: Sequence[str]) -> None:
        if kind not in ("counter", "gauge"):
            raise ValueError(f"RowsFamily renders counters and gauges, not {kind!r}")
        self.name, self.documentation, self.kind = name, documentation, kind
        self.labels = tuple(labels)
        self.rows: list[tuple[Sequence[str], float]] = []

    def add(self, values: Sequence[str], value: float) -> None:
        self.rows.append((values, value))

    def render(self) -> str:
        name = f"{self.name}_total" if self.kind == "counter" else self.name
        # generate_latest sorts a sample's labels by name: the values are put in that order.
        order = sorted(range(len(self.labels)), key=lambda i: self.labels[i])
        documentation = self.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {name} {documentation}\n# TYPE {name} {self.kind}\n"]
        for values, value in self.rows:
            labels = ",".join(f'{self.labels[i]}="{_escape_label_value(values[i])}"' for i in order)
            value_text = floatToGoString(value)  # type: ignore[no-untyped-call]  # generate_latest's own
            lines.append(f"{name}{{{labels}}} {value_text}\n")
        return "".join(lines)


def _escape_label_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


# -- from the database, at scrape time ---------------------------------------------------------------------


def _histogram(
    name: str,
    documentation: str,
    label: str,
    keys: Iterable[str],
    counters: Mapping[failure_metrics.MetricKey, int],
) -> Metric:
    """A histogram of failure_counters' samples (its _sum in microseconds) with a series for every key in
    `keys` and any other label value the samples have."""
    family = HistogramMetricFamily(name, documentation, labels=[label])
    labels = dict.fromkeys(keys)
    labels.update(dict.fromkeys(v for metric, v, _ in counters if metric == f"{name}_bucket"))
    for key in labels:
        buckets: list[tuple[str, float]] = [
            (bound, float(counters.get((f"{name}_bucket", key, bound), 0)))
            for bound in [*(repr(b) for b in failure_metrics.PHASE_BUCKETS), "+Inf"]
        ]
        family.add_metric([key], buckets, sum_value=counters.get((f"{name}_sum", key, ""), 0) / 1_000_000)
    return family


def _keys(known: Iterable[str], metric: str, counters: Mapping[failure_metrics.MetricKey, int]) -> list[str]:
    """The label values of a counter's series: every known one, then any other its samples have."""
    keys = dict.fromkeys(known)
    keys.update(dict.fromkeys(label for name, label, _ in counters if name == metric))
    return list(keys)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def database_families(database: Database) -> list[Metric | RowsFamily]:
    async with database.session() as session:
        if not database.is_sqlite:
            # One snapshot for every read below: at Postgres's default (READ COMMITTED) each statement sees
            # what committed before it, and a job deleted between the read of the failure events and that
            # of the retired totals was counted twice, and the next scrape went down (read as a reset). A
            # read-only REPEATABLE READ transaction never fails to serialize. (SQLite: one writer at a
            # time, and a reader's transaction sees one state.)
            await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        jobs = await queries.jobs_by_state(session)
        machines = await queries.machines_by_state(session)
        # What the failure events count, and what deleted or folded ones counted (retired totals): the
        # counters never go down as rows go.
        counters = failure_metrics.failure_counters(
            await queries.failures_by_kind(session),
            await queries.recoveries_by_tier(session),
            await queries.recovered_failures(session),
        )
        counters.update(await repo.metric_totals(session))
        active = await queries.active_jobs(session)
        ids = [job.id for job in active]
        # The machines' summaries read once for their counters and the ETTR's checkpoint stalls.
        summaries, stalls = await queries.machine_summaries(session, ids)
        events = await ettr_flows.failures_of(session, ids)
        persisted = await _persisted_iterations(session, active)
    now = datetime.now(UTC)
    ettrs = {
        job.id: ettr_flows.job_ettr(job, events.get(job.id, []), now, stalls.get(job.id, []))
        for job in active
    }

    result: list[Metric | RowsFamily] = []
    family = GaugeMetricFamily("castor_jobs", "Jobs by state.", labels=["state"])
    for state in JobState:
        family.add_metric([state.value], jobs.get(state.value, 0))
    result.append(family)

    family = GaugeMetricFamily("castor_machines", "Machines by state (replaced: history).", labels=["state"])
    for machine_state in MachineState:
        family.add_metric([machine_state.value], machines.get(machine_state.value, 0))
    result.append(family)

    counter = CounterMetricFamily(
        "castor_failures",
        "Failure events by kind (process exits folded into a machine's loss as its symptoms included).",
        labels=["kind"],
    )
    for kind in _keys([k.value for k in FailureKind], failure_metrics.FAILURES, counters):
        counter.add_metric([kind], counters.get((failure_metrics.FAILURES, kind, ""), 0))
    result.append(counter)

    counter = CounterMetricFamily(
        "castor_recoveries", "Recovered failures by the slowest checkpoint tier used.", labels=["tier"]
    )
    for tier in _keys([*(t.value for t in Tier), "none"], failure_metrics.RECOVERIES, counters):
        counter.add_metric([tier], counters.get((failure_metrics.RECOVERIES, tier, ""), 0))
    result.append(counter)

    result.append(
        _histogram(
            failure_metrics.PHASE_SECONDS,
            "Duration of each phase of recovered failures (detect, classify, replace, restore, resume).",
            "phase",
            phases.PHASES,
            counters,
        )
    )
    result.append(
        _histogram(
            failure_metrics.RECOVERY_SECONDS,
            "Recovery time of recovered failures: from detection to training resumed (every rank "
            "completed its first iteration after the restore).",
            "kind",
            [kind.value for kind in FailureKind],
            counters,
        )
    )
    counter = CounterMetricFamily(
        "castor_iterations_lost", "Iterations lost (rolled back) by recoveries, counted once per recovery."
    )
    counter.add_metric([], counters.get((failure_metrics.ITERATIONS_LOST, "", ""), 0))
    result.append(counter)
    result += _job_families(active, summaries)
    result += _ettr_families(active, ettrs)
    result += _persistent_families(active, persisted)
    return result


async def _persisted_iterations(session: AsyncSession, active: Sequence[Any]) -> dict[Any, int]:
    """Each active job's newest complete persisted checkpoint, as retention and the API count it: a shard of
    every rank on the current timeline, none condemned (a restore found it corrupt)."""
    if not active:
        return {}
    # One row per checkpoint and shard generation of the active jobs (retention keeps a few checkpoints
    # each), the usable shards counted in SQL.
    rows = await session.execute(
        select(
            PersistedCheckpoint.job_id,
            PersistedCheckpoint.iteration,
            PersistedShard.generation,
            func.count(PersistedShard.id),
        )
        .join(PersistedShard, PersistedShard.checkpoint_id == PersistedCheckpoint.id)
        .where(PersistedCheckpoint.job_id.in_([job.id for job in active]), PersistedShard.condemned.is_(None))
        .group_by(
            PersistedCheckpoint.id,
            PersistedCheckpoint.job_id,
            PersistedCheckpoint.iteration,
            PersistedShard.generation,
        )
    )
    counted: dict[tuple[Any, int], dict[int, int]] = {}
    for job_id, iteration, generation, count in rows:
        counted.setdefault((job_id, iteration), {})[int(generation)] = int(count)
    world = {job.id: job.num_machines * job.procs_per_machine for job in active}
    timelines = {job_id: await repo.resumed_from(session, job_id) for job_id in {j for j, _ in counted}}
    newest: dict[Any, int] = {}
    for (job_id, iteration), generations in counted.items():
        if is_complete_counted(
            iteration,
            shards=sum(generations.values()),
            generations=generations,
            world_size=world[job_id],
            resumed_from=timelines[job_id],
        ):
            newest[job_id] = max(iteration, newest.get(job_id, iteration))
    return newest


def _persistent_families(active: Sequence[Any], persisted: dict[Any, int]) -> list[Metric]:
    """How far the persistent tier is behind training (the alert rules in ops/prometheus/alerts.yml)."""
    iteration = GaugeMetricFamily(
        "castor_job_persisted_iteration",
        "Newest iteration of the job with a complete checkpoint in the persistent tier (absent: none yet).",
        labels=["job"],
    )
    every = GaugeMetricFamily(
        "castor_job_persist_every",
        "The job's persist_every: iterations between uploads to the persistent tier (0: disabled).",
        labels=["job"],
    )
    for job in active:
        every.add_metric([job.name], job.persist_every)
        if job.id in persisted:
            iteration.add_metric([job.name], persisted[job.id])
    return [iteration, every]


def _ettr_families(active: Sequence[Any], ettrs: dict[Any, MeasuredEttr]) -> list[Metric]:
    """The measured ETTR of each active job and its parts (domain/ettr.py), recomputed at every scrape."""
    ratio = GaugeMetricFamily(
        "castor_job_ettr",
        "Measured effective training time ratio: productive / wall time since start.",
        labels=["job"],
    )
    productive = GaugeMetricFamily(
        "castor_job_productive_seconds",
        "Wall time since the job started less its wasted time.",
        labels=["job"],
    )
    wasted = GaugeMetricFamily(
        "castor_job_wasted_by_cause_seconds",
        "Wasted time by cause: detection, replacement, restore, warmup, lost_iterations, checkpoint (stalls "
        "of the training threads in Castor; absent while not measured).",
        labels=["job", "cause"],
    )
    for job in active:
        measured = ettrs.get(job.id)
        if measured is None or measured.ettr is None:
            continue
        ratio.add_metric([job.name], measured.ettr)
        productive.add_metric([job.name], measured.productive_s)
        for cause, seconds in measured.wasted_s.items():
            wasted.add_metric([job.name, cause], seconds)
        if measured.checkpoint_overhead_s is not None:
            wasted.add_metric([job.name, "checkpoint"], measured.checkpoint_overhead_s)
    return [ratio, productive, wasted]


def _job_families(
    active: Sequence[Any], summaries: Sequence[tuple[Any, int, dict[str, Any]]]
) -> list[Metric | RowsFamily]:
    names = {job.id: job.name for job in active}
    newest = GaugeMetricFamily(
        "castor_job_newest_iteration", "Newest iteration every rank of the job committed.", labels=["job"]
    )
    frequency = GaugeMetricFamily(
        "castor_job_checkpoints_per_minute", "Effective checkpoint frequency of the job.", labels=["job"]
    )
    wasted = CounterMetricFamily(
        "castor_job_wasted_seconds",
        "Training time the job lost to failures (recoveries and rollbacks).",
        labels=["job"],
    )
    interval = GaugeMetricFamily(
        "castor_replication_interval_iterations",
        "Achieved replication interval: iterations between fully replicated in-memory checkpoints (worst "
        "machine of the job).",
        labels=["job"],
    )
    replication_lag = GaugeMetricFamily(
        "castor_replication_lag_iterations",
        "Iterations the newest fully replicated checkpoint lags the newest commit (worst machine).",
        labels=["job"],
    )
    stalled = GaugeMetricFamily(
        "castor_replication_stalled",
        "1 while the job's replication stopped advancing (lag past 4 intervals and 20 iterations), else 0.",
        labels=["job"],
    )
    for job in active:
        if job.newest_iteration is not None:
            newest.add_metric([job.name], job.newest_iteration)
        if job.checkpoints_per_minute is not None:
            frequency.add_metric([job.name], job.checkpoints_per_minute)
        wasted.add_metric([job.name], job.wasted_time_s)
        if job.replication_interval is not None:
            interval.add_metric([job.name], job.replication_interval)
        if job.replication_lag is not None:
            replication_lag.add_metric([job.name], job.replication_lag)
        if job.replication_state is not None:
            stalled.add_metric([job.name], 1 if job.replication_state == "stalled" else 0)

    committed = RowsFamily(
        "castor_checkpoints_committed",
        "Checkpoints the machine's agent committed to its memory (since the agent started).",
        "counter",
        ["job", "machine"],
    )
    replicated = RowsFamily(
        "castor_checkpoints_replicated",
        "Checkpoints of the machine that its peers verified and committed (since the agent started).",
        "counter",
        ["job", "machine"],
    )
    skipped = RowsFamily(
        "castor_checkpoints_skipped",
        "Saves the machine's training processes skipped: their slot was still being read (since the agent "
        "started).",
        "counter",
        ["job", "machine"],
    )
    replicas_skipped = RowsFamily(
        "castor_replicas_skipped",
        "Commits no replication round of the machine sent: rounds skip the iterations committed while one "
        "is under way (since the agent started).",
        "counter",
        ["job", "machine"],
    )
    on_storage = RowsFamily(
        "castor_machine_checkpoints_on_storage",
        "1 for each machine whose checkpoint directory is on a filesystem backed by storage (ext4, xfs, "
        "NFS), not memory: every save and replica is written back to storage beside training.",
        "gauge",
        ["job", "machine", "filesystem"],
    )
    lag = GaugeMetricFamily(
        "castor_replication_lag_seconds",
        "Worst replication lag over the job's machines: newest commit to the peer's verified replica.",
        labels=["job"],
    )
    worst: dict[Any, float] = {}
    for job_id, rank, summary in summaries:
        labels = [names[job_id], str(rank)]
        committed.add(labels, _number(summary.get("committed")) or 0)
        replicated.add(labels, _number(summary.get("replicated")) or 0)
        skipped.add(labels, _number(summary.get("skipped")) or 0)
        replicas_skipped.add(labels, _number(summary.get("replicas_skipped")) or 0)
        if isinstance(filesystem := summary.get("store_filesystem"), str):
            on_storage.add([*labels, filesystem], 1)
        value = _number(summary.get("replication_lag_s"))
        if value is not None:
            worst[job_id] = max(value, worst.get(job_id, 0.0))
    for job_id, value in worst.items():
        lag.add_metric([names[job_id]], value)
    return [
        newest,
        frequency,
        wasted,
        interval,
        replication_lag,
        stalled,
        committed,
        replicated,
        skipped,
        replicas_skipped,
        on_storage,
        lag,
    ]


class _Snapshot:
    """A collector that yields families gathered beforehand (the database is read asynchronously)."""

    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


router = APIRouter(include_in_schema=False)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = request.app.state
    families: list[Metric | RowsFamily] = []
    up = GaugeMetricFamily("castor_database_up", "Whether this scrape could read the database.")
    try:
        families += await database_families(state.castor.database)
        up.add_metric([], 1)
    except Exception as exc:
        log.warning("metrics: reading the database failed: %s", exc)
        up.add_metric([], 0)
    leader = GaugeMetricFamily("castor_leader", "1 if this root replica is the leader (runs recoveries).")
    leader.add_metric([], 1 if state.castor.orchestrator.is_leader else 0)
    # This replica's orchestrator since it started: a job whose step raised (the others went on), and
    # suspect or failed machines whose heartbeats resumed.
    step_failures = CounterMetricFamily(
        "castor_orchestration_step_failures", "Orchestration steps of one job that raised on this replica."
    )
    step_failures.add_metric([], state.castor.orchestrator.step_failures)
    reinstated = CounterMetricFamily(
        "castor_machines_reinstated", "Suspect or failed machines reinstated when their heartbeats resumed."
    )
    reinstated.add_metric([], state.castor.orchestrator.reinstated)
    en_masse = GaugeMetricFamily(
        "castor_jobs_silent_en_masse",
        "Jobs so many of whose machines are silent at once that none is declared lost on silence alone "
        "(CASTOR_MASS_SILENCE_FRACTION): look at the root's host, etcd and the network to them.",
    )
    en_masse.add_metric([], state.castor.orchestrator.jobs_silent_en_masse)
    families += [up, leader, step_failures, reinstated, en_masse, *state.castor_metrics.registry.collect()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(f for f in families if not isinstance(f, RowsFamily)))
    rows = "".join(f.render() for f in families if isinstance(f, RowsFamily)).encode()
    return Response(generate_latest(registry) + rows, media_type=CONTENT_TYPE_LATEST)


def install(app: FastAPI) -> None:
    """Time every request and serve /metrics."""
    app.state.castor_metrics = ProcessMetrics()
    app.add_middleware(LatencyMiddleware, metrics=app.state.castor_metrics)
    app.include_router(router)
