"""Load harness of the control plane: many simulated machines against the real root service; the last line
printed is JSON.

    .venv/bin/python benchmarks/scale.py                       # 1,000 machines x 8 processes, 10 min steady
    .venv/bin/python benchmarks/scale.py --machines 200 --steady 60
    .venv/bin/python benchmarks/scale.py --quick               # 50 machines, 5 s steady: checks that it runs

The root runs as in production (`python -m services.cli serve`, one uvicorn process, REST heartbeats) on a
throwaway Postgres started the way the tests start it (tests/harness.py). The machines are asyncio tasks in
this process (no torch, no shared memory, no data plane), each speaking the worker API as an agent does
(worker_lib.client.RootClient over one shared connection pool): register; long-poll its machine's directive
(`machine=`, as an agent does); report `restored` and `resumed` for the first plan; heartbeat every
interval with a summary of its P ranks whose iterations advance; re-fetch the directive every
PEERS_REFRESH_S as an agent refreshes its peers.

Scenarios, in order:
* register all: every machine registers at once; `register_all_s` until the last one got its rank;
  `start_directives_s` from then (the last registration releases the first plan) until every machine's
  long poll has answered with it (`directives_s` of the issue, for the first plan: no recovery is run);
  `directive_bytes` the largest directive a machine was sent;
* steady state (--steady seconds): heartbeats and progress; `heartbeat_p50_ms`/`heartbeat_p99_ms` as the
  machines see them (send to answer, this process's own event-loop lag included), `false_positives` the
  failure events recorded meanwhile (none is expected), `root_cpu_pct` the root process's CPU use (100: one
  core busy);
* pages: `job_page_ms` (the job's status page, signed in) and `metrics_ms` (/metrics) with every machine
  registered and --past-failures recovered failures in the database (median of 5 each);
* one machine lost: one machine stops heartbeating; `detect_s` from its last answered heartbeat to the
  failure event's detection (the heartbeat timeout, and the suspect grace after it, bound it from below).

--interval and --timeout set the root's REST heartbeat interval and timeout (defaults: the root's, 1 s and
3 s); at 1,000 machines on a 2-core host a longer interval is what the host can carry (README, "Scale").

Not simulated (see the README's "Scale"): etcd leases (the REST heartbeat mode only), recoveries after the
loss, persisted shards.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import harness  # noqa: E402
from worker_lib.api.worker import RegisterResponse  # noqa: E402
from worker_lib.client import RootClient, RootRejected, RootUnavailable  # noqa: E402

ADMIN_TOKEN = "castor-admin.scale-benchmark"
PEERS_REFRESH_S = 10.0  # worker_lib.agent.services.PEERS_REFRESH_S
DIRECTIVE_FIELDS = {
    "revision": re.compile(r'"revision":\s*(-?\d+)'),
    "status": re.compile(r'"status":\s*"(\w+)"'),
    "generation": re.compile(r'"generation":\s*(\d+)'),
}


@dataclass
class Stats:
    heartbeat_ms: list[float] = field(default_factory=list)
    progress_ms: list[float] = field(default_factory=list)
    directive_ms: list[float] = field(default_factory=list)
    directive_bytes: int | None = None
    ready_at: list[float] = field(default_factory=list)  # monotonic: each machine's first ready directive
    errors: dict[str, int] = field(default_factory=dict)
    recording: bool = False

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


class SimulatedMachine:
    """One machine's agent, as far as the root can tell: its requests, at an agent's pace."""

    def __init__(self, rank: int, client: RootClient, procs: int, interval_s: float, stats: Stats):
        self.rank, self.client, self.procs, self.interval_s, self.stats = (
            rank,
            client,
            procs,
            interval_s,
            stats,
        )
        self.instance_id = f"sim-{rank:05d}"
        self.alive = True
        self.last_answered = 0.0  # wall clock of the last heartbeat the root answered
        self.started = time.monotonic()

    def summary(self) -> dict[str, Any]:
        iteration = int((time.monotonic() - self.started) * 2)
        ranks = range(self.rank * self.procs, (self.rank + 1) * self.procs)
        return {
            "local": {str(r): iteration for r in ranks},
            "replicas": {},
            "committed": iteration * self.procs,
            "skipped": 0,
            "per_minute": 120.0,
            "stalled_s": {str(r): 0.001 * iteration for r in ranks},
            "save_calls": {str(r): iteration for r in ranks},
        }

    async def register(self) -> RegisterResponse:
        return await self.client.register(
            instance_id=self.instance_id,
            address="127.0.0.1",
            data_port=20000 + self.rank % 40000,
            hostname=self.instance_id,
            rank=self.rank,
            rendezvous_port=30000 + self.rank % 30000,
        )

    async def directive(self, after: int, wait_s: float) -> dict[str, Any]:
        """The directive's leading fields only. A real agent parses the whole of its machine's directive on
        its own host (an older root answers with the whole job's: about a megabyte at 1,000 x 8); a thousand
        of them parsed in this one process would make the harness, not the root, the bottleneck."""
        url = f"{self.client.urls[0]}/api/v1/worker/jobs/{self.client.job_id}/directive"
        for attempt in range(30):
            try:
                response = await self.client._http.get(
                    url, params={"after": after, "wait": wait_s, "machine": self.rank}, timeout=wait_s + 30
                )
                if response.status_code < 500:
                    break
            except httpx.TransportError:
                pass
            if attempt == 29:
                raise RootUnavailable(f"no directive after {attempt + 1} attempts")
            await asyncio.sleep(1)
        if response.status_code >= 400:
            raise RootRejected(response.status_code, "http_error", response.text[:200])
        self.stats.directive_bytes = max(self.stats.directive_bytes or 0, len(response.content))
        head = response.content[:400].decode(errors="replace")
        fields = {key: DIRECTIVE_FIELDS[key].search(head) for key in DIRECTIVE_FIELDS}
        if not all(fields.values()):
            raise RootRejected(response.status_code, "bad_directive", head)
        return {
            "revision": int(fields["revision"].group(1)),  # type: ignore[union-attr]
            "status": fields["status"].group(1),  # type: ignore[union-attr]
            "generation": int(fields["generation"].group(1)),  # type: ignore[union-attr]
        }

    async def heartbeats(self) -> None:
        await asyncio.sleep(random.random() * self.interval_s)  # agents start at different moments
        while self.alive:
            sent = time.monotonic()
            try:
                await self.client.heartbeat(self.rank, self.instance_id, self.summary())
                if self.alive:
                    self.last_answered = time.time()
                if self.stats.recording:
                    self.stats.heartbeat_ms.append((time.monotonic() - sent) * 1000)
            except (RootRejected, RootUnavailable) as exc:
                self.stats.error(f"heartbeat: {type(exc).__name__}")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - sent)))

    async def directives(self) -> None:
        """The agent's directive long poll; on the first ready plan, `restored` then `resumed`."""
        revision, generation = -1, None
        while self.alive:
            try:
                directive = await self.directive(after=revision, wait_s=10)
            except (RootRejected, RootUnavailable) as exc:
                self.stats.error(f"directive: {type(exc).__name__}")
                await asyncio.sleep(1)
                continue
            revision = max(revision, directive["revision"])
            if directive["status"] == "ready" and directive["generation"] != generation:
                if generation is None:
                    self.stats.ready_at.append(time.monotonic())
                generation = directive["generation"]
                for event in ("restored", "resumed"):
                    body = {"instance_id": self.instance_id, "generation": generation, "event": event}
                    sent = time.monotonic()
                    try:
                        await self.client.report_progress(self.rank, body)
                        self.stats.progress_ms.append((time.monotonic() - sent) * 1000)
                    except (RootRejected, RootUnavailable) as exc:
                        self.stats.error(f"progress: {type(exc).__name__}")

    async def peer_refreshes(self) -> None:
        await asyncio.sleep(random.random() * PEERS_REFRESH_S)
        while self.alive:
            sent = time.monotonic()
            try:
                await self.directive(after=-1, wait_s=0)
                if self.stats.recording:
                    self.stats.directive_ms.append((time.monotonic() - sent) * 1000)
            except (RootRejected, RootUnavailable) as exc:
                self.stats.error(f"peers: {type(exc).__name__}")
            await asyncio.sleep(PEERS_REFRESH_S)


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def start_root(
    workdir: Path, database_url: str, args: argparse.Namespace
) -> tuple[subprocess.Popen[bytes], str]:
    port = harness.free_port()
    env = {
        **os.environ,
        "CASTOR_STATE_DIR": str(workdir / "root-state"),
        "CASTOR_DATABASE_URL": database_url,
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        "CASTOR_PORT": str(port),
        "CASTOR_HEARTBEAT_INTERVAL_S": str(args.interval),
        "CASTOR_HEARTBEAT_TIMEOUT_S": str(args.timeout),
    }
    log = (workdir / "root.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    harness.wait_for_port(port, process, timeout=120)
    return process, f"http://127.0.0.1:{port}"


def add_past_failures(server: harness.Postgres, database: str, job_id: str, count: int) -> None:
    """Recovered failures of the job's past, written straight into the database (no recovery is run)."""
    if count <= 0:
        return
    sql = (
        "INSERT INTO failure_events (job_id, rank, kind, state, cause, detected_at, classified_at, "
        "resumed_at, tier, iterations_lost, details) "
        f"SELECT '{job_id}', g % 7, 'software', 'recovered', 'past failure ' || g, "
        "now() - g * interval '1 minute', now() - g * interval '1 minute', "
        "now() - g * interval '1 minute' + interval '5 seconds', 'local', 1, '{}'::json "
        f"FROM generate_series(1, {count}) AS g"
    )
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres", "-d", database, "-Atc", sql],
        check=True,
        capture_output=True,
    )


async def timed_get(http: httpx.AsyncClient, url: str, times: int = 5, **kwargs: Any) -> float:
    took = []
    for _ in range(times):
        sent = time.monotonic()
        response = await http.get(url, **kwargs)
        response.raise_for_status()
        took.append((time.monotonic() - sent) * 1000)
    return round(statistics.median(took), 1)


async def failures_of(admin: httpx.AsyncClient, url: str, job_id: str) -> list[dict[str, Any]]:
    for attempt in range(10):  # an overloaded root drops a connection now and then: the figure is not that
        try:
            response = await admin.get(f"{url}/api/v1/jobs/{job_id}/failures")
            response.raise_for_status()
            break
        except httpx.HTTPError:
            if attempt == 9:
                raise
            await asyncio.sleep(1)
    body = response.json()
    return list(body["items"] if isinstance(body, dict) else body)


async def run(args: argparse.Namespace, server: harness.Postgres, database: str, url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(headers=headers, timeout=60) as admin:
        name = f"scale-{uuid.uuid4().hex[:6]}"
        body = {"name": name, "machines": args.machines, "procs_per_machine": args.procs, "replicas": 2}
        created = (await admin.post(f"{url}/api/v1/jobs", json=body)).raise_for_status().json()
        job_id, token = created["id"], created["worker_token"]

        stats = Stats()
        limits = httpx.Limits(
            max_connections=3 * args.machines + 50, max_keepalive_connections=3 * args.machines
        )
        shared = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(30.0, connect=10.0),
            limits=limits,
        )
        # One client, copied per machine (each copy keeps its own replica index), over one pool: a thousand
        # pools (and TLS contexts) would measure this process, not the root.
        base = RootClient(url, job_id, token, timeout_s=30.0, retry_for_s=900.0)
        await base._http.aclose()
        base._http = shared
        machines = [
            SimulatedMachine(rank, copy.copy(base), args.procs, args.interval, stats)
            for rank in range(args.machines)
        ]
        tasks: list[asyncio.Task[Any]] = []
        try:
            # -- register all
            started = time.monotonic()

            async def join(machine: SimulatedMachine) -> None:
                await machine.register()
                # As an agent: heartbeats and the directive from its registration on (a machine registered
                # early and silent until the last one registered would be suspect at the start).
                tasks.extend(
                    asyncio.create_task(work)
                    for work in (machine.heartbeats(), machine.directives(), machine.peer_refreshes())
                )

            await asyncio.gather(*(join(m) for m in machines))
            registered = time.monotonic()
            register_all_s = registered - started
            print(
                f"registered {args.machines} machines in {register_all_s:.1f}s", file=sys.stderr, flush=True
            )
            # Every machine resumed before the steady state counts.
            deadline = time.monotonic() + max(120.0, args.machines * 0.5)
            while time.monotonic() < deadline:
                if len(stats.progress_ms) >= 2 * args.machines:
                    break
                await asyncio.sleep(0.5)
            print(
                f"{len(stats.progress_ms)} progress reports after {time.monotonic() - started:.1f}s",
                file=sys.stderr,
                flush=True,
            )
            print(
                "first plan reached the machines after (s, quartiles):",
                [
                    round(quantile([t - registered for t in stats.ready_at], q) or 0, 2)
                    for q in (0.25, 0.5, 0.75, 1)
                ],
                file=sys.stderr,
                flush=True,
            )
            start_directives_s = (
                round(max(stats.ready_at) - registered, 2) if len(stats.ready_at) == args.machines else None
            )
            await asyncio.sleep(args.interval)
            # -- steady state
            before = len(await failures_of(admin, url, job_id))
            stats.recording = True
            print(f"steady state for {args.steady:.0f}s", file=sys.stderr, flush=True)
            cpu_before, wall_before = cpu_seconds(args.root_pid), time.monotonic()
            await asyncio.sleep(args.steady)
            root_cpu_pct = round(
                100 * (cpu_seconds(args.root_pid) - cpu_before) / (time.monotonic() - wall_before), 1
            )
            stats.recording = False
            false_positives = len(await failures_of(admin, url, job_id)) - before
            # -- pages, with every machine and the past failures in the database
            add_past_failures(server, database, job_id, args.past_failures)
            login = await admin.post(f"{url}/login", data={"token": ADMIN_TOKEN, "next": "/"})
            if login.status_code not in (200, 303):
                raise RuntimeError(f"login failed: {login.status_code}")
            job_page_ms = await timed_get(admin, f"{url}/jobs/{job_id}", cookies=login.cookies)
            metrics_ms = await timed_get(admin, f"{url}/metrics")
            print(f"pages done: {stats.errors}", file=sys.stderr, flush=True)
            # -- one machine lost
            known = {f["id"] for f in await failures_of(admin, url, job_id)}
            victim = machines[args.machines // 2]
            victim.alive = False
            stopped = time.time()
            detected: dict[str, Any] | None = None
            while detected is None and time.time() - stopped < args.timeout + 120:
                await asyncio.sleep(0.2)
                fresh = [f for f in await failures_of(admin, url, job_id) if f["id"] not in known]
                detected = next((f for f in fresh if f["rank"] == victim.rank), None)
            detect_s = (
                round(datetime.fromisoformat(detected["detected_at"]).timestamp() - victim.last_answered, 2)
                if detected
                else None
            )
            return {
                "machines": args.machines,
                "procs_per_machine": args.procs,
                "heartbeat_interval_s": args.interval,
                "heartbeat_timeout_s": args.timeout,
                "steady_s": args.steady,
                "register_all_s": round(register_all_s, 2),
                "start_directives_s": start_directives_s,
                "directive_bytes": stats.directive_bytes,
                "heartbeats": len(stats.heartbeat_ms),
                "heartbeats_per_s": round(len(stats.heartbeat_ms) / args.steady, 1),
                "heartbeat_p50_ms": quantile(stats.heartbeat_ms, 0.5),
                "heartbeat_p99_ms": quantile(stats.heartbeat_ms, 0.99),
                "progress_p99_ms": quantile(stats.progress_ms, 0.99),
                "peers_directive_p99_ms": quantile(stats.directive_ms, 0.99),
                "root_cpu_pct": root_cpu_pct,
                "false_positives": false_positives,
                "detect_s": detect_s,
                "past_failures": args.past_failures,
                "job_page_ms": job_page_ms,
                "metrics_ms": metrics_ms,
                "errors": stats.errors,
            }
        finally:
            for machine in machines:
                machine.alive = False
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await shared.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=8, help="training processes per machine")
    parser.add_argument("--steady", type=float, default=600.0, help="seconds of steady state")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="heartbeat interval (s), as the root's default"
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="heartbeat timeout (s), as the root's default"
    )
    parser.add_argument("--past-failures", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="50 machines, 5 s of steady state")
    args = parser.parse_args()
    if args.quick:
        args.machines, args.steady, args.past_failures = 50, 5.0, 20
    with tempfile.TemporaryDirectory(prefix="castor-scale.") as tmp, harness.postgres() as server:
        workdir = Path(tmp)
        database = "castor_scale"
        process, url = start_root(workdir, server.create_database(database), args)
        args.root_pid = process.pid
        try:
            figures = asyncio.run(run(args, server, database, url))
        except BaseException:
            print((workdir / "root.log").read_text()[-5000:], file=sys.stderr)
            raise
        finally:
            harness.stop_process(process)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
