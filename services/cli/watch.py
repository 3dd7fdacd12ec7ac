"""`castor jobs watch JOB`: a job's machines, replication and recovery phases, redrawn in place on a terminal
(rich.live.Live), one line per state change elsewhere."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.cli import render
from services.cli.client import CliClient, CliError, NotFound, Unreachable, resolve_job
from services.cli.failures import phase_rows
from services.cli.jobs import TERMINAL_STATES, _machine_iteration
from services.cli.render import _stdout, cell, format_ago, print_json, shorten, to_text


@dataclass
class Snapshot:
    """What `castor jobs watch` shows: the job, its current machines and its failures (newest first)."""

    job: dict[str, Any]
    machines: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    note: str = ""


WATCH_FAILURES = 20  # the newest failures a snapshot reads (the view draws the newest one's phases)


def take_snapshot(client: CliClient, job_id: str) -> Snapshot:
    """The job, every live machine (page after page) and its newest WATCH_FAILURES failures (one bounded
    request a refresh; the job's `failures` counts them all)."""
    job = client.document(client.api.job(job_id))
    machines = [m for m in client.document(client.api.machines(job_id)) if m["state"] != "replaced"]
    failures = client.document(client.api.failures_page(job_id, limit=WATCH_FAILURES)).get("items", [])
    return Snapshot(job, sorted(machines, key=lambda m: m["rank"]), failures)


def replication_text(job: dict[str, Any]) -> str:
    """Replication as the job's API reports it: the newest fully replicated iteration, the achieved
    interval, the lag behind the newest commit and whether it stalled."""
    if job.get("replication_state") is None:
        return (
            "none (one replica, or nothing reported yet)"
            if job.get("replicas") == 1
            else "nothing reported yet"
        )
    parts = [f"iteration {cell(job.get('replicated_iteration'))}"]
    if job.get("replication_interval") is not None:
        parts.append(f"every {job['replication_interval']} iterations")
    if job.get("replication_lag") is not None:
        parts.append(f"lag {job['replication_lag']}")
    return ", ".join(parts)


def watch_view(snapshot: Snapshot, now: datetime | None = None) -> Any:
    """The live view of one job: a state line, replication, the machines and the newest failure's phases."""
    from rich.console import Group
    from rich.padding import Padding
    from rich.text import Text

    now = now or datetime.now(UTC)
    job = snapshot.job
    header = Text.assemble(
        ("Job ", "bold"),
        (job["name"], "bold"),
        "  ",
        render.styled(job["state"]),
        f"  iteration {cell(job.get('newest_iteration'))}",
        f"  machines {job['machines_healthy']}/{job['machines']} healthy",
        f"  failures {job['failures']}",
    )
    if snapshot.note:
        header.append(f"  {snapshot.note}", style="yellow")
    replication = Text("Replication: ")
    if job.get("replication_state") is not None:
        replication.append_text(render.styled(job["replication_state"]))
        replication.append(", ")
    replication.append(replication_text(job))
    parts: list[Any] = [header, replication, Text("")]
    if snapshot.machines:
        parts.append(Text(f"Machines ({len(snapshot.machines)} of {job['machines']} registered)"))
        rows = [
            (
                m["rank"],
                m["state"],
                m["instance_id"],
                m["hostname"] or None,
                format_ago(m["last_heartbeat_at"], now),
                _machine_iteration(m),
                (m.get("summary") or {}).get("replicated_iteration"),
            )
            for m in snapshot.machines
        ]
        headers = ("RANK", "STATE", "INSTANCE", "HOST", "HEARTBEAT", "ITERATION", "REPLICATED")
        parts.append(Padding(render.make_table(headers, rows), (0, 0, 0, 2), expand=False))
    else:
        parts.append(Text(f"Machines: none registered yet (0 of {job['machines']})"))
    parts.append(Text(""))
    if snapshot.failures:
        failure = snapshot.failures[0]  # newest first: the recovery in progress, else the last one
        number = f"#{failure['number']}" if failure.get("number") is not None else str(failure["id"])
        title = Text(f"Recovery of failure {number} ({failure['kind']}, rank {cell(failure['rank'])}): ")
        title.append_text(render.styled(failure["state"]))
        title.append(f"  {shorten(failure['cause'])}")
        parts.append(title)
        phases = render.make_table(("PHASE", "AT", "TOOK"), phase_rows(failure, now))
        parts.append(Padding(phases, (0, 0, 0, 2), expand=False))
    else:
        parts.append(Text("Failures: none"))
    return Group(*parts)


def jobs_watch(
    client: CliClient,
    args: argparse.Namespace,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Refresh a job's view every --interval seconds until the job ends (exit 0; 1 when it failed) or
    Ctrl-C (130). On a terminal the view is redrawn in place (rich.live.Live); elsewhere (a pipe, a log)
    it prints one line per change of the job's state and the full view once at the end; with --json only
    the last snapshot, as one document {"job", "machines", "failures"} (its newest failures, WATCH_FAILURES;
    `castor failures list` gives them all)."""
    from rich.live import Live

    job = resolve_job(client, args.job)
    console = _stdout()
    snapshot = take_snapshot(client, job["id"])
    live = Live(
        watch_view(snapshot), console=console, auto_refresh=False, transient=False, redirect_stderr=False
    )
    interactive = console.is_terminal and not console.is_dumb_terminal and not args.json
    last_state = None
    if interactive:
        live.start()
    try:
        while True:
            state = snapshot.job["state"]
            if interactive:
                live.update(watch_view(snapshot), refresh=True)
            elif state != last_state and not args.json:
                iteration = cell(snapshot.job.get("newest_iteration"))
                at = f"{datetime.now().astimezone():%H:%M:%S}"
                print(f"{at} job {job['name']}: {state}, iteration {iteration}", flush=True)
            last_state = state
            if state in TERMINAL_STATES:
                break
            sleep(args.interval)
            try:
                snapshot = take_snapshot(client, job["id"])
            except NotFound:
                raise CliError(f"job {job['name']} was deleted while watching") from None
            except Unreachable:
                # A root replica failing over: keep the last view, say so, and keep watching.
                snapshot.note = "(root unreachable, retrying)"
    finally:
        if interactive:
            live.stop()
    if args.json:
        print_json({"job": snapshot.job, "machines": snapshot.machines, "failures": snapshot.failures})
    elif not interactive:
        print()
        print(to_text(watch_view(snapshot)))
    return 1 if snapshot.job["state"] == "failed" else 0
