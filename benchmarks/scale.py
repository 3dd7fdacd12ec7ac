"""Load harness of the control plane: many simulated machines against the real root service; the last line
printed is JSON.

    .venv/bin/python benchmarks/scale.py                       # 1,000 machines x 8 processes, 10 min steady
    .venv/bin/python benchmarks/scale.py --machines 200 --steady 60
    .venv/bin/python benchmarks/scale.py --quick               # 50 machines, 5 s steady: checks that it runs
    .venv/bin/python benchmarks/scale.py --machines 100 --steady 30 --etcd --group-loss --process-exit \
        --leader-kill                                          # every scenario, agents on etcd leases

The root runs as in production (`python -m services.cli serve`, one uvicorn process) on a throwaway Postgres
started the way the tests start it (tests/harness.py), and with --etcd on a throwaway etcd started the way the
tests start it (--heartbeat-interval=50 --election-timeout=500, periodic auto-compaction). The machines are
asyncio tasks in this process (no torch, no shared memory, no data plane), each speaking the worker API as an
agent does (failing over between root replicas as worker_lib.client.RootClient does, over aiohttp: see
AgentHttp): register; long-poll its machine's directive (`machine=`, as an agent does); report its inventory
when a recovery collects (its ranks at the iteration of the failure, and the replicas its placement gives it),
`restored` and `resumed` when a plan is ready; heartbeat every interval with a summary of its P ranks whose
iterations advance (REST, or with --etcd as an agent does: its own etcd lease, refreshed every interval, its
key put when the lease is new and then every summary period the root gives (2 s up to 200 machines, N / 100 s
beyond; the first rewrite after a random part of one), over a pool of etcd connections); re-fetch the
directive for its peers' addresses as an agent does (only while its long poll, which waits as long as the
root's registration answer says, has been silent for that wait plus PEERS_REFRESH_S).

Scenarios, in order:
* register all: every machine registers at once; `register_all_s` until the last one got its rank;
  `start_directives_s` from then (the last registration releases the first plan) until every machine's
  long poll has answered with it; `directive_bytes` the largest directive a machine was sent;
* steady state (--steady seconds): heartbeats and progress; `heartbeat_p50_ms`/`heartbeat_p99_ms` as the
  machines see them (send to answer, this process's own event-loop lag included; with --etcd a lease
  refresh, the liveness; `summary_puts_per_s` and `summary_put_p99_ms` the summaries' puts, on a clock of
  their own), `false_positives` the failure events recorded meanwhile (none is expected),
  `root_cpu_pct` the root processes' CPU use (100: one core busy), `harness_cpu_pct` this process's,
  `harness_gc_s` and `harness_gc_pause_max_ms` the time its garbage collections stopped every simulated
  agent at once, in all and the longest (its thresholds are raised: see main);
* pages: `job_page_ms` (the job's status page, signed in) and `metrics_ms` (/metrics) with every machine
  registered and --past-failures recovered failures in the database (median of 5 each);
* one machine lost: one machine stops heartbeating (with --etcd: stops refreshing its lease); `suspect_s`
  from its last heartbeat (lease refresh) to the root suspecting it, `detect_s` to the failure event (the
  suspect grace, --suspect-grace, after the suspicion: a silent machine is declared lost on a second signal
  or after the grace). The harness then registers a replacement at once (the cloud's launch, excluded:
  `replaced_s` is how long the harness took, `failure_seen_s` of it until the failure was in the root's
  list, which this process polls every 0.2 s), and times the recovery: `plan_ready_s` from the failure's
  detection to its plan ready (every inventory in; its parts: `collect_told_s` to every live machine's long
  poll answering "collecting", `inventories_sent_s` to the last inventory report sent (the report is also
  the machine's next long poll, as worker_lib's agent sends it, so the root's answer comes with the plan),
  `survivor_inventories_sent_s` to the last of the machines that were not lost: what the plan waits for once
  the replacement's launch, excluded from the target, is taken out),
  `directives_s` from the plan ready to every machine's long poll answering with it, `recovery_s` the
  root's (detection to every machine resumed);
* --group-loss: every machine of one placement group stops at once (no replica of its ranks survives);
  `group_*` figures as above, and `group_tier` the slowest tier its plan restores from;
* --process-exit: one training process of one machine exits (its agent reports it); `exit_detect_s` from
  the report sent to the failure the root filed it under (the acknowledgement's id), `exit_*` as above;
  `exit_joined_open_failure`: the exit came while another failure was open and joined it as a cascade
  entry (timed to that entry), as the root treats an exit during a recovery;
* --leader-kill: two root replicas on the same Postgres (and etcd, with --etcd) elect a leader; one machine
  stops, and once its failure is recorded the leader's process is killed (SIGKILL) before the replacement
  registers; `failover_elected_s` from the kill to the new leader raising the fencing epoch, `failover_s`
  to the new leader continuing the recovery (its first recovery write: the plan collecting or ready),
  `failover_*` as above;
* --replicas N: N root replicas on the same Postgres (and etcd) from the start, the simulated agents
  spread over them as agents given every replica's URL are (each fails over to the others): every
  replica answers its share of the agents' requests, the leader also orchestrates.
With --etcd, `etcd_db_growth_mb` is how much etcd's database file grew over the run, `etcd_db_in_use_mb`
what it uses at the end (auto-compaction frees history; the file does not shrink without a defrag).

--interval and --timeout set the root's REST heartbeat interval and timeout (defaults: the root's, 1 s and
3 s); at 1,000 machines on a 2-core host a longer interval is what the host can carry (docs/figures.md,
"Scale"). --lease-ttl sets the agents' etcd lease TTL (the root's CASTOR_LEASE_TTL_S; agents refresh it
every min(interval, TTL / 3)).

Not simulated: the data plane (no checkpoint moves; restores are reported at once), persisted shards (a
group loss has no persistent copy to restore from), the cloud's replacement (the harness registers one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import harness  # noqa: E402
from worker_lib.agent.heartbeat import next_summary_due  # noqa: E402
from worker_lib.api.worker import ExitAck, HeartbeatConfig, RegisterResponse  # noqa: E402
from worker_lib.client import RootRejected, RootUnavailable  # noqa: E402

ADMIN_TOKEN = "castor-admin.scale-benchmark"
PEERS_REFRESH_S = 10.0  # worker_lib.agent.services.PEERS_REFRESH_S
MACHINES_PER_ETCD_CONNECTION = 25
POLLED_FAILURES = 20  # the newest failures a scenario's polls read: more than one scenario makes
DIRECTIVE_FIELDS = {
    "revision": re.compile(r'"revision":\s*(-?\d+)'),
    "status": re.compile(r'"status":\s*"(\w+)"'),
    "generation": re.compile(r'"generation":\s*(\d+)'),
}


class LeaseKeepAlives:
    """One simulated machine's lease refreshes over a long-lived LeaseKeepAlive stream of a shared etcd
    connection. aetcd's `Lease.refresh` opens a new gRPC stream per refresh: three a second per machine at a
    1 s TTL, which from one process for all machines made this harness lapse its own leases (a real agent
    refreshes only its own). One stream per machine, not per connection: etcd answers a stream's keepalives
    in order, and a keepalive for a lease that has expired waits until the lease's revocation is through
    raft, so on a shared stream one machine's lapse held back every other machine's refresh behind it until
    their leases lapsed too (TimeoutErrors after 5 s, hundreds of lapses a minute at 100 x 8, TTL 1 s)."""

    def __init__(self, client: Any):
        self.client = client
        self.requests: asyncio.Queue[int] = asyncio.Queue()
        self.waiting: dict[int, list[asyncio.Future[Any]]] = {}
        self.stream: asyncio.Task[None] | None = None

    async def refresh(self, lease_id: int, timeout_s: float) -> Any:
        """The keepalive's reply for `lease_id` (TTL 0: the lease had expired)."""
        if self.stream is None or self.stream.done():
            self.stream = asyncio.create_task(self._run())
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(lease_id, []).append(reply)
        self.requests.put_nowait(lease_id)
        try:
            return await asyncio.wait_for(asyncio.shield(reply), timeout_s)
        finally:
            waiters = self.waiting.get(lease_id, [])
            if reply in waiters:
                waiters.remove(reply)

    async def _run(self) -> None:
        from aetcd.rpc import LeaseKeepAliveRequest

        async def requests() -> Any:
            while True:
                yield LeaseKeepAliveRequest(ID=await self.requests.get())

        try:
            await self.client.connect()
            call = self.client.leasestub.LeaseKeepAlive(requests(), metadata=self.client.metadata)
            async for reply in call:
                for waiter in self.waiting.pop(reply.ID, []):
                    if not waiter.done():
                        waiter.set_result(reply)
        except Exception as exc:  # the stream broke: its waiters fail, the next refresh opens a new one
            for waiters in self.waiting.values():
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)
            self.waiting.clear()

    async def close(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
            await asyncio.gather(self.stream, return_exceptions=True)


@dataclass
class EtcdConnection:
    """One etcd connection shared by MACHINES_PER_ETCD_CONNECTION simulated machines, each with its own
    keepalive stream on it."""

    client: Any
    keepalives: list[LeaseKeepAlives] = field(default_factory=list)

    def stream(self) -> LeaseKeepAlives:
        keepalives = LeaseKeepAlives(self.client)
        self.keepalives.append(keepalives)
        return keepalives


@dataclass
class Stats:
    heartbeat_ms: list[float] = field(default_factory=list)
    put_ms: list[float] = field(default_factory=list)  # --etcd: the summary's puts, beside the refreshes
    progress_ms: list[float] = field(default_factory=list)
    directive_ms: list[float] = field(default_factory=list)
    directive_bytes: int | None = None
    directive_requests: int = 0  # sent during the steady state: long polls and peers' refreshes
    ready_at: list[float] = field(default_factory=list)  # monotonic: each machine's first ready directive
    # generation -> wall clock of each machine's long poll answering with that generation's ready plan
    ready_wall: dict[int, list[float]] = field(default_factory=dict)
    # generation -> wall clock of each machine's long poll answering "collecting", and of its inventory
    # report sent, with whether the machine is a replacement (plan_ready_s in parts: every machine told,
    # every report sent, the survivors' reports sent)
    collecting_wall: dict[int, list[float]] = field(default_factory=dict)
    inventory_wall: dict[int, list[tuple[float, bool]]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    recording: bool = False
    started: float = field(default_factory=time.monotonic)
    frozen: int | None = None  # the iteration every machine holds at the failure being simulated
    replicas_of: dict[int, list[int]] = field(
        default_factory=dict
    )  # machine -> machines it holds replicas of

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    def iteration(self) -> int:
        """Every rank's newest iteration: the ranks of a job advance together."""
        return int((time.monotonic() - self.started) * 2)


class AgentHttp:
    """One simulated machine's calls to the worker API, over aiohttp rather than worker_lib's RootClient
    (httpx) and with RootClient's policy: a 4xx is raised at once as RootRejected with the root's error
    code; a transport error or a 5xx goes to the next root replica at once, with a pause once each was
    tried, until `retry_for_s` is spent (RootUnavailable). Why not RootClient itself: the thousand
    simulated agents share this process and these two cores with the root, and httpx spent 0.7 ms of
    this process's CPU per request (aiohttp 0.2 ms); in a recovery's burst the harness, not the root, was
    the bottleneck (py-spy: two thirds of the harness in httpx while the root idled). A real agent spends
    that on its own host."""

    def __init__(
        self, urls: list[str], job_id: str, token: str, session: Any, retry_for_s: float = 900.0
    ) -> None:
        self.urls, self.job_id, self.session, self.retry_for_s = urls, job_id, session, retry_for_s
        self.headers = {"Authorization": f"Bearer {token}"}
        self.current = 0  # the replica that answered last

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float = 30.0,
        retry_for_s: float | None = None,
    ) -> bytes:
        """The answer's body to `method` on the job's worker path `path`."""
        deadline = time.monotonic() + (self.retry_for_s if retry_for_s is None else retry_for_s)
        attempt = 0
        while True:
            url = f"{self.urls[self.current]}/api/v1/worker/jobs/{self.job_id}{path}"
            try:
                async with self.session.request(
                    method,
                    url,
                    json=body,
                    params=params,
                    headers=self.headers,
                    timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10.0),
                ) as response:
                    content: bytes = await response.read()
                    if response.status < 400:
                        return content
                    if response.status < 500:
                        try:
                            error = json.loads(content)["error"]
                            code, message = str(error["code"]), str(error["message"])
                        except (ValueError, KeyError, TypeError):
                            code, message = "http_error", content[:200].decode(errors="replace")
                        raise RootRejected(response.status, code, message, url)
                    problem = f"{response.status} from the root"
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = type(exc).__name__
            attempt += 1
            if time.monotonic() >= deadline:
                raise RootUnavailable(f"{method} {path}: {problem} ({attempt} attempts)")
            self.current = (self.current + 1) % len(self.urls)
            if attempt % len(self.urls) == 0:
                await asyncio.sleep(1.0)

    async def register(self, **fields: Any) -> RegisterResponse:
        answer = await self.request("POST", "/machines", body=fields)
        return RegisterResponse.model_validate_json(answer)

    async def heartbeat(self, rank: int, instance_id: str, summary: dict[str, Any]) -> None:
        # As RootClient: a heartbeat is worth nothing once the next one is due, so retried briefly only.
        body = {"instance_id": instance_id, "summary": summary}
        await self.request("POST", f"/machines/{rank}/heartbeat", body=body, retry_for_s=2.0)

    async def report_progress(self, rank: int, body: dict[str, Any]) -> None:
        await self.request("POST", f"/machines/{rank}/progress", body=body)

    async def report_exit(self, rank: int, body: dict[str, Any]) -> ExitAck:
        return ExitAck.model_validate_json(await self.request("POST", f"/machines/{rank}/exits", body=body))


class SimulatedMachine:
    """One machine's agent, as far as the root can tell: its requests, at an agent's pace."""

    def __init__(
        self,
        rank: int,
        client: AgentHttp,
        procs: int,
        interval_s: float,
        stats: Stats,
        instance_id: str | None = None,
    ):
        self.rank, self.client, self.procs, self.interval_s, self.stats = (
            rank,
            client,
            procs,
            interval_s,
            stats,
        )
        self.instance_id = instance_id or f"sim-{rank:05d}"
        self.replacement = instance_id is not None  # a fresh machine: its memory is empty
        self.alive = True
        self.last_answered = 0.0  # wall clock of the last heartbeat the root answered (lease refresh sent)
        self.trained = 1  # the generation whose training made what it holds
        self.config: HeartbeatConfig | None = None
        self.directive_wait_s = 10.0  # the long poll's wait the root gives at registration
        self.long_poll_answered_at: float | None = None  # monotonic
        self.tasks: list[asyncio.Task[None]] = []

    def stop(self) -> None:
        """The machine dies: its loops end and its requests in flight are dropped."""
        self.alive = False
        for task in self.tasks:
            task.cancel()

    def summary(self) -> dict[str, Any]:
        iteration = self.stats.iteration()
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

    def holdings(self) -> list[dict[str, Any]]:
        """What its inventory reports: its own ranks and the replicas it holds, at the failure's iteration
        (a replacement holds nothing)."""
        if self.replacement and self.trained == 1:
            return []
        iteration = self.stats.frozen if self.stats.frozen is not None else self.stats.iteration()
        found = []
        for machine in [self.rank, *self.stats.replicas_of.get(self.rank, [])]:
            for rank in range(machine * self.procs, (machine + 1) * self.procs):
                found.append(
                    {
                        "rank": rank,
                        "iteration": iteration,
                        "tier": "local" if machine == self.rank else "replica",
                        "digest": f"{rank:08x}{iteration:08x}",
                        "data_bytes": 1 << 20,
                        "verified": None,  # as agents report: not checked yet (the restore checks)
                        "generation": self.trained,
                    }
                )
        return found

    async def register(self) -> RegisterResponse:
        registered = await self.client.register(
            instance_id=self.instance_id,
            address="127.0.0.1",
            data_port=20000 + self.rank % 40000,
            hostname=self.instance_id,
            rank=self.rank,
            rendezvous_port=30000 + self.rank % 30000,
        )
        self.config = registered.heartbeat
        self.directive_wait_s = registered.directive_wait_s
        return registered

    def work(self, etcd: Any = None) -> list[Coroutine[Any, Any, None]]:
        """The agent's loops: heartbeats (REST, or its etcd lease over `etcd`), the directive long poll and
        the peers' refresh."""
        beats = (
            self.lease(etcd) if self.config is not None and self.config.mode == "etcd" else self.heartbeats()
        )
        return [beats, self.directives(), self.peer_refreshes()]

    async def directive(self, after: int, wait_s: float) -> dict[str, Any]:
        """The directive's leading fields only. A real agent parses the whole of its machine's directive on
        its own host (an older root answers with the whole job's: about a megabyte at 1,000 x 8); a thousand
        of them parsed in this one process would make the harness, not the root, the bottleneck."""
        params = {"after": after, "wait": wait_s, "machine": self.rank}
        content = await self.client.request("GET", "/directive", params=params, timeout_s=wait_s + 30)
        if self.stats.recording:
            self.stats.directive_requests += 1
        return self.leading_fields(content)

    def leading_fields(self, content: bytes) -> dict[str, Any]:
        """A directive's revision, status and generation (see `directive`)."""
        self.stats.directive_bytes = max(self.stats.directive_bytes or 0, len(content))
        head = content[:400].decode(errors="replace")
        fields = {key: DIRECTIVE_FIELDS[key].search(head) for key in DIRECTIVE_FIELDS}
        if not all(fields.values()):
            raise RootRejected(200, "bad_directive", head)
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
            except Exception as exc:  # counted: worker_lib's loop would end on these
                self.stats.error(f"heartbeat, unexpected: {type(exc).__name__}")
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - sent)))

    async def lease(self, etcd: Any) -> None:
        """etcd mode, as worker_lib.agent.heartbeat.etcd_heartbeats: a lease of the root's TTL, refreshed
        every interval, the key put (on the lease) when the lease is new and then at most every summary
        period the root gave (HeartbeatConfig.summary_period_s) when the summary changed, the first
        rewrite after a random part of it (next_summary_due). The agent's own connection is one of a
        shared pool here."""
        import aetcd

        assert self.config is not None and self.config.etcd_key is not None
        key, interval = self.config.etcd_key.encode(), self.config.interval_s
        ttl = max(1, round(self.config.timeout_s))
        keepalives = etcd.stream()
        lease: Any = None
        last: bytes | None = None
        due: float | None = None  # the summary's next rewrite (None: put it now, the lease is new)
        refresh_at = time.monotonic() + random.random() * interval  # agents start at different moments
        await asyncio.sleep(max(0.0, refresh_at - time.monotonic()))
        while self.alive:
            started = time.monotonic()
            try:
                if lease is None:
                    lease, last, due = await etcd.client.lease(ttl), None, None
                    refresh_at = time.monotonic() + random.random() * interval  # as etcd_heartbeats
                if time.monotonic() >= refresh_at:
                    sent, sent_wall = time.monotonic(), time.time()
                    refreshed = await keepalives.refresh(lease.id, timeout_s=5.0)
                    if getattr(refreshed, "TTL", 1) <= 0:
                        lease = None  # it lapsed: a new one, at once
                        self.stats.error("lease lapsed")
                        continue
                    if self.alive:
                        self.last_answered = sent_wall
                    if self.stats.recording:
                        self.stats.heartbeat_ms.append((time.monotonic() - sent) * 1000)
                    refresh_at = sent + interval
                if due is None or time.monotonic() >= due:
                    value = json.dumps(self.summary(), sort_keys=True).encode()
                    if value != last:
                        sent = time.monotonic()
                        await etcd.client.put(key, value, lease=lease)
                        if self.stats.recording:
                            self.stats.put_ms.append((time.monotonic() - sent) * 1000)
                    due, last = next_summary_due(due, time.monotonic(), self.config.summary_period_s), value
            except (aetcd.exceptions.ClientError, OSError, TimeoutError) as exc:
                self.stats.error(f"lease: {type(exc).__name__}: {str(exc)[:60]}".rstrip(": "))
                lease, refresh_at = None, started + interval
            except Exception as exc:  # counted: worker_lib's loop would end on these
                self.stats.error(f"lease, unexpected: {type(exc).__name__}")
                lease, refresh_at = None, started + interval
            wake = refresh_at if lease is None or due is None else min(refresh_at, due)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))

    async def directives(self) -> None:
        """The agent's directive long poll: on a recovery collecting, its inventory; on a ready plan,
        `restored` then `resumed`."""
        revision, generation = -1, None
        collected: set[int] = set()
        answered: dict[str, Any] | None = None  # by the inventory report, which is also the long poll
        while self.alive:
            try:
                directive = answered or await self.directive(after=revision, wait_s=self.directive_wait_s)
                answered = None
            except (RootRejected, RootUnavailable) as exc:
                self.stats.error(f"directive: {type(exc).__name__}")
                await asyncio.sleep(1)
                continue
            self.long_poll_answered_at = time.monotonic()
            if not self.alive:
                return
            revision = max(revision, directive["revision"])
            if directive["status"] == "collecting" and directive["generation"] not in collected:
                collected.add(directive["generation"])
                self.stats.collecting_wall.setdefault(directive["generation"], []).append(time.time())
                body = {
                    "instance_id": self.instance_id,
                    "generation": directive["generation"],
                    "holdings": self.holdings(),
                    "rendezvous_port": 30000 + self.rank % 30000,
                }
                # As worker_lib's agent: the report is also the next long poll (answered with the
                # directive once the plan is ready, so only its sending can be timed here).
                self.stats.inventory_wall.setdefault(directive["generation"], []).append(
                    (time.time(), self.replacement)
                )
                try:
                    content = await self.client.request(
                        "POST",
                        f"/machines/{self.rank}/inventory",
                        body=body,
                        params={"after": revision, "wait": self.directive_wait_s},
                        timeout_s=self.directive_wait_s + 30,
                    )
                    answered = self.leading_fields(content)
                except (RootRejected, RootUnavailable) as exc:
                    self.stats.error(f"inventory: {type(exc).__name__}")
            if directive["status"] == "ready" and directive["generation"] != generation:
                if generation is None:
                    self.stats.ready_at.append(time.monotonic())
                generation = directive["generation"]
                self.stats.ready_wall.setdefault(generation, []).append(time.time())
                for event in ("restored", "resumed"):
                    body = {"instance_id": self.instance_id, "generation": generation, "event": event}
                    sent = time.monotonic()
                    try:
                        await self.client.report_progress(self.rank, body)
                        self.stats.progress_ms.append((time.monotonic() - sent) * 1000)
                    except (RootRejected, RootUnavailable) as exc:
                        self.stats.error(f"progress: {type(exc).__name__}")
                self.trained = generation

    async def peer_refreshes(self) -> None:
        """As worker_lib.agent.services._refresh_peers: a request of its own only once the long poll has
        been silent for its wait plus PEERS_REFRESH_S (its answers carry the peers' addresses)."""
        await asyncio.sleep(random.random() * PEERS_REFRESH_S)
        while self.alive:
            sent = time.monotonic()
            heard = self.long_poll_answered_at
            if heard is not None and sent - heard < self.directive_wait_s + PEERS_REFRESH_S:
                await asyncio.sleep(PEERS_REFRESH_S)
                continue
            try:
                await self.directive(after=-1, wait_s=0)
                if self.stats.recording:
                    self.stats.directive_ms.append((time.monotonic() - sent) * 1000)
            except (RootRejected, RootUnavailable) as exc:
                self.stats.error(f"peers: {type(exc).__name__}")
            await asyncio.sleep(PEERS_REFRESH_S)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def start_root(
    workdir: Path, database_url: str, args: argparse.Namespace, name: str = "root"
) -> tuple[subprocess.Popen[bytes], str]:
    port = harness.free_port()
    env = {
        **os.environ,
        "CASTOR_STATE_DIR": str(workdir / f"{name}-state"),
        "CASTOR_DATABASE_URL": database_url,
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        "CASTOR_PORT": str(port),
        "CASTOR_HEARTBEAT_INTERVAL_S": str(args.interval),
        "CASTOR_HEARTBEAT_TIMEOUT_S": str(args.timeout),
    }
    if args.etcd_endpoint:
        env["CASTOR_ETCD_ENDPOINTS"] = args.etcd_endpoint
        env["CASTOR_LEASE_TTL_S"] = str(args.lease_ttl)
    if args.suspect_grace is not None:
        env["CASTOR_SUSPECT_GRACE_S"] = str(args.suspect_grace)
    log = (workdir / f"{name}.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        harness.wait_for_port(port, process, timeout=120)
    except BaseException:
        harness.stop_process(process)
        raise
    return process, f"http://127.0.0.1:{port}"


def mb(size: float | None) -> float | None:
    return None if size is None else round(size / 1e6, 2)


class Run:
    """One benchmark run: the job, its simulated machines and the scenarios."""

    def __init__(
        self,
        args: argparse.Namespace,
        server: harness.Postgres,
        database: str,
        roots: list[tuple[subprocess.Popen[bytes], str]],
    ):
        self.args, self.server, self.database, self.roots = args, server, database, roots
        self.url = roots[0][1]  # the admin's replica (a live one)
        self.stats = Stats()
        self.machines: list[SimulatedMachine] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.etcd_clients: list[EtcdConnection] = []
        self.figures: dict[str, Any] = {}
        self.job_id, self.token = "", ""
        self.agent_session: Any = None  # aiohttp's, every simulated machine's (see AgentHttp)
        self.leaderless_s, self.leader_changes = 0.0, 0
        self._pg: Any = None  # asyncpg's connection, opened by the first sql()

    # -- helpers

    async def sql(self, query: str) -> list[Any]:
        """The rows of one query on the root's database, over this run's own connection: the harness polls
        with it every 0.2 s while a recovery runs, and a psql process per poll blocked the simulated
        agents' event loop (and took CPU from the root's two cores) in the window being measured."""
        if self._pg is None:
            import asyncpg

            self._pg = await asyncpg.connect(
                host="127.0.0.1", port=self.server.port, user="postgres", database=self.database
            )
        return list(await self._pg.fetch(query))

    async def failures(self, limit: int = 500) -> list[dict[str, Any]]:
        """The job's newest `limit` failures (500: the root's largest page), newest first. The polls while a
        scenario runs ask for the newest POLLED_FAILURES only: a page of 500 (the --past-failures among
        them) every 0.2 s was the root's load, not the agents', and this process saw a failure seconds
        after the root recorded it, which delayed the replacement it registers."""
        body = (await self._failures_page(limit)).json()
        return list(body["items"] if isinstance(body, dict) else body)

    async def failure_count(self) -> int:
        """How many failures the job has (the list's X-Total-Count), however many pages they fill."""
        response = await self._failures_page(limit=1)
        total = response.headers.get("x-total-count")
        return int(total) if total is not None else len(await self.failures())

    async def _failures_page(self, limit: int = 500) -> httpx.Response:
        # An overloaded root drops a connection now and then: the figure is not that.
        for attempt in range(10):
            try:
                response = await self.admin.get(
                    f"{self.url}/api/v1/jobs/{self.job_id}/failures", params={"limit": limit}
                )
                response.raise_for_status()
                return response
            except httpx.HTTPError:
                if attempt == 9:
                    raise
                await asyncio.sleep(1)
        raise AssertionError("unreachable")

    async def until(self, what: str, check: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        """`check()`'s first truthy answer, polled every 0.2 s for at most `timeout_s` (None after)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = await check()
            if found:
                return found
            await asyncio.sleep(0.2)
        print(f"gave up waiting for {what} after {timeout_s:.0f}s", file=sys.stderr, flush=True)
        return None

    def start(self, machine: SimulatedMachine) -> None:
        etcd = self.etcd_clients[machine.rank % len(self.etcd_clients)] if self.etcd_clients else None
        machine.tasks = [asyncio.create_task(work) for work in machine.work(etcd)]
        self.tasks.extend(machine.tasks)

    # -- the run

    async def run(self) -> dict[str, Any]:
        args = self.args
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(headers=headers, timeout=60) as self.admin:
            name = f"scale-{uuid.uuid4().hex[:6]}"
            body = {"name": name, "machines": args.machines, "procs_per_machine": args.procs, "replicas": 2}
            created = (await self.admin.post(f"{self.url}/api/v1/jobs", json=body)).raise_for_status().json()
            self.job_id, token = created["id"], created["worker_token"]
            # Every simulated machine's AgentHttp over one aiohttp session: its pool hands out an idle
            # connection in constant time (httpcore's matched every queued request against every connection
            # of its pool, which made a pool per machine necessary). Idle connections are dropped after 4 s,
            # before the root's uvicorn closes them (5 s): a request on a connection the server is closing
            # fails, and would count as the root's error.
            self.agent_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
            )
            self.token = token
            self.machines = [self.machine(rank) for rank in range(args.machines)]
            if args.etcd_endpoint:
                import aetcd

                host, _, port = args.etcd_endpoint.partition(":")
                for _ in range(max(1, -(-args.machines // MACHINES_PER_ETCD_CONNECTION))):
                    client = aetcd.Client(host, int(port), timeout=5)
                    self.etcd_clients.append(EtcdConnection(client))
            watch = asyncio.create_task(self.watch_leadership())
            progress = asyncio.create_task(self.report_progress())
            try:
                await self.scenarios()
                return self.figures
            finally:
                watch.cancel()
                progress.cancel()
                await asyncio.gather(watch, progress, return_exceptions=True)
                self.figures["leaderless_s"] = round(self.leaderless_s, 1)
                self.figures["leader_changes"] = self.leader_changes
                for machine in self.machines:
                    machine.alive = False
                for task in self.tasks:
                    task.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)
                for connection in self.etcd_clients:
                    for keepalives in connection.keepalives:
                        await keepalives.close()
                    with contextlib.suppress(Exception):
                        await connection.client.close()
                await self.agent_session.close()
                if self._pg is not None:
                    await self._pg.close()

    def machine(self, rank: int, instance_id: str | None = None) -> SimulatedMachine:
        # Machines spread over the replicas (each fails over to the others), as agents given every URL do:
        # an agent starts on the replica its instance id hashes to (worker_lib.client.first_replica), here
        # the rank's turn, as even a spread.
        urls = [url for _, url in self.roots]
        shift = rank % len(urls)
        client = AgentHttp(urls[shift:] + urls[:shift], self.job_id, self.token, self.agent_session)
        return SimulatedMachine(rank, client, self.args.procs, self.args.interval, self.stats, instance_id)

    async def scenarios(self) -> None:
        args, stats = self.args, self.stats
        db_start = harness.etcd_db_bytes(args.etcd_endpoint)[0] if args.etcd_endpoint else None
        # -- register all
        started = time.monotonic()

        async def join(machine: SimulatedMachine) -> None:
            registered = await machine.register()
            if not stats.replicas_of:
                for placed in registered.placement.ranks:
                    for holder in placed.holders:
                        if holder != placed.rank:
                            stats.replicas_of.setdefault(holder, []).append(placed.rank)
            # As an agent: heartbeats and the directive from its registration on (a machine registered
            # early and silent until the last one registered would be suspect at the start).
            self.start(machine)

        await asyncio.gather(*(join(m) for m in self.machines))
        registered = time.monotonic()
        register_all_s = registered - started
        print(f"registered {args.machines} machines in {register_all_s:.1f}s", file=sys.stderr, flush=True)
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
        before = await self.failure_count()
        stats.recording = True
        print(f"steady state for {args.steady:.0f}s", file=sys.stderr, flush=True)
        pids = [process.pid for process, _ in self.roots]
        cpu_before, wall_before = sum(map(harness.cpu_seconds, pids)), time.monotonic()
        own_cpu_before = time.process_time()
        GC_PAUSES.reset()
        await asyncio.sleep(args.steady)
        harness_gc = GC_PAUSES.total_s, GC_PAUSES.longest_s
        steady_wall = time.monotonic() - wall_before
        root_cpu_pct = round(100 * (sum(map(harness.cpu_seconds, pids)) - cpu_before) / steady_wall, 1)
        # This process simulates every agent: near 100 it is the bottleneck (late heartbeats, lapsed leases).
        harness_cpu_pct = round(100 * (time.process_time() - own_cpu_before) / steady_wall, 1)
        stats.recording = False
        false_positives = await self.failure_count() - before
        heartbeats = list(stats.heartbeat_ms)
        # -- pages, with every machine and the past failures in the database
        add_past_failures(self.server, self.database, self.job_id, args.past_failures)
        try:
            login = await retried(
                lambda: self.admin.post(f"{self.url}/login", data={"token": ADMIN_TOKEN, "next": "/"})
            )
            if login.status_code not in (200, 303):
                raise RuntimeError(f"login failed: {login.status_code}")
            job_page: float | None = await timed_get(
                self.admin, f"{self.url}/jobs/{self.job_id}", cookies=login.cookies
            )
            metrics: float | None = await timed_get(self.admin, f"{self.url}/metrics")
        except (httpx.HTTPError, RuntimeError) as exc:  # the failure scenarios still run
            print(f"pages failed: {exc!r}", file=sys.stderr, flush=True)
            job_page = metrics = None
        print(f"pages done: {stats.errors}", file=sys.stderr, flush=True)
        self.figures.update(
            {
                "machines": args.machines,
                "procs_per_machine": args.procs,
                "heartbeats_via": "etcd" if args.etcd_endpoint else "rest",
                "root_replicas": len(self.roots),
                "heartbeat_interval_s": args.interval,
                "heartbeat_timeout_s": args.timeout,
                "lease_ttl_s": args.lease_ttl if args.etcd_endpoint else None,
                "suspect_grace_s": args.suspect_grace,
                "steady_s": args.steady,
                "register_all_s": round(register_all_s, 2),
                "start_directives_s": start_directives_s,
                "directive_bytes": stats.directive_bytes,
                "heartbeats": len(heartbeats),
                "heartbeats_per_s": round(len(heartbeats) / args.steady, 1),
                "directive_requests_per_s": round(stats.directive_requests / args.steady, 1),
                "heartbeat_p50_ms": quantile(heartbeats, 0.5),
                "heartbeat_p99_ms": quantile(heartbeats, 0.99),
                "summary_puts_per_s": round(len(stats.put_ms) / args.steady, 1)
                if args.etcd_endpoint
                else None,
                "summary_put_p99_ms": quantile(stats.put_ms, 0.99),
                "progress_p99_ms": quantile(stats.progress_ms, 0.99),
                "peers_directive_p99_ms": quantile(stats.directive_ms, 0.99),
                "root_cpu_pct": root_cpu_pct,
                "harness_cpu_pct": harness_cpu_pct,
                "harness_gc_s": round(harness_gc[0], 2),
                "harness_gc_pause_max_ms": round(harness_gc[1] * 1000, 1),
                "false_positives": false_positives,
                "past_failures": args.past_failures,
                "job_page_ms": job_page,
                "metrics_ms": metrics,
            }
        )
        if args.no_loss:
            scenarios: list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]] = []
        else:
            # -- failures, one after the other, each recovered before the next
            scenarios = [("", self.lose_one)]
        if args.group_loss:
            scenarios.append(("group_", self.lose_group))
        if args.process_exit:
            scenarios.append(("exit_", self.process_exit))
        if args.leader_kill:
            scenarios.append(("failover_", self.lose_one_and_the_leader))
        for prefix, scenario in scenarios:
            try:
                await self.settle()
                self.figures.update(await scenario())
            except Exception as exc:  # the other scenarios' figures still count; this one says why not
                print(f"{prefix or 'machine_'}scenario failed: {exc!r}", file=sys.stderr, flush=True)
                self.figures[f"{prefix}error"] = repr(exc)[:300]
        if args.etcd_endpoint:
            size, in_use = harness.etcd_db_bytes(args.etcd_endpoint)
            self.figures["etcd_db_growth_mb"] = mb(size - (db_start or 0))
            self.figures["etcd_db_in_use_mb"] = mb(in_use)
        self.figures["errors"] = stats.errors

    def live(self) -> list[SimulatedMachine]:
        return [m for m in self.machines if m.alive]

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Before a scenario picks its victims, until the root holds every live machine healthy or
        `timeout_s`: right after a recovery machines may not be yet, and a pick among none healthy fell
        back to one machine where the scenario meant a whole group."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not {m.rank for m in self.live()} - await self.healthy():
                return
            await asyncio.sleep(0.5)

    async def healthy(self) -> set[int]:
        """The ranks whose machine the root holds healthy (a false positive's is failed already)."""
        query = f"SELECT rank FROM machines WHERE job_id = '{self.job_id}' AND state = 'healthy'"
        return {int(row[0]) for row in await self.sql(query)}

    async def a_machine(self, avoid: int, prefer: int | None = None) -> SimulatedMachine:
        """A live original machine the root holds healthy, other than machine `avoid` and those already
        lost: `prefer` if it is one."""
        healthy = await self.healthy()
        candidates = [m for m in self.live() if m.rank != avoid and not m.replacement and m.rank in healthy]
        if not candidates:  # the root holds none healthy: any live one
            candidates = [m for m in self.live() if m.rank != avoid]
        return next((m for m in candidates if m.rank == prefer), candidates[len(candidates) // 3])

    async def a_group(self) -> list[SimulatedMachine]:
        """Every machine of one placement group (machine 0's excluded, and any already replaced)."""
        holders: dict[int, set[int]] = {}
        for machine, held in self.stats.replicas_of.items():
            holders.setdefault(machine, {machine}).update(held)
        healthy = await self.healthy() if self.job_id else set(self.stats.replicas_of)
        by_rank = {m.rank: m for m in self.live() if m.rank in healthy}
        for members in sorted(holders.values(), key=min, reverse=True):
            if 0 not in members and all(r in by_rank and not by_rank[r].replacement for r in members):
                return [by_rank[r] for r in sorted(members)]
        return [await self.a_machine(avoid=0)]

    async def report_progress(self, every_s: float = 30.0) -> None:
        """A line on stderr every `every_s`: machines with a lease or heartbeat answered lately, and the
        errors so far (a long run that goes wrong says so before its end)."""
        while True:
            await asyncio.sleep(every_s)
            recent = sum(1 for m in self.live() if time.time() - m.last_answered < every_s)
            print(
                f"{time.monotonic() - self.stats.started:.0f}s: {recent} of {len(self.live())} live machines "
                f"answered in the last {every_s:.0f}s; errors {self.stats.errors}",
                file=sys.stderr,
                flush=True,
            )

    async def watch_leadership(self) -> None:
        """Every second: which replica says it leads. `leaderless_s` adds up the seconds none did (a
        leaderless root detects and recovers nothing: its figures would read as no false positives)."""
        leading: int | None = None
        while True:
            sent = time.monotonic()
            now = await self.leader()
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - sent)))
            if now is None:
                self.leaderless_s += time.monotonic() - sent
            elif now != leading:
                self.leader_changes += leading is not None
                leading = now

    async def leader(self) -> int | None:
        """The index of the root replica that leads (None: none says so)."""
        for index, (process, url) in enumerate(self.roots):
            if process.poll() is not None:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if (await self.admin.get(f"{url}/healthz", timeout=5)).json().get("leader"):
                    return index
        return None

    async def plan_after(self, generation: int) -> tuple[int, float | None, float, int | None] | None:
        """The newest plan past `generation`: (generation, ready_at or None, created_at, iteration)."""
        rows = await self.sql(
            "SELECT generation, extract(epoch from ready_at), extract(epoch from created_at), iteration "
            f"FROM recovery_plans WHERE job_id = '{self.job_id}' AND generation > {generation} "
            "ORDER BY generation DESC LIMIT 1"
        )
        if not rows:
            return None
        gen, ready, created, iteration = rows[0]
        return (
            int(gen),
            float(ready) if ready is not None else None,
            float(created),
            int(iteration) if iteration is not None else None,
        )

    async def generation(self) -> int:
        rows = await self.sql(
            f"SELECT coalesce(max(generation), 0) FROM recovery_plans WHERE job_id = '{self.job_id}'"
        )
        return int(rows[0][0])

    async def lose_one(self) -> dict[str, Any]:
        return await self.lose([await self.a_machine(avoid=0, prefer=self.args.machines // 2)], "")

    async def lose_group(self) -> dict[str, Any]:
        return await self.lose(await self.a_group(), "group_")

    async def lose_one_and_the_leader(self) -> dict[str, Any]:
        return await self.lose([await self.a_machine(avoid=0)], "failover_", kill_leader=True)

    async def lose(
        self, victims: list[SimulatedMachine], prefix: str, *, kill_leader: bool = False
    ) -> dict[str, Any]:
        """Machines lost at once (they stop heartbeating, or stop refreshing their leases), replaced by the
        harness as soon as each failure is recorded; then the recovery, timed."""
        print(
            f"{prefix or 'machine_'}lost: machines {[m.rank for m in victims]}", file=sys.stderr, flush=True
        )
        known = {f["id"] for f in await self.failures()}
        generation = await self.generation()
        self.stats.frozen = self.stats.iteration()
        for victim in victims:
            victim.stop()
        ranks = {v.rank: v for v in victims}
        found: dict[int, dict[str, Any]] = {}
        figures: dict[str, Any] = {}
        replaced_at: list[float] = []
        seen_at: list[float] = []  # when this process saw each failure in the root's list
        reinstated: list[int] = []
        killed_at: float | None = None
        grace = self.args.suspect_grace if self.args.suspect_grace is not None else 10.0
        wait_s = max(self.args.timeout, self.args.lease_ttl) + grace + 120

        async def recorded() -> bool:
            nonlocal killed_at
            for failure in await self.failures(POLLED_FAILURES):
                if failure["id"] in known or failure["rank"] not in ranks or failure["rank"] in found:
                    continue
                found[failure["rank"]] = failure
                seen_at.append(time.time())
                if kill_leader and killed_at is None:
                    killed_at = await self.kill_leader()
                # The cloud's replacement, at once: a fresh machine registers for the rank.
                replacement = self.machine(
                    failure["rank"], f"{ranks[failure['rank']].instance_id}-r{generation}"
                )
                try:
                    await replacement.register()
                except RootRejected as exc:
                    # The root reinstated the machine: a heartbeat it sent before it stopped arrived after
                    # its failure was recorded. Its next failure is the one to wait for.
                    print(f"machine {failure['rank']} reinstated: {exc}", file=sys.stderr, flush=True)
                    reinstated.append(failure["rank"])
                    known.add(failure["id"])
                    del found[failure["rank"]]
                    continue
                replaced_at.append(time.time())
                self.machines[replacement.rank] = replacement
                self.start(replacement)
            return len(found) == len(ranks)

        await self.until(f"{prefix}failures recorded", recorded, wait_s)
        if not found:
            return {f"{prefix}detect_s": None}
        detected = min(datetime.fromisoformat(f["detected_at"]).timestamp() for f in found.values())
        last_seen = max(v.last_answered for v in victims)
        suspected = [
            datetime.fromisoformat(f["details"]["suspected_at"]).timestamp()
            for f in found.values()
            if f["details"].get("suspected_at")
        ]
        figures[f"{prefix}detect_s"] = round(
            max(
                datetime.fromisoformat(f["detected_at"]).timestamp() - ranks[r].last_answered
                for r, f in found.items()
            ),
            2,
        )
        figures[f"{prefix}suspect_s"] = round(max(suspected) - last_seen, 2) if suspected else None
        figures[f"{prefix}reinstated"] = len(reinstated)
        figures[f"{prefix}replaced_s"] = round(max(replaced_at) - detected, 2) if replaced_at else None
        figures[f"{prefix}failure_seen_s"] = round(max(seen_at) - detected, 2) if seen_at else None
        if kill_leader:
            figures.update(await self.failover(killed_at, generation))
        figures.update(await self.recovery(prefix, generation, detected, list(found.values())))
        return figures

    async def kill_leader(self) -> float | None:
        index = await self.leader()
        if index is None:
            print("no leader to kill", file=sys.stderr, flush=True)
            return None
        process, url = self.roots[index]
        killed = time.time()
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        survivors = [u for p, u in self.roots if p.poll() is None]
        self.url = survivors[0]
        print(f"killed the leader {url} (pid {process.pid})", file=sys.stderr, flush=True)
        return killed

    async def failover(self, killed: float | None, generation: int) -> dict[str, Any]:
        if killed is None:
            return {"failover_s": None}

        async def elected() -> float | None:
            rows = await self.sql("SELECT extract(epoch from updated_at) FROM leader_epoch WHERE id = 1")
            return float(rows[0][0]) if rows and float(rows[0][0]) > killed else None

        async def continued() -> float | None:
            plan = await self.plan_after(generation)
            if plan is None:
                return None
            written = [t for t in (plan[2], plan[1]) if t is not None and t > killed]
            return min(written) if written else None

        epoch_at = await self.until("a new leader", elected, 60)
        continued_at = await self.until("the new leader to continue the recovery", continued, 120)
        return {
            "failover_elected_s": round(epoch_at - killed, 2) if epoch_at else None,
            "failover_s": round(continued_at - killed, 2) if continued_at else None,
        }

    async def process_exit(self) -> dict[str, Any]:
        machine = await self.a_machine(avoid=0)
        print(f"exit_: a process of machine {machine.rank} exits", file=sys.stderr, flush=True)
        known = {f["id"] for f in await self.failures()}
        generation = await self.generation()
        self.stats.frozen = self.stats.iteration()
        sent = time.time()
        ack = await machine.client.report_exit(
            machine.rank,
            {
                "instance_id": machine.instance_id,
                "local_rank": 0,
                "global_rank": machine.rank * self.args.procs,
                "exit_code": 1,
            },
        )

        async def recorded() -> list[dict[str, Any]]:
            failures = await self.failures(POLLED_FAILURES)
            if ack.failure_id is not None:  # the failure the root filed the exit under
                return [f for f in failures if f["id"] == ack.failure_id]
            return [f for f in failures if f["id"] not in known and f["rank"] == machine.rank]

        found = await self.until("the exit's failure", recorded, 60)
        if not found:
            return {"exit_detect_s": None, "exit_failure_id": ack.failure_id}
        # An exit while another failure is open joins it (a cascade entry, not a failure of its own: the
        # root takes it for a consequence): timed to its entry, and said.
        joined = found[0]["id"] in known
        entries = [
            str(e["at"])
            for e in (found[0].get("details") or {}).get("cascade", [])
            if isinstance(e, dict) and e.get("at")
        ]
        at = max(entries) if joined and entries else str(found[0]["detected_at"])
        detected = datetime.fromisoformat(at).timestamp()
        figures: dict[str, Any] = {
            "exit_detect_s": round(detected - sent, 2),
            "exit_joined_open_failure": joined,
        }
        figures.update(await self.recovery("exit_", generation, detected, found))
        return figures

    async def recovery(
        self, prefix: str, generation: int, detected: float, failures: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The recovery after the failures: the plan ready, every machine told, training resumed (one
        deadline for all three)."""
        deadline = time.monotonic() + 60.0 + float(self.args.machines) * 0.2

        def timeout() -> float:
            return max(0.0, deadline - time.monotonic())

        async def ready() -> tuple[int, float | None, float, int | None] | None:
            plan = await self.plan_after(generation)
            return plan if plan is not None and plan[1] is not None else None

        plan = await self.until(f"{prefix}plan ready", ready, timeout())
        if plan is None:
            return {f"{prefix}plan_ready_s": None}
        new_generation, ready_at, _, iteration = plan
        assert ready_at is not None
        live = len(self.live())
        told = await self.until(
            f"{prefix}every machine told",
            lambda: _now(len(self.stats.ready_wall.get(new_generation, [])) >= live),
            timeout(),
        )
        ids = {f["id"] for f in failures}
        detected_at = {_timestamp(f["detected_at"]) for f in failures}

        async def recovered() -> list[dict[str, Any]]:
            listed = await self.failures(POLLED_FAILURES)
            # A failure can vanish into another: an exit is folded into a machine loss declared after it
            # (a cascade entry of that loss, at the exit's detection time). Its recovery is that loss's.
            present = {f["id"] for f in listed}
            folded = {
                f["id"]
                for f in listed
                for entry in (f.get("details") or {}).get("cascade", [])
                if isinstance(entry, dict) and entry.get("at") and _timestamp(entry["at"]) in detected_at
            }
            wanted = (ids & present) | (folded if ids - present else set())
            done = [f for f in listed if f["id"] in wanted and f.get("recovery_s") is not None]
            return done if wanted and len(done) == len(wanted) else []

        done = await self.until(f"{prefix}training resumed", recovered, timeout())
        answered = self.stats.ready_wall.get(new_generation, [])
        print(
            f"{prefix}generation {new_generation} ready at iteration {iteration}; told "
            f"{len(answered)} of {live} machines",
            file=sys.stderr,
            flush=True,
        )
        collecting = self.stats.collecting_wall.get(new_generation, [])
        inventories = [at for at, _ in self.stats.inventory_wall.get(new_generation, [])]
        survivors = [
            at for at, replacement in self.stats.inventory_wall.get(new_generation, []) if not replacement
        ]

        def quantiles(times: list[float]) -> str:
            since_ms = [(t - detected) * 1000 for t in times]
            if not since_ms:
                return "-"
            return "/".join(f"{(quantile(since_ms, q) or 0) / 1000:.2f}" for q in (0, 0.1, 0.5, 0.9, 1))

        print(
            f"{prefix}timeline from detection: plan created {plan[2] - detected:.2f} s, told "
            f"{quantiles(collecting)}, inventories sent {quantiles(inventories)}, "
            f"ready {ready_at - detected:.2f}",
            file=sys.stderr,
            flush=True,
        )
        return {
            f"{prefix}collect_told_s": round(max(collecting) - detected, 2) if collecting else None,
            f"{prefix}inventories_sent_s": round(max(inventories) - detected, 2) if inventories else None,
            f"{prefix}survivor_inventories_sent_s": round(max(survivors) - detected, 2)
            if survivors
            else None,
            f"{prefix}plan_ready_s": round(ready_at - detected, 2),
            f"{prefix}directives_s": round(max(answered) - ready_at, 2) if told else None,
            f"{prefix}recovery_s": round(max(f["recovery_s"] for f in done), 2) if done else None,
            f"{prefix}tier": done[0].get("tier") if done else None,
        }


async def _now(value: Any) -> Any:
    return value


def _timestamp(iso: Any) -> float:
    return datetime.fromisoformat(str(iso)).timestamp()


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


async def retried(call: Callable[[], Awaitable[httpx.Response]], attempts: int = 5) -> httpx.Response:
    """`call()`, again on a dropped connection (a keep-alive connection the root closed while idle)."""
    for attempt in range(attempts):
        try:
            return await call()
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def timed_get(http: httpx.AsyncClient, url: str, times: int = 5, **kwargs: Any) -> float:
    """The median of `times` GETs, each timed from its successful attempt (a dropped connection is retried
    untimed)."""
    took = []
    for _ in range(times):
        for attempt in range(5):
            sent = time.monotonic()
            try:
                response = await http.get(url, **kwargs)
                break
            except httpx.TransportError:
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)
        response.raise_for_status()
        took.append((time.monotonic() - sent) * 1000)
    return round(statistics.median(took), 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument(
        "--etcd",
        action="store_true",
        help="the root in etcd mode: agents hold etcd leases (no REST heartbeats)",
    )
    parser.add_argument(
        "--lease-ttl", type=int, default=1, help="etcd mode: the agents' lease TTL (s), as the root's default"
    )
    parser.add_argument(
        "--suspect-grace",
        type=float,
        default=None,
        help="the root's CASTOR_SUSPECT_GRACE_S (default: the root's, 10 s)",
    )
    parser.add_argument("--group-loss", action="store_true", help="also lose every machine of one group")
    parser.add_argument("--process-exit", action="store_true", help="also one training process exits")
    parser.add_argument(
        "--leader-kill",
        action="store_true",
        help="two root replicas; also kill the leader in the middle of a machine's recovery",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="root replicas on the same Postgres (and etcd); the agents spread over them (--leader-kill: 2)",
    )
    parser.add_argument(
        "--no-loss", action="store_true", help="stop after the pages: register and steady state only"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the root replicas' logs here")
    args = parser.parse_args(argv)
    if args.quick:
        args.machines, args.steady, args.past_failures = 50, 5.0, 20
    args.etcd_endpoint = None
    return args


# This process's garbage collector (see main): young collections every 20,000 net allocations, not 700.
HARNESS_GC_THRESHOLDS = (20_000, 10, 10)


class CollectorPauses:
    """This process's garbage collections (a gc callback): seconds spent in them and the longest, since
    `reset()`; wall clock, so a collection descheduled on a busy host counts as long as it stopped the
    agents."""

    def __init__(self) -> None:
        self.total_s, self.longest_s = 0.0, 0.0
        self._started: float | None = None

    def reset(self) -> None:
        self.total_s, self.longest_s = 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            took = time.perf_counter() - self._started
            self.total_s += took
            self.longest_s = max(self.longest_s, took)
            self._started = None


GC_PAUSES = CollectorPauses()


def main() -> None:
    args = parse_args()
    # A thousand simulated agents live in this one process, and with Python's thresholds their heap
    # (300,000-450,000 objects) took a full collection every second or so, 0.1-0.5 s each, 29 s of a
    # 2-minute run: every simulated agent stopped at once, lease refreshes and all, which no real agent
    # (a process of its own, with a small heap) would do. The figures measured the harness's collector.
    gc.set_threshold(*HARNESS_GC_THRESHOLDS)
    gc.callbacks.append(GC_PAUSES)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="castor-scale.")))
        server = stack.enter_context(harness.postgres())
        if args.etcd:
            args.etcd_endpoint = stack.enter_context(harness.etcd()).endpoint
        database = "castor_scale"
        database_url = server.create_database(database)
        roots: list[tuple[subprocess.Popen[bytes], str]] = []
        try:
            # One after the other: the first applies the migrations, the second finds them applied.
            for index in range(max(args.replicas, 2 if args.leader_kill else 1)):
                roots.append(start_root(workdir, database_url, args, f"root{index}"))
            figures = asyncio.run(Run(args, server, database, roots).run())
        except BaseException:
            for log in sorted(workdir.glob("root*.log")):
                print(f"--- {log.name}\n" + log.read_text()[-5000:], file=sys.stderr)
            raise
        finally:
            for process, _ in roots:
                harness.stop_process(process)
            if args.log_dir:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                for log in workdir.glob("root*.log"):
                    shutil.copy(log, args.log_dir / log.name)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
