"""`castor failures list|show`: a job's failures, their phases and recovery plans."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from services.cli.client import CliClient, resolve_job
from services.cli.render import (
    format_ago,
    format_duration,
    format_time,
    print_json,
    render_fields,
    shorten,
    table,
)


def _failure_rows(failures: Sequence[dict[str, Any]], now: datetime) -> list[tuple[object, ...]]:
    return [
        (
            f"#{f['number']}" if f.get("number") is not None else "-",  # within the job, as the pages say
            f["id"],
            format_ago(f["detected_at"], now),
            f["rank"],
            f["kind"],
            f["state"],
            f["tier"],
            f["iterations_lost"],
            format_duration(f.get("recovery_s")),  # the API's one definition: detection to resumed
            shorten(f["cause"]),
        )
        for f in failures
    ]


FAILURE_HEADERS = ("#", "ID", "DETECTED", "RANK", "KIND", "STATE", "TIER", "LOST", "RECOVERY", "CAUSE")


def phase_rows(failure: dict[str, Any], now: datetime | None = None) -> list[tuple[str, str, str]]:
    """The failure's recovery phases as the API computed them (the phases the pages draw and /metrics
    counts, from domain.phases): each with when it ended and how long it took; the last one is under way
    until the failure is over, and a finished failure has no row for a phase that never happened (a
    software failure has no replace phase). An older service's answer, without phases, gets them from the
    same function here."""
    now = now or datetime.now(UTC)
    phases: list[tuple[str, str | datetime | None, float]]
    if failure.get("phases") is not None:
        phases = [(p["name"], p.get("end"), float(p["seconds"])) for p in failure["phases"]]
    else:
        from services.root.domain.phases import failure_phases  # stdlib only: no server dependencies

        phases = [(p.name, p.end, p.seconds) for p in failure_phases(failure, now)]
    rows = [
        (name, "-", f"under way, {format_duration(seconds)} so far")
        if end is None
        else (name, format_time(end, now), format_duration(seconds))
        for name, end, seconds in phases
    ]
    total = failure.get("recovery_s")  # detection to training resumed, as the pages and /metrics say
    rows.append(("recovery time", "", format_duration(total) if total is not None else "-"))
    return rows


def failures_list(client: CliClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    failures = client.document(client.api.failures(job["id"]))
    if args.json:
        print_json(failures)
        return 0
    if not failures:
        print(f"job {job['name']} has no failures")
        return 0
    print(table(FAILURE_HEADERS, _failure_rows(failures, datetime.now(UTC))))
    return 0


def _source_text(source: dict[str, Any]) -> str:
    tier = source.get("tier")
    if tier == "peer":
        return f"machine {source.get('source_rank')} at {source.get('address')}:{source.get('data_port')}"
    if tier == "persistent":
        return str(source.get("location") or "-")
    return "own memory"


def failures_show(client: CliClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    failure = client.document(client.api.failure(job["id"], args.failure_id))
    plan = None
    if failure.get("plan_id") is not None:
        plans = client.document(client.api.recovery_plans(job["id"]))
        plan = next((p for p in plans if p["id"] == failure["plan_id"]), None)
    if args.json:
        print_json({"failure": failure, "plan": plan})
        return 0
    number = f" (#{failure['number']} of the job)" if failure.get("number") is not None else ""
    print(f"Failure {failure['id']} of job {job['name']}{number}")
    print(
        render_fields(
            [
                ("cause", failure["cause"]),
                ("kind", failure["kind"]),
                ("state", failure["state"]),
                ("machine rank", failure["rank"]),
                ("tier", failure["tier"] or "-"),
                ("iterations lost", failure["iterations_lost"]),
            ]
        )
    )
    print()
    print("Phases")
    print(table(("PHASE", "AT", "TOOK"), phase_rows(failure, datetime.now(UTC)), indent="  "))
    print()
    if plan is not None:
        if plan["iteration"] is not None:
            resume = f"resume from iteration {plan['iteration']}"
        elif plan["sources"]:
            resume = "restart from scratch (nothing restorable)"
        else:
            resume = "no sources yet (collecting the machines' inventories), or a restart from scratch"
        print(f"Recovery plan {plan['id']} (generation {plan['generation']}): {resume}")
        if plan["reason"]:
            print(f"  reason: {plan['reason']}")
        rows = [
            (s["rank"], s["tier"], _source_text(s), (s.get("digest") or "")[:16] or None)
            for s in sorted(plan["sources"], key=lambda s: s["rank"])
        ]
        if rows:
            print(table(("RANK", "TIER", "SOURCE", "DIGEST"), rows, indent="  "))
    elif failure.get("plan_id") is not None:
        print(f"Recovery plan {failure['plan_id']}: no longer available")
    else:
        print("Recovery plan: none yet")
    details = dict(failure.get("details") or {})
    error = details.pop("error", None)
    if isinstance(error, dict) and error.get("message"):
        # The training process's uncaught exception (from its torchelastic error file), as Python prints it.
        print()
        print(f"Exception: {error['message']}")
        if error.get("traceback"):
            print("  " + str(error["traceback"]).rstrip().replace("\n", "\n  "))
    if details:
        print()
        print("Details")
        print(
            render_fields(
                [
                    (
                        key,
                        json.dumps(value, separators=(", ", ": "))
                        if isinstance(value, list | dict)
                        else value,
                    )
                    for key, value in details.items()
                ]
            )
        )
    return 0
