"""etcd with the auto-compaction Castor runs it with (docker-compose.yml, the test harness) keeps its
database bounded while agents rewrite their heartbeat keys without end: without compaction every rewrite
stays in etcd's history until its space quota stops every write, and every lease lapses at once.

The agents here are worker_lib's own etcd heartbeats, rewriting their summaries far more often than an agent
does (every 20 ms, not every 2 s) so that a long run's history accumulates in seconds, and the retention is
seconds instead of compose's hour. The same history written to an etcd without compaction is the control:
it is what the bound is measured against."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import subprocess
import time
import uuid

from tests import harness
from worker_lib.agent.heartbeat import etcd_heartbeats

AGENTS = 24
SUMMARY_PERIOD_S = 0.02
RUN_S = 12.0
PADDING = "x" * 1500  # a summary about the size of a machine's with eight ranks and their replicas


async def rewrite_for(server: harness.Etcd, seconds: float) -> tuple[list[int], list[int]]:
    """AGENTS heartbeats rewriting a changed summary every SUMMARY_PERIOD_S for `seconds`; the database's
    bytes in use and its revision, sampled every second."""
    counter = itertools.count()
    prefix = f"/castor-compaction-{uuid.uuid4().hex[:6]}"
    tasks = [
        asyncio.create_task(
            etcd_heartbeats(
                [server.endpoint],
                f"{prefix}/machines/{rank}",
                5,
                1.0,
                lambda rank=rank: {"rank": rank, "iteration": next(counter), "pad": PADDING},
                summary_period_s=SUMMARY_PERIOD_S,
            )
        )
        for rank in range(AGENTS)
    ]
    in_use: list[int] = []
    revisions: list[int] = []
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            status = await asyncio.to_thread(harness.etcd_status, server.endpoint)
            in_use.append(int(status.get("dbSizeInUse") or status["dbSize"]))
            revisions.append(int(status["header"]["revision"]))
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return in_use, revisions


def read_at_revision(server: harness.Etcd, at: int) -> str:
    """What etcdctl says to a read of every key as of revision `at` (its error once that is compacted)."""
    found = subprocess.run(
        ["etcdctl", f"--endpoints={server.endpoint}", "get", "/", "--prefix", f"--rev={at}"],
        capture_output=True,
        text=True,
    )
    return found.stderr or found.stdout


async def test_auto_compaction_keeps_etcd_bounded_while_agents_rewrite_their_keys() -> None:
    # The control: the same writes into an etcd that never compacts ("0" turns it off).
    with harness.etcd(compaction_retention="0") as unbounded:
        grown, control_revisions = await rewrite_for(unbounded, RUN_S)
    with harness.etcd(compaction_retention="2s") as compacting:
        kept, revisions = await rewrite_for(compacting, RUN_S)
        early = read_at_revision(compacting, 2)
    # About 15,000 revisions in each run here (the rate varies with the host's load).
    assert revisions[-1] > 3_000 and control_revisions[-1] > 3_000, "the agents wrote a long history"
    assert "compacted" in early, f"the history is gone, not merely unread: {early}"
    # Without compaction the database grows with the history (here 2.5 MB a second, 30 MB at the end): so
    # many bytes per revision written. With it, it saws between compactions (7-10 MB here) and levels off.
    # The two runs write at rates of their own (a loaded host, a test running beside this one), so the
    # bound is in revisions: the compacted database's peaks grow over the run's second half by less than
    # half of what the history it wrote then takes without compaction (without compaction: all of it), and
    # it ends below half of what its whole history would. Measured: 0.005-0.06 of it idle or beside two
    # busy cores; once 0.27 beside the other pytest worker's tests, whose disk writes slow etcd's commits
    # and so its reuse of the pages compaction frees (the bound was a quarter then, and failed).
    half = len(grown) // 2
    control_growth = grown[-1] - grown[half]
    assert control_growth > 1 << 20, f"the control did not grow: {grown}"
    per_revision = control_growth / (control_revisions[-1] - control_revisions[half])
    second_half = per_revision * (revisions[-1] - revisions[half])
    growth = max(kept[half:]) - max(kept[:half])
    assert growth < second_half / 2, (
        f"not bounded: {kept} at {revisions} against {grown} at {control_revisions}"
    )
    assert kept[-1] < per_revision * revisions[-1] / 2, (
        f"compacted {kept[-1]} bytes of {revisions[-1]} revisions"
    )
