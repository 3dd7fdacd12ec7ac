"""Operator commands of the `castor` CLI: `castor jobs ...` and `castor failures ...`.

They talk to a running root service over its public REST API with the admin token. Everything here is
plain and synchronous: an httpx client wrapper that turns every expected problem (unreachable root, bad
token, unknown job, a 409/422 from the server) into one clear line and exit code 1, the command functions,
human durations and relative timestamps, and `castor jobs watch`'s view. Tables, colours, progress bars
and the live view are rich's, set up in `services/cli_render.py`. `--json` prints the API's JSON as one
document instead.

The parsers are declared in `services/cli.py`; this module is imported only when one of these commands
runs, so `castor --help` does not pay for httpx.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import httpx
from rich.console import Console

from services import cli_render
from worker_lib import rest

DEFAULT_ROOT_URL = "http://127.0.0.1:8080"
JOB_STATES = ("pending", "running", "recovering", "failed", "completed", "stopped")
TERMINAL_STATES = frozenset({"failed", "completed", "stopped"})
API = "/api/v1"


# ---- errors -----------------------------------------------------------------------------------------------


class CliError(Exception):
    """An expected problem: printed as one line, exit code 1, never a traceback."""

    exit_code = 1


class Unreachable(CliError):
    """The root service did not answer (connection refused, DNS, timeout)."""


class ApiError(CliError):
    def __init__(self, message: str, *, status: int, code: str):
        super().__init__(message)
        self.status = status
        self.code = code


class NotFound(ApiError):
    pass


# ---- connection -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Connection:
    root_url: str
    token: str
    token_source: str


def resolve_connection(
    root: str | None, token: str | None, environ: dict[str, str] | None = None, cwd: Path | None = None
) -> Connection:
    """--root / CASTOR_ROOT_URL / the default; --token / CASTOR_ADMIN_TOKEN / the admin-token file the
    embedded service writes into its state directory ($CASTOR_STATE_DIR, else .castor)."""
    env = dict(os.environ) if environ is None else environ
    url = (root or env.get("CASTOR_ROOT_URL") or DEFAULT_ROOT_URL).rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if token:
        return Connection(url, token, "--token")
    if env.get("CASTOR_ADMIN_TOKEN"):
        return Connection(url, env["CASTOR_ADMIN_TOKEN"], "CASTOR_ADMIN_TOKEN")
    here = cwd or Path.cwd()
    candidates = []
    if env.get("CASTOR_STATE_DIR"):
        candidates.append(Path(env["CASTOR_STATE_DIR"]) / "admin-token")
    candidates.append(Path(".castor") / "admin-token")
    for candidate in candidates:
        path = candidate if candidate.is_absolute() else here / candidate
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return Connection(url, text, f"the file {candidate}")
    raise CliError(
        "no admin token: pass --token or set CASTOR_ADMIN_TOKEN (a service that generated its token keeps it "
        "in $CASTOR_STATE_DIR/admin-token, default .castor/admin-token; `castor serve` prints where)"
    )


def mask_token(token: str) -> str:
    """Enough of a token to tell which one it was, not enough to use it."""
    prefix, dot, secret = token.rpartition(".")
    if dot and prefix and len(secret) > 8:
        return f"{prefix}.{secret[:4]}..."
    return f"{token[: 4 if len(token) > 12 else 1]}... ({len(token)} characters)"


class RootClient:
    """The public API with the admin token; raises CliError subclasses for every expected failure."""

    def __init__(
        self,
        connection: Connection,
        *,
        timeout: float = 10.0,
        transport: Any = None,
        retry_for_s: float = 5.0,
    ):
        self.connection = connection
        self.timeout = timeout
        self.retry_for_s = retry_for_s
        try:
            self._http = httpx.Client(
                base_url=connection.root_url,
                headers={"Authorization": f"Bearer {connection.token}", "User-Agent": "castor-cli"},
                timeout=timeout,
                transport=transport,
            )
        except (httpx.InvalidURL, ValueError) as exc:
            raise CliError(f"bad root URL {connection.root_url!r}: {exc}") from None

    def __enter__(self) -> RootClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._http.close()

    def request(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, body: Any = None
    ) -> Any:
        url = self.connection.root_url
        # Reads are retried (worker_lib.rest's tenacity policy, as the agent's calls are) when the answer
        # failed on the way: a 5xx or a dropped connection, as while a root replica restarts. Writes are
        # sent once: a POST that reached the root before its answer was lost must not run twice.
        budget = self.retry_for_s if method == "GET" else 0.0
        retrier = rest.retrying(budget, asynchronous=False, retry_on=rest.DROPPED, reraise=True)
        try:
            for attempt in retrier:
                with attempt:
                    response = rest.raise_for_server_error(
                        self._http.request(method, path, params=params, json=body)
                    )
        except rest.ServerError as exc:
            response = exc.response
        except httpx.TimeoutException:
            raise Unreachable(
                f"the root service at {url} did not answer within {self.timeout:g} s; is it overloaded "
                "or stuck? set --root or CASTOR_ROOT_URL to use another replica"
            ) from None
        except httpx.ConnectError as exc:
            raise Unreachable(
                f"cannot reach the root service at {url}: {_connect_reason(exc)}; is `castor serve` "
                "running? set --root or CASTOR_ROOT_URL"
            ) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise Unreachable(
                f"cannot talk to the root service at {url}: {exc or type(exc).__name__}"
            ) from None
        if response.status_code >= 400:
            raise self._error(response, path)
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise CliError(
                f"{url}{path} answered HTTP {response.status_code} with something other than JSON; is that "
                "URL a Castor root service?"
            ) from None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None} or None)

    def _error(self, response: httpx.Response, path: str) -> ApiError:
        status = response.status_code
        code, message = rest.api_error(response, limit=300)  # the error shape, read as the agent reads it
        conn = self.connection
        used = f"the admin token {mask_token(conn.token)} from {conn.token_source}"
        if status == 401:
            return ApiError(
                f"the root service at {conn.root_url} rejected {used}: {message}. Use the service's admin "
                "token (--token or CASTOR_ADMIN_TOKEN; `castor serve` prints where it keeps it)",
                status=status,
                code=code,
            )
        if status == 403:
            return ApiError(
                f"{used} may not do this: {message}. The operator commands need the admin token, not a "
                "job's worker token",
                status=status,
                code=code,
            )
        if status == 404:
            if code in ("not_found", f"http_{status}"):  # no such route: not a Castor root at this URL
                message = (
                    f"{conn.root_url}{path} does not exist (HTTP 404); is {conn.root_url} the base URL of "
                    "a Castor root service? set --root or CASTOR_ROOT_URL"
                )
            return NotFound(message, status=status, code=code)
        if status >= 500:
            return ApiError(f"the root service failed (HTTP {status}): {message}", status=status, code=code)
        return ApiError(f"{message} ({code})", status=status, code=code)


def _connect_reason(exc: httpx.ConnectError) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text or "connection failed"


# ---- rendering --------------------------------------------------------------------------------------------


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def format_duration(seconds: float | None) -> str:
    """1.2 s, 45 s, 3 min, 3 min 12 s, 2 h 5 min, 3 d 4 h."""
    if seconds is None:
        return "-"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0 s"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    total = round(seconds)
    if total < 3600:
        minutes, secs = divmod(total, 60)
        return f"{minutes} min {secs} s" if secs and minutes < 10 else f"{minutes} min"
    if total < 86400:
        hours, rest = divmod(total, 3600)
        return f"{hours} h {rest // 60} min" if rest >= 60 else f"{hours} h"
    days, rest = divmod(total, 86400)
    return f"{days} d {rest // 3600} h" if rest >= 3600 else f"{days} d"


def format_ago(value: str | datetime | None, now: datetime | None = None) -> str:
    """A timestamp relative to now: "12 s ago", "3 min ago"; "-" when there is none."""
    moment = parse_time(value) if isinstance(value, str) or value is None else value
    if moment is None:
        return "-"
    delta = ((now or datetime.now(UTC)) - moment).total_seconds()
    if abs(delta) < 1:
        return "just now"
    if delta < 0:
        return "in " + _coarse(-delta)
    return _coarse(delta) + " ago"


def _coarse(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def format_time(value: str | datetime | None, now: datetime | None = None) -> str:
    """An absolute local timestamp, with the relative one after it."""
    moment = parse_time(value) if isinstance(value, str) or value is None else value
    if moment is None:
        return "-"
    local = moment.astimezone()
    return f"{local:%Y-%m-%d %H:%M:%S} {local.tzname() or ''} ({format_ago(moment, now)})".replace("  ", " ")


_cell = cell = cli_render.cell
to_text = cli_render.to_text


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "") -> str:
    """Aligned columns, two spaces apart; numeric columns right-aligned, the last column not padded;
    plain text (a rich table laid out at an unlimited width)."""
    return cli_render.render_table(headers, rows, indent)


@functools.cache
def _stdout() -> Console:
    return cli_render.stdout_console()


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], indent: str = "") -> str:
    """render_table for stdout: the same layout, with state colours when stdout is a colour terminal."""
    return cli_render.render_table(headers, rows, indent, like=_stdout())


def render_fields(pairs: Sequence[tuple[str, object]], indent: str = "  ") -> str:
    width = max(len(key) for key, _ in pairs) + 1
    return "\n".join(f"{indent}{(key + ':').ljust(width)}  {_cell(value)}" for key, value in pairs)


def shorten(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_json(document: Any, out: TextIO | None = None) -> None:
    print(json.dumps(document, indent=2, ensure_ascii=False), file=out or sys.stdout)


# ---- jobs -------------------------------------------------------------------------------------------------


def resolve_job(client: RootClient, ref: str) -> dict[str, Any]:
    """A job by id or by name (names are unique; looked up through the list)."""
    try:
        uuid.UUID(ref)
    except ValueError:
        pass
    else:
        try:
            job: dict[str, Any] = client.get(f"{API}/jobs/{ref}")
            return job
        except NotFound:
            pass  # a name may look like an id
    offset = 0
    while True:
        page = client.get(f"{API}/jobs", limit=500, offset=offset)
        for item in page["items"]:
            if item["name"] == ref:
                found: dict[str, Any] = item
                return found
        offset += len(page["items"])
        if not page["items"] or offset >= page["total"]:
            break
    raise NotFound(
        f"no job with id or name {ref!r} on {client.connection.root_url} (`castor jobs list` shows the jobs)",
        status=404,
        code="job_not_found",
    )


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--env takes KEY=VALUE, not {pair!r}")
        env[key] = value
    return env


def jobs_create(client: RootClient, args: argparse.Namespace) -> int:
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
    job = client.request("POST", f"{API}/jobs", body=body)
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


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _iteration(job: dict[str, Any]) -> object:
    return job.get("newest_iteration")


def jobs_list(client: RootClient, args: argparse.Namespace) -> int:
    page = client.get(f"{API}/jobs", state=args.state, limit=args.limit, offset=args.offset)
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
    """The measured ETTR and where the rest of the time went (README: "Planning a cluster")."""
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
    text = f"{ettr['ettr']:.4f} of {format_duration(ettr['wall_s'])}"
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
        ("failures", f"{job['failures']}, {format_duration(job['wasted_time_s'])} wasted"),
        ("ETTR", ettr_text(job.get("ettr"))),
        ("created", format_time(job["created_at"], now)),
        ("started", format_time(job["started_at"], now)),
        ("finished", format_time(job["finished_at"], now)),
    ]


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


def jobs_show(client: RootClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    base = f"{API}/jobs/{job['id']}"
    machines = client.get(f"{base}/machines", history="true" if args.history else None)
    try:
        placement = client.get(f"{base}/placement")
    except NotFound:
        placement = None
    failures = client.get(f"{base}/failures")
    if args.json:
        print_json({"job": job, "machines": machines, "placement": placement, "failures": failures})
        return 0
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
        recent = failures[: args.failures]
        print(f"Recent failures ({len(recent)} of {len(failures)})")
        print(table(FAILURE_HEADERS, _failure_rows(recent, now), indent="  "))
        if len(failures) > len(recent):
            print(f"  ... `castor failures list {job['name']}` shows all {len(failures)}")
    else:
        print("Failures: none")
    return 0


def jobs_stop(client: RootClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    stopped = client.request("POST", f"{API}/jobs/{job['id']}/stop")
    if args.json:
        print_json(stopped)
    else:
        print(f"Stopped job {stopped['name']} ({stopped['id']}): its agents stop training and exit")
    return 0


def jobs_delete(client: RootClient, args: argparse.Namespace) -> int:
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
    client.request("DELETE", f"{API}/jobs/{job['id']}")
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
    client: RootClient,
    args: argparse.Namespace,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    job = resolve_job(client, args.job)
    target: str = args.state
    console = cli_render.stderr_console()
    started = clock()
    note = ""
    with cli_render.wait_progress(console, console.is_terminal and not args.quiet) as progress:
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
                job = client.get(f"{API}/jobs/{job['id']}")
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


# ---- jobs watch -------------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """What `castor jobs watch` shows: the job, its current machines and its failures (newest first)."""

    job: dict[str, Any]
    machines: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    note: str = ""


def take_snapshot(client: RootClient, job_id: str) -> Snapshot:
    base = f"{API}/jobs/{job_id}"
    job = client.get(base)
    machines = [m for m in client.get(f"{base}/machines") if m["state"] != "replaced"]
    return Snapshot(job, sorted(machines, key=lambda m: m["rank"]), client.get(f"{base}/failures"))


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
        cli_render.styled(job["state"]),
        f"  iteration {cell(job.get('newest_iteration'))}",
        f"  machines {job['machines_healthy']}/{job['machines']} healthy",
        f"  failures {job['failures']}",
    )
    if snapshot.note:
        header.append(f"  {snapshot.note}", style="yellow")
    replication = Text("Replication: ")
    if job.get("replication_state") is not None:
        replication.append_text(cli_render.styled(job["replication_state"]))
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
        parts.append(Padding(cli_render.make_table(headers, rows), (0, 0, 0, 2), expand=False))
    else:
        parts.append(Text(f"Machines: none registered yet (0 of {job['machines']})"))
    parts.append(Text(""))
    if snapshot.failures:
        failure = snapshot.failures[0]  # newest first: the recovery in progress, else the last one
        number = f"#{failure['number']}" if failure.get("number") is not None else str(failure["id"])
        title = Text(f"Recovery of failure {number} ({failure['kind']}, rank {cell(failure['rank'])}): ")
        title.append_text(cli_render.styled(failure["state"]))
        title.append(f"  {shorten(failure['cause'])}")
        parts.append(title)
        phases = cli_render.make_table(("PHASE", "AT", "TOOK"), phase_rows(failure, now))
        parts.append(Padding(phases, (0, 0, 0, 2), expand=False))
    else:
        parts.append(Text("Failures: none"))
    return Group(*parts)


def jobs_watch(
    client: RootClient,
    args: argparse.Namespace,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Refresh a job's view every --interval seconds until the job ends (exit 0; 1 when it failed) or
    Ctrl-C (130). On a terminal the view is redrawn in place (rich.live.Live); elsewhere (a pipe, a log)
    it prints one line per change of the job's state and the full view once at the end; with --json only
    the last snapshot, as one document {"job", "machines", "failures"}."""
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


# ---- failures ---------------------------------------------------------------------------------------------


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


def failures_list(client: RootClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    failures = client.get(f"{API}/jobs/{job['id']}/failures")
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


def failures_show(client: RootClient, args: argparse.Namespace) -> int:
    job = resolve_job(client, args.job)
    failure = client.get(f"{API}/jobs/{job['id']}/failures/{args.failure_id}")
    plan = None
    if failure.get("plan_id") is not None:
        plans = client.get(f"{API}/jobs/{job['id']}/recovery-plans")
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


# ---- checkpoints export -----------------------------------------------------------------------------------


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def transfer_text(phase: str, done: int, total: int) -> str:
    """What an export's progress bar is doing: "downloading 1/2 ranks", "writing 3.0 MiB / 8.0 MiB"."""
    if phase == "download":
        return f"downloading {done}/{total} ranks"
    return f"writing {format_bytes(done)} / {format_bytes(total)}"


def checkpoints_export(client: RootClient, args: argparse.Namespace) -> int:
    """Download a persisted checkpoint's shards and write them as one standard DCP directory."""
    job = resolve_job(client, args.job)
    persisted: list[dict[str, Any]] = client.get(f"{API}/jobs/{job['id']}/checkpoints")
    have = ", ".join(str(c["iteration"]) + ("" if c["complete"] else " (incomplete)") for c in persisted)
    in_memory = (
        "an iteration held only in memory is exported from the job's ranks with worker_lib.export_dcp "
        '(README "torch.distributed.checkpoint (DCP)")'
    )
    if args.iteration is None:
        chosen = next((c for c in persisted if c["complete"]), None)
        if chosen is None:
            raise CliError(
                f"job {job['name']} has no complete persisted checkpoint ({have or 'none'}); {in_memory}"
            )
    else:
        chosen = next((c for c in persisted if c["iteration"] == args.iteration), None)
        if chosen is None:
            raise CliError(
                f"job {job['name']} has no persisted checkpoint of iteration {args.iteration} (persisted: "
                f"{have or 'none'}); {in_memory}"
            )
    if not chosen["complete"]:
        ranks = sorted(s["rank"] for s in chosen["shards"])
        raise CliError(
            f"iteration {chosen['iteration']} of job {job['name']} is incomplete (ranks {ranks} only)"
        )
    target = Path(args.to)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CliError(f"{target} exists and is not an empty directory")
    target.mkdir(parents=True, exist_ok=True)
    shards = sorted(chosen["shards"], key=lambda s: s["rank"])
    if [s["rank"] for s in shards] != list(range(len(shards))):
        raise CliError(f"iteration {chosen['iteration']}: the shards' ranks are not 0..{len(shards) - 1}")

    from worker_lib.errors import CheckpointError
    from worker_lib.export import export_persisted, persisted_store

    endpoint = (
        args.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    )
    console = cli_render.stderr_console()
    bar = cli_render.transfer_progress(console, console.is_terminal and not args.json)
    task = bar.add_task("", total=None)

    def progress(phase: str, done: int, total: int) -> None:
        # One bar for both phases: each starts it over with its own total (ranks, then bytes). A phase's
        # end is drawn at once: a small export can finish between two of rich's timed refreshes.
        bar.update(
            task,
            completed=done,
            total=total or 1,
            description=transfer_text(phase, done, total),
            refresh=done >= total,
        )

    started = time.monotonic()
    bar.start()
    try:
        store = persisted_store(chosen["location"], shards[0]["key"], endpoint_url=endpoint)
        metadata = export_persisted(
            store,
            [(s["key"], s["digest"]) for s in shards],
            chosen["iteration"],
            target,
            scratch=args.scratch or target.resolve().parent,
            progress=progress,
        )
    except (CheckpointError, OSError) as exc:
        raise CliError(f"exporting iteration {chosen['iteration']}: {exc}") from None
    finally:
        bar.stop()
    document = {
        "job": job["name"],
        "iteration": chosen["iteration"],
        "ranks": len(shards),
        "directory": str(target.resolve()),
        "entries": len(metadata.state_dict_metadata),
        "bytes": sum(f.stat().st_size for f in target.iterdir() if f.is_file()),
        "seconds": round(time.monotonic() - started, 3),
    }
    if args.json:
        print_json(document)
    else:
        print(
            f"Exported iteration {document['iteration']} of {job['name']} ({document['ranks']} ranks, "
            f"{document['entries']} entries, {format_bytes(document['bytes'])}) to {document['directory']}\n"
            f"Load it with torch.distributed.checkpoint.load(state, "
            f"storage_reader=FileSystemReader({str(document['directory'])!r})), at any world size."
        )
    return 0


# ---- entry point ------------------------------------------------------------------------------------------

COMMANDS: dict[str, Callable[[RootClient, argparse.Namespace], int]] = {
    "jobs_create": jobs_create,
    "jobs_list": jobs_list,
    "jobs_show": jobs_show,
    "jobs_stop": jobs_stop,
    "jobs_delete": jobs_delete,
    "jobs_wait": jobs_wait,
    "jobs_watch": jobs_watch,
    "failures_list": failures_list,
    "failures_show": failures_show,
    "checkpoints_export": checkpoints_export,
}


def run(args: argparse.Namespace) -> int:
    """Run the operator command `args.ops` (a COMMANDS key); expected problems become one line on stderr
    and exit code 1."""
    command = COMMANDS[args.ops]
    try:
        connection = resolve_connection(args.root, args.token)
        with RootClient(connection, timeout=args.request_timeout) as client:
            return command(client, args)
    except CliError as exc:
        print(f"castor: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `castor jobs list | head`: stop quietly, and keep the interpreter from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
