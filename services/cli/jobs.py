"""`castor jobs create|list|show|stop|delete|wait`: the public API's jobs, with the admin token."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.cli import render
from services.cli.client import CliClient, CliError, NotFound, Unreachable, jsonable, resolve_job
from services.cli.failures import FAILURE_HEADERS, _failure_rows
from services.cli.render import (
    _plural,
    format_ago,
    format_duration,
    format_time,
    print_json,
    render_fields,
    table,
)

JOB_STATES = ("pending", "running", "recovering", "failed", "completed", "stopped")


TERMINAL_STATES = frozenset({"failed", "completed", "stopped"})


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--env takes KEY=VALUE, not {pair!r}")
        env[key] = value
    return env


def jobs_create(client: CliClient, args: argparse.Namespace) -> int:
    command: list[str] = list(args.launch_command or [])
    if args.launch and not command:
        raise CliError("--launch needs the training command after --, e.g. --launch -- python train.py")
    if command and not args.launch:
        raise CliError("a training command after -- needs --launch (--launch -- python train.py)")
    body: dict[str, Any] = {
        "name": args.name,
        "machines": args.machines,
        "replicas": args.replicas,
        "procs_per_machine": args.procs_per_machine,
        "persist_every": args.persist_every,
        "keep_persisted": args.keep_persisted,
        "checkpoint_bytes_max": args.checkpoint_bytes_max,
        "placement": args.placement,
        "replication_policy": args.replication_policy,
    }
    if args.replication_bandwidth_gbps is not None:
        body["replication_bandwidth_gbps"] = args.replication_bandwidth_gbps
    if args.launch:
        launch: dict[str, Any] = {"command": command, "cwd": str(Path(args.cwd or os.getcwd()).resolve())}
        if args.env:
            launch["env"] = _parse_env(args.env)
        if not args.warm_start:
            launch["warm_start"] = False
        body["launch"] = launch
    job = client.document(client.api.create_job(body))
    if args.json:
        print_json(job)
        return 0
    token = job["worker_token"]
    # The token goes in a file: on the command line every user of the machine could read it.
    agent = ["castor", "agent", "--root", client.connection.root_url, "--job", job["id"]]
    agent += ["--token-file", "worker-token"]
    if not args.warm_start:
        agent.append("--no-warm-start")
    training = shlex.join(command) if command else "<training command>"
    procs = job["procs_per_machine"]
    print(
        f"Created job {job['name']} ({job['id']}): {job['state']}, {_plural(job['machines'], 'machine')} "
        f"({_plural(procs, 'process', 'processes')} each), {job['replicas']} replicas, "
        f"{job['placement_strategy']} placement"
    )
    print()
    print("  Worker token (shown only this once; the root keeps only its hash):")
    print()
    print(f"    {token}")
    print()
    print("  A machine of this job runs, with the token in the file worker-token (mode 600):")
    print(f"    {shlex.join(agent)} -- {training}")
    print()
    if args.launch:
        print(f"The root's local cloud operator starts the {_plural(job['machines'], 'machine')} itself.")
    else:
        print(f"Start {_plural(job['machines'], 'machine')} like that (one agent per machine).")
    print(f"Follow it with: castor jobs wait {job['name']} --state running")
    return 0


def _iteration(job: dict[str, Any]) -> object:
    return job.get("newest_iteration")


def jobs_list(client: CliClient, args: argparse.Namespace) -> int:
    page = client.document(client.api.jobs(state=args.state, limit=args.limit, offset=args.offset))
    if args.json:
        print_json(page)
        return 0
    items = page["items"]
    if not items:
        where = f" in state {args.state}" if args.state else ""
        print(f"no jobs{where}" + (f" at offset {args.offset}" if args.offset else ""))
        return 0
    now = datetime.now(UTC)
    rows = [
        (
            job["name"],
            job["state"],
            f"{job['machines_healthy']}/{job['machines']}",
            _iteration(job),
            job["failures"],
            job["checkpoints_per_minute"],
            format_ago(job["created_at"], now),
            job["id"],
        )
        for job in items
    ]
    print(table(("NAME", "STATE", "MACHINES", "ITERATION", "FAILURES", "CKPT/MIN", "CREATED", "ID"), rows))
    shown_to = page["offset"] + len(items)
    if page["offset"] or shown_to < page["total"]:
        more = f"; next page: --offset {shown_to}" if shown_to < page["total"] else ""
        print(f"\njobs {page['offset'] + 1}-{shown_to} of {page['total']}{more}")
    return 0


def _machine_iteration(machine: dict[str, Any]) -> int | None:
    local = (machine.get("summary") or {}).get("local") or {}
    values = [v for v in local.values() if isinstance(v, int)]
    return max(values) if values else None


def ettr_text(ettr: dict[str, Any] | None) -> str:
    """The measured ETTR and where the rest of the time went (docs/planning.md)."""
    if not ettr or ettr.get("ettr") is None:
        return "-"
    parts = [
        (label, ettr.get(key) or 0.0)
        for label, key in (
            ("detection", "detection_s"),
            ("replacement", "replacement_s"),
            ("restore", "restore_s"),
            ("warm-up", "warmup_s"),
            ("lost iterations", "lost_iterations_s"),
            ("checkpoint stalls", "checkpoint_overhead_s"),
        )
    ]
    wasted = ", ".join(f"{label} {format_duration(seconds)}" for label, seconds in parts if seconds > 0)
    # Four decimals, and below 1 never 1.0000 (rounded down then): 0.99996 is not a job that lost nothing.
    ratio = ettr["ettr"]
    if ratio < 1 and round(ratio, 4) >= 1:
        ratio = math.floor(ratio * 10_000) / 10_000
    text = f"{ratio:.4f} of {format_duration(ettr['wall_s'])}"
    text += f" (wasted: {wasted})" if wasted else " (nothing wasted)"
    if ettr.get("checkpoint_overhead_s") is None:
        text += "; checkpoint stalls not measured"
    return text


def _job_fields(
    job: dict[str, Any], now: datetime, machines: Sequence[dict[str, Any]] = ()
) -> list[tuple[str, object]]:
    per_minute = job["checkpoints_per_minute"]
    checkpoints = f"{job['checkpoints_committed']} committed, {job['checkpoints_skipped']} saves skipped"
    # Replication's skips are another count: commits never sent to a peer because a newer one came.
    replicas_skipped = sum(int((m.get("summary") or {}).get("replicas_skipped") or 0) for m in machines)
    if replicas_skipped:
        checkpoints += f", {replicas_skipped} replicas skipped"
    if per_minute is not None:
        checkpoints += f", {per_minute:.1f}/min"
    persist = (
        f"every {job['persist_every']} iterations, keep {job['keep_persisted']}"
        if job["persist_every"]
        else "off"
    )
    on_storage = [
        f"machine {m['rank']} ({filesystem})"
        for m in machines
        if isinstance(filesystem := (m.get("summary") or {}).get("store_filesystem"), str)
        and m.get("state") != "replaced"
    ]
    storage = (
        [
            (
                "checkpoint store",
                "on storage, not memory: " + ", ".join(on_storage) + " (give --shm-dir a tmpfs)",
            )
        ]
        if on_storage
        else []
    )
    return [
        ("id", job["id"]),
        ("state", job["state"]),
        (
            "machines",
            f"{job['machines']} ({job['machines_healthy']} healthy), "
            f"{_plural(job['procs_per_machine'], 'process', 'processes')} each",
        ),
        ("replicas", f"{job['replicas']} ({job['placement_strategy']} placement)"),
        ("persistent tier", persist),
        ("iteration", job["newest_iteration"]),
        ("checkpoints", checkpoints),
        *storage,
        ("failures", f"{job['failures']}, {format_duration(job['wasted_time_s'])} wasted"),
        ("ETTR", ettr_text(job.get("ettr"))),
        ("created", format_time(job["created_at"], now)),
        ("started", format_time(job["started_at"], now)),
        ("finished", format_time(job["finished_at"], now)),
    ]


def jobs_show(client: CliClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    machines = client.document(client.api.machines(job["id"], history=args.history))
    try:
        placement = client.document(client.api.placement(job["id"]))
    except NotFound:
        placement = None
    if args.json:
        failures = client.document(client.api.failures(job["id"]))  # every page
        print_json({"job": job, "machines": machines, "placement": placement, "failures": failures})
        return 0
    # The newest --failures only (one bounded request), and how many the job has (X-Total-Count).
    page = client.run(client.api.failures_page(job["id"], limit=max(1, args.failures)))
    failures = jsonable(page.items)[: args.failures]
    total_failures = page.total if page.total is not None else len(failures)
    now = datetime.now(UTC)
    print(f"Job {job['name']}")
    print(render_fields(_job_fields(job, now, [m for m in machines if m["state"] != "replaced"])))
    print()
    if machines:
        print(f"Machines ({len(machines)} of {job['machines']} registered)")
        rows = [
            (
                m["rank"],
                m["state"],
                m["instance_id"],
                m["hostname"] or None,
                f"{m['address']}:{m['data_port']}",
                format_ago(m["last_heartbeat_at"], now),
                _machine_iteration(m),
                format_ago(m["registered_at"], now),
            )
            for m in machines
        ]
        headers = ("RANK", "STATE", "INSTANCE", "HOST", "DATA PLANE", "HEARTBEAT", "ITERATION", "REGISTERED")
        print(table(headers, rows, indent="  "))
    else:
        print(f"Machines: none registered yet (0 of {job['machines']})")
    print()
    if placement is not None:
        print(
            f"Placement: {placement['strategy']}, {placement['machines']} machines, "
            f"{placement['replicas']} replicas"
        )
        groups = [
            (g["index"], g["kind"], ", ".join(str(r) for r in g["members"])) for g in placement["groups"]
        ]
        print(table(("GROUP", "KIND", "MEMBERS"), groups, indent="  "))
        probabilities = sorted(placement["recovery_probability"].items(), key=lambda kv: int(kv[0]))
        print("  recovery from CPU memory when k machines fail at once:")
        print("    " + "   ".join(f"k={k}: {p:.3f}" for k, p in probabilities))
        print()
    if failures:
        print(f"Recent failures ({len(failures)} of {total_failures})")
        print(table(FAILURE_HEADERS, _failure_rows(failures, now), indent="  "))
        if total_failures > len(failures):
            print(f"  ... `castor failures list {job['name']}` shows all {total_failures}")
    elif total_failures:
        print(f"Failures: {total_failures} (`castor failures list {job['name']}` shows them)")
    else:
        print("Failures: none")
    return 0


def jobs_stop(client: CliClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    stopped = client.document(client.api.stop_job(job["id"]))
    if args.json:
        print_json(stopped)
    else:
        print(f"Stopped job {stopped['name']} ({stopped['id']}): its agents stop training and exit")
    return 0


def jobs_delete(client: CliClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    if not args.yes and sys.stdin.isatty():
        question = (
            f"Delete job {job['name']} ({job['id']}, {job['state']}) and its history: machines, failures, "
            "recovery plans, persisted checkpoint records? [y/N] "
        )
        try:
            answer = input(question)
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise CliError("not deleted")
    client.run(client.api.delete_job(job["id"]))
    if args.json:
        print_json({"deleted": True, "id": job["id"], "name": job["name"]})
    else:
        print(f"Deleted job {job['name']} ({job['id']})")
    return 0


def progress_text(job: dict[str, Any], note: str = "") -> str:
    """The state line `castor jobs wait` shows beside its spinner (rich adds the time waited)."""
    iteration = job.get("newest_iteration")
    parts = [
        f"{job['name']}: {job['state']}",
        f"iteration {iteration if iteration is not None else '-'}",
        f"machines {job['machines_healthy']}/{job['machines']} healthy",
        f"failures {job['failures']}",
    ]
    if note:
        parts.append(note)
    return "  ".join(parts)


def jobs_wait(
    client: CliClient,
    args: argparse.Namespace,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    job = resolve_job(client, args.job)
    target: str = args.state
    console = render.stderr_console()
    started = clock()
    note = ""
    with render.wait_progress(console, console.is_terminal and not args.quiet) as progress:
        task = progress.add_task(progress_text(job), total=None)
        while True:
            elapsed = clock() - started
            state = job["state"]
            if state == target:
                break
            if state in TERMINAL_STATES:
                raise CliError(f"job {job['name']} ended in state {state}, not {target}")
            if args.timeout is not None and elapsed >= args.timeout:
                raise CliError(
                    f"timed out after {format_duration(elapsed)}: job {job['name']} is {state}, not {target}"
                )
            progress.update(task, description=progress_text(job, note))
            sleep(args.interval)
            try:
                job = client.document(client.api.job(job["id"]))
                note = ""
            except NotFound:
                raise CliError(f"job {job['name']} was deleted while waiting") from None
            except Unreachable:
                note = "(root unreachable, retrying)"  # a root replica failing over; keep waiting
    elapsed = clock() - started
    if args.json:
        print_json(job)
    else:
        iteration = job.get("newest_iteration")
        at = f" at iteration {iteration}" if iteration is not None else ""
        print(f"job {job['name']} is {job['state']}{at} (waited {format_duration(elapsed)})")
    return 0
