"""The root's CPU per agent request under each of uvicorn's event loops and HTTP parsers; the last line
printed is JSON.

    .venv/bin/python benchmarks/http_stack.py                    # 4,000 requests of each kind per stack
    .venv/bin/python benchmarks/http_stack.py --quick            # 200: checks that it runs

In a recovery at 1,000 machines the root answers thousands of agent requests within seconds, and most of
each request's cost is the HTTP stack around Castor's handler (docs/figures.md, "Scale"). uvicorn picks
its event loop and HTTP parser at start: uvloop and httptools when they are installed (the `server` extra
installs them), else asyncio's own loop and h11, a parser in pure Python. For each stack this starts the
root as `uvicorn --factory services.root.app:create_app --loop L --http H` on a throwaway SQLite database,
creates a job, registers its machine 0, then sends --requests requests of each kind, --concurrency at a
time, from this process: the directive a machine long-polls (`GET .../directive?machine=0`, answered from
the root's cached directive: little but the HTTP stack) and a REST heartbeat (`POST .../heartbeat`, one
UPDATE). `<stack>_<kind>_cpu_us` is the root process's CPU (user + system, /proc) per request, which does
not depend on how fast this process sends them; `<stack>_<kind>_per_s` the requests answered per second
with this process sharing the host's cores (indicative only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import harness  # noqa: E402

ADMIN_TOKEN = "castor-admin.http-stack-benchmark"
STACKS = {"asyncio_h11": ("asyncio", "h11"), "uvloop_httptools": ("uvloop", "httptools")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4000, help="requests of each kind per stack")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="200 requests of each kind")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 200
    return args


async def send_all(count: int, concurrency: int, send: Any) -> float:
    """`count` calls of `send()`, `concurrency` at a time; the seconds they took."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(count):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            response = await send(index)
            assert response.status_code == 200, response.text

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        body = {"name": "http-stack", "machines": 1, "procs_per_machine": 8, "replicas": 1}
        job = (await http.post("/api/v1/jobs", json=body, headers=admin)).raise_for_status().json()
        worker = {"Authorization": f"Bearer {job['worker_token']}"}
        base = f"/api/v1/worker/jobs/{job['id']}"
        registration = {"instance_id": "i-0", "address": "127.0.0.1", "data_port": 7000}
        (await http.post(f"{base}/machines", json=registration, headers=worker)).raise_for_status()

        def directive(_: int) -> Any:
            return http.get(f"{base}/directive", params={"machine": 0}, headers=worker)

        def heartbeat(index: int) -> Any:
            summary = {"local": {str(r): index for r in range(8)}}
            body = {"instance_id": "i-0", "summary": summary}
            return http.post(f"{base}/machines/0/heartbeat", json=body, headers=worker)

        figures: dict[str, float] = {}
        for kind, send in (("directive", directive), ("heartbeat", heartbeat)):
            await send_all(min(200, args.requests), args.concurrency, send)  # warm-up: connections, caches
            before = harness.cpu_seconds(pid)
            took = await send_all(args.requests, args.concurrency, send)
            figures[f"{kind}_cpu_us"] = round((harness.cpu_seconds(pid) - before) / args.requests * 1e6, 1)
            figures[f"{kind}_per_s"] = round(args.requests / took, 1)
        return figures


def run_stack(loop: str, http: str, workdir: Path, args: argparse.Namespace) -> dict[str, float]:
    port = harness.free_port()
    state = workdir / f"{loop}-{http}"
    env = {
        **os.environ,
        "CASTOR_STATE_DIR": str(state),
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        "CASTOR_HEARTBEAT_TIMEOUT_S": "3600",  # nothing is declared lost while this runs
    }
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "services.root.app:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--loop",
        loop,
        "--http",
        http,
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    log = (workdir / f"{loop}-{http}.log").open("wb")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        harness.wait_for_port(port, process, timeout=60)
        return asyncio.run(measure(f"http://127.0.0.1:{port}", process.pid, args))
    except BaseException:
        print((workdir / f"{loop}-{http}.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        harness.stop_process(process)


def main() -> None:
    args = parse_args()
    figures: dict[str, Any] = {"requests": args.requests, "concurrency": args.concurrency}
    with tempfile.TemporaryDirectory(prefix="castor-http-stack-") as tmp:
        for name, (loop, http) in STACKS.items():
            for key, value in run_stack(loop, http, Path(tmp), args).items():
                figures[f"{name}_{key}"] = value
            print(f"{name}: {figures}", file=sys.stderr, flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
