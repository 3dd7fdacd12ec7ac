"""The job's status page and /metrics at scale, without the load harness; the last line printed is JSON.

    .venv/bin/python benchmarks/pages.py                          # 1,000 machines x 8, 100 past failures
    .venv/bin/python benchmarks/pages.py --machines 200 --times 5
    .venv/bin/python benchmarks/pages.py --tree /tmp/B-before     # another checkout's root, same database
    .venv/bin/python benchmarks/pages.py --profile /tmp/B-pages   # cProfile of both, in this process
    .venv/bin/python benchmarks/pages.py --quick                  # 80 machines: checks that it runs

A throwaway Postgres started the way the tests start it (tests/harness.py) is filled straight through SQL
with one running job of --machines machines x --procs processes (m = --replicas, group placement), each
machine with the summary its agent's heartbeat carries (its ranks' iterations, the replicas it holds of its
group peers, the replication figures, the per-rank checkpoint stalls), but one pending (registered, no
heartbeat yet) and one rank without a machine (the page must show both among the others);
--failures recovered failures, each with its ready recovery plan (one source per rank: local, or peer for
the ranks of the machine a hardware failure replaced) and, for hardware failures, the replaced machine's
row; --checkpoints persisted checkpoints of one shard per rank. The root then runs as in production
(`python -m services.cli serve` from --tree, one uvicorn process, on that database; heartbeat timeouts far
off so that nothing it finds changes the data) and this process times, alternated, GET /jobs/{id} signed
in (`job_page_ms`), GET /metrics (`metrics_ms`) and GET /api/v1/jobs/{id} (`job_api_ms`): the median of
--times requests each after one untimed warm-up, from send to the last byte. `*_bytes` are the sizes.

Then, in this process with this checkout's repository, what the root's leader reads at every pass (5 a
second) while a recovery waits for its agents' reports: every live machine's row, as it did before
(`leader_machines_ms`), against one aggregate query (`leader_progress_ms`); medians of 5 x --times reads,
wall time and this process's CPU (`*_cpu_ms`).

--profile DIR serves the app in this process instead (httpx's ASGI transport, no uvicorn) and writes
cProfile's statistics of the timed requests to DIR/job_page.prof and DIR/metrics.prof, with the top
functions by cumulative time printed (timings under a profiler are not the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import os
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
ADMIN_TOKEN = "castor-admin.pages-benchmark"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--failures", type=int, default=100, help="recovered failures in the job's past")
    parser.add_argument("--checkpoints", type=int, default=2, help="persisted checkpoints (one shard a rank)")
    parser.add_argument("--times", type=int, default=9, help="timed requests of each page (the median)")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout whose root serves the pages")
    parser.add_argument("--profile", type=Path, default=None, help="profile in process; statistics here")
    parser.add_argument("--save-page", type=Path, default=None, help="write the job page's HTML here")
    parser.add_argument(
        "--quick", action="store_true", help="80 machines, 5 failures, 1 checkpoint, 3 times: that it runs"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.machines, args.failures, args.checkpoints, args.times = 80, 5, 1, 3
    return args


# -- the database ------------------------------------------------------------------------------------------


def agent_summary(machine: int, procs: int, peers: list[int], iteration: int) -> dict[str, Any]:
    """A heartbeat summary as worker_lib.agent.services.MachineAgent.summary makes it."""
    own = range(machine * procs, (machine + 1) * procs)
    held = [r for peer in peers for r in range(peer * procs, (peer + 1) * procs)]
    return {
        "local": {str(r): iteration for r in own},
        "replicas": {str(r): iteration - 1 for r in held},
        "committed": iteration,
        "skipped": 0,
        "replicas_skipped": 3,
        "per_minute": 120.0,
        "replicated": iteration - 1,
        "replication_lag_s": round(0.2 + 0.001 * (machine % 97), 3),
        "replicated_iteration": iteration - 1,
        "replication_interval": 1,
        "replication_lag_iterations": 1,
        "replication_age_s": 0.4,
        "replication_rounds": iteration,
        "replication_aborted": 0,
        "uploaded": iteration // 100,
        "persist_missed": {},
        "stalled_s": {str(r): round(0.001 * iteration + 0.0001 * r, 6) for r in own},
        "save_calls": {str(r): iteration for r in own},
    }


async def fill(url: str, job_id: uuid.UUID, args: argparse.Namespace) -> dict[str, Any]:
    """The job's machines, past failures with their plans and replaced machines, and persisted checkpoints,
    written through SQL (no recovery is run). Returns what the pages should show."""
    from sqlalchemy import insert, update
    from sqlalchemy.ext.asyncio import create_async_engine

    from services.root.db.models import (
        FailureEvent,
        Job,
        Machine,
        PersistedCheckpoint,
        PersistedShard,
        RecoveryPlan,
    )

    rng = random.Random(13)
    now = datetime.now(UTC)
    started = now - timedelta(minutes=args.failures * 2 + 60)
    n, procs, m = args.machines, args.procs, args.replicas
    iteration = 20_000
    generation = args.failures + 1  # plan 1 started the job; each failure's plan follows
    # Not healthy: a replacement that registered and has not heartbeaten yet, and a rank nobody took. (A
    # suspect or failed machine has the leader read every machine of the job each tick until it is
    # reinstated or declared lost: its cost would be in the figures, not the pages'.)
    pending, unregistered = n // 2 + 1, n // 3 + 2
    machines = []
    for rank in range(n):
        group = rank // m
        peers = [p for p in range(group * m, min((group + 1) * m, n)) if p != rank]
        if rank == unregistered:
            continue
        state = "pending" if rank == pending else "healthy"
        beat = None if rank == pending else now - timedelta(seconds=rng.uniform(0, 1))
        machines.append(
            {
                "job_id": job_id,
                "rank": rank,
                "instance_id": f"i-{rank:05d}{uuid.uuid4().hex[:8]}",
                "hostname": f"node-{rank:05d}",
                "address": f"10.{rank // 65536}.{rank // 256 % 256}.{rank % 256}",
                "data_port": 7000,
                "state": state,
                "registered_at": started,
                "last_heartbeat_at": beat,
                "summary": agent_summary(rank, procs, peers, iteration),
                "inventory": {},
                "inventory_generation": generation,
                "restored_generation": generation,
                "resumed_generation": generation,
            }
        )
    by_rank = {m["rank"]: m for m in machines}
    plans, failures, replaced = [], [], []
    for g in range(2, generation + 1):
        at = started + timedelta(minutes=2 * g)
        hardware = g % 3 == 0
        lost = rng.randrange(n)
        lost = lost if lost in by_rank else 0
        sources = [
            {
                "rank": r,
                "tier": "peer" if hardware and r // procs == lost else "local",
                "source_rank": (lost ^ 1) % n if hardware and r // procs == lost else r // procs,
                "address": f"10.0.{r // procs // 256}.{r // procs % 256}",
                "data_port": 7000,
                "location": None,
                "digest": f"{r:08x}{g:08x}" * 4,
            }
            for r in range(n * procs)
        ]
        plans.append(
            {
                "job_id": job_id,
                "generation": g,
                "iteration": iteration - 1000 + 10 * g,
                "status": "ready",
                "reason": f"failure of machine {lost}: every rank restorable from memory",
                "created_at": at + timedelta(seconds=1),
                "ready_at": at + timedelta(seconds=3),
                "rendezvous": {"master_addr": "10.0.0.0", "master_port": 29500},
                "sources": sources,
            }
        )
        failures.append(
            {
                "job_id": job_id,
                "rank": lost,
                "kind": "hardware" if hardware else "software",
                "state": "recovered",
                "cause": f"machine {lost}: no heartbeat for 3 s"
                if hardware
                else f"rank {lost * procs} exited",
                "detected_at": at,
                "classified_at": at + timedelta(seconds=0.2),
                "replaced_at": at + timedelta(seconds=2) if hardware else None,
                "restored_at": at + timedelta(seconds=4),
                "resumed_at": at + timedelta(seconds=5),
                "tier": "peer" if hardware else "local",
                "iterations_lost": 1,
                "details": {
                    "instance_id": f"i-old-{g}",
                    "plan_generation": g,
                    "iteration": iteration - 1000 + 10 * g,
                    "failed_since": (at - timedelta(seconds=3)).isoformat(),
                },
            }
        )
        if hardware:
            replaced.append(
                {
                    **by_rank[lost],
                    "instance_id": f"i-old-{g}",
                    "state": "replaced",
                    "registered_at": started,
                    "last_heartbeat_at": at - timedelta(seconds=3),
                }
            )
    engine = create_async_engine(url)
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(Machine), replaced + machines)
            await connection.execute(
                update(RecoveryPlan)
                .where(RecoveryPlan.job_id == job_id, RecoveryPlan.generation == 1)
                .values(status="ready", ready_at=started)
            )
            ids = []
            for plan in plans:  # one at a time: each carries n * procs sources
                ids.append(
                    (
                        await connection.execute(insert(RecoveryPlan).returning(RecoveryPlan.id), plan)
                    ).scalar_one()
                )
            if failures:
                await connection.execute(
                    insert(FailureEvent), [{**f, "plan_id": i} for f, i in zip(failures, ids, strict=True)]
                )
            for c in range(args.checkpoints):
                at = iteration - 100 * (args.checkpoints - c)
                checkpoint = (
                    await connection.execute(
                        insert(PersistedCheckpoint).returning(PersistedCheckpoint.id),
                        {"job_id": job_id, "iteration": at, "location": f"s3://bucket/pages/{at}"},
                    )
                ).scalar_one()
                await connection.execute(
                    insert(PersistedShard),
                    [
                        {
                            "checkpoint_id": checkpoint,
                            "rank": r,
                            "key": f"pages/{at}/rank-{r:05d}",
                            "digest": f"{r:064x}",
                            "nbytes": 1 << 30,
                            "generation": generation,
                        }
                        for r in range(n * procs)
                    ],
                )
            await connection.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(
                    state="running",
                    started_at=started,
                    newest_iteration=iteration,
                    checkpoints_committed=iteration * n,
                    checkpoints_per_minute=120.0,
                    replicated_iteration=iteration - 1,
                    replication_interval=1,
                    replication_lag=1,
                    replication_state="ok",
                    wasted_time_s=6.0 * len(failures),
                )
            )
    finally:
        await engine.dispose()
    return {"pending": pending, "unregistered": unregistered}


# -- the root ----------------------------------------------------------------------------------------------


def start(tree: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve"],
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@contextlib.asynccontextmanager
async def root_process(
    tree: Path, database_url: str, workdir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, int | None]]:
    from tests import harness

    port = harness.free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "CASTOR_STATE_DIR": str(workdir / "state"),
        "CASTOR_DATABASE_URL": database_url,
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        "CASTOR_PORT": str(port),
        # Nothing heartbeats here: the failure detector must not act on the data.
        "CASTOR_HEARTBEAT_TIMEOUT_S": "86400",
        "CASTOR_SUSPECT_GRACE_S": "86400",
    }
    process = start(tree, env, workdir / "root.log")
    try:
        harness.wait_for_port(port, process, timeout=120)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            yield http, process.pid
    finally:
        harness.stop_process(process)


@contextlib.asynccontextmanager
async def root_in_process(
    database_url: str, workdir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, int | None]]:
    from services.root.app import create_app
    from services.root.settings import Settings

    settings = Settings(
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        state_dir=workdir / "state",
        heartbeat_timeout_s=86400,
        suspect_grace_s=86400,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://castor.test", timeout=120) as http:
            yield http, None


def cpu_seconds(pid: int) -> float:
    """User and system CPU of the process (its own threads), from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def create_job(http: httpx.AsyncClient, args: argparse.Namespace) -> uuid.UUID:
    body = {
        "name": "pages-benchmark",
        "machines": args.machines,
        "procs_per_machine": args.procs,
        "replicas": args.replicas,
        "persist_every": 100,
        "placement": "group" if args.machines % args.replicas == 0 else "mixed",
    }
    response = await http.post("/api/v1/jobs", json=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    response.raise_for_status()
    return uuid.UUID(response.json()["id"])


async def timed(http: httpx.AsyncClient, path: str, **kwargs: Any) -> tuple[float, httpx.Response]:
    sent = time.perf_counter()
    response = await http.get(path, **kwargs)
    took = (time.perf_counter() - sent) * 1000
    response.raise_for_status()
    return took, response


async def measure(
    http: httpx.AsyncClient, job_id: uuid.UUID, args: argparse.Namespace, expect: dict[str, Any]
) -> dict[str, Any]:
    login = await http.post("/login", data={"token": ADMIN_TOKEN, "next": "/"})
    if login.status_code != 303:
        raise RuntimeError(f"login failed: {login.status_code}")
    cookies = login.cookies
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    pages: dict[str, tuple[str, dict[str, Any]]] = {
        "job_page": (f"/jobs/{job_id}", {"cookies": cookies}),
        "metrics": ("/metrics", {}),
        "job_api": (f"/api/v1/jobs/{job_id}", {"headers": admin}),
    }
    took: dict[str, list[float]] = {name: [] for name in pages}
    sizes: dict[str, int] = {}
    profiles = {name: cProfile.Profile() for name in pages} if args.profile else {}
    for round_ in range(args.times + 1):  # the first round warms up, untimed
        for name, (path, kwargs) in pages.items():
            profile = profiles.get(name) if round_ else None
            if profile:
                profile.enable()
            ms, response = await timed(http, path, **kwargs)
            if profile:
                profile.disable()
            if round_:
                took[name].append(ms)
            sizes[name] = len(response.content)
            if name == "job_page":
                page = response.text
                if args.save_page:
                    args.save_page.write_text(page)
                for what in ("pending", "unregistered"):
                    if f'aria-label="machine {expect[what]}"' not in page:
                        raise RuntimeError(f"the job page does not show the {what} machine {expect[what]}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name, profile in profiles.items():
            profile.dump_stats(str(args.profile / f"{name}.prof"))
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(40)
            print(f"== {name}\n{out.getvalue()}", file=sys.stderr)
    figures: dict[str, Any] = {}
    for name in pages:
        figures[f"{name}_ms"] = round(statistics.median(took[name]), 1)
        figures[f"{name}_min_ms"] = round(min(took[name]), 1)
        figures[f"{name}_bytes"] = sizes[name]
    return figures


async def leader_reads(database_url: str, job_id: uuid.UUID, times: int) -> dict[str, Any]:
    """What the root's leader reads at every pass (5 a second) while a recovery waits for its agents'
    reports, on this checkout's repository: every live machine's row (`repo.live_machines`, what it read
    before) against one aggregate (`repo.recovery_progress`). Median wall time and this process's CPU."""
    from services.root.db import repository as repo
    from services.root.db.database import Database

    database = Database(database_url)
    reads = {
        "machines": lambda session: repo.live_machines(session, job_id),
        "progress": lambda session: repo.recovery_progress(session, job_id, 2),
    }
    figures: dict[str, Any] = {}
    try:
        for name, read in reads.items():
            wall, cpu = [], []
            for attempt in range(times + 1):  # the first warms up, untimed
                async with database.session() as session:
                    started, used = time.perf_counter(), time.process_time()
                    await read(session)
                    if attempt:
                        wall.append(time.perf_counter() - started)
                        cpu.append(time.process_time() - used)
            figures[f"leader_{name}_ms"] = round(1e3 * statistics.median(wall), 2)
            figures[f"leader_{name}_cpu_ms"] = round(1e3 * statistics.median(cpu), 2)
    finally:
        await database.dispose()
    return figures


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests import harness

    workdir = Path(tempfile.mkdtemp(prefix="castor-pages."))
    try:
        with harness.postgres() as server:
            database_url = server.create_database("pages")
            root = (
                root_in_process(database_url, workdir)
                if args.profile
                else root_process(args.tree.resolve(), database_url, workdir)
            )
            async with root as (http, pid):
                job_id = await create_job(http, args)
                filled = time.monotonic()
                expect = await fill(database_url, job_id, args)
                fill_s = time.monotonic() - filled
                server.psql("VACUUM ANALYZE")  # as autovacuum would have, long since, on a live database
                # What the root does meanwhile on its own (its leader's passes, the iteration sampler)
                # competes with the pages on its event loop: its CPU use while nothing asks.
                idle = None
                if pid is not None:
                    before, started = cpu_seconds(pid), time.monotonic()
                    await asyncio.sleep(3)
                    idle = round(100 * (cpu_seconds(pid) - before) / (time.monotonic() - started), 1)
                figures = await measure(http, job_id, args, expect)
                figures.update(await leader_reads(database_url, job_id, 5 * args.times))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "machines": args.machines,
        "procs_per_machine": args.procs,
        "past_failures": args.failures,
        "tree": str(args.tree),
        "profiled": bool(args.profile),
        "times": args.times,
        "fill_s": round(fill_s, 1),
        "root_idle_cpu_pct": idle,
        **figures,
    }


def main() -> None:
    args = parse_args()
    # The models and the harness come from this checkout (the schema is the same at both ends of a
    # comparison); the root under test runs from --tree (with --profile, in this process: from --tree too).
    sys.path.insert(0, str((args.tree if args.profile else REPO).resolve()))
    if args.profile:
        sys.path.insert(1, str(REPO))
    print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
