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
    parse_time,
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


def _seconds_between(start: str | None, end: str | None) -> float | None:
    first, last = parse_time(start), parse_time(end)
    if first is None or last is None:
        return None
    return (last - first).total_seconds()


PHASES = (
    ("detected_at", "detect"),
    ("classified_at", "classify"),
    ("replaced_at", "replace"),
    ("restored_at", "restore"),
    ("resumed_at", "resume"),
)


def phase_rows(failure: dict[str, Any], now: datetime | None = None) -> list[tuple[str, str, str]]:
    """Each phase with when it ended and how long it took since the previous phase that happened.
    A phase without a timestamp after a later one happened was skipped (a software failure needs no
    replacement); without any later one it is still pending."""
    rows: list[tuple[str, str, str]] = []
    previous: str | None = None
    stamps = [failure.get(key) for key, _ in PHASES]
    for index, (key, name) in enumerate(PHASES):
        stamp = failure.get(key)
        if stamp is None:
            later = any(s is not None for s in stamps[index + 1 :])
            rows.append((name, "-", "skipped" if later else "pending"))
            continue
        took = "" if previous is None else format_duration(_seconds_between(previous, stamp))
        rows.append((name, format_time(stamp, now), took))
        previous = stamp
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
