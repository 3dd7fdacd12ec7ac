"""The root chooses which iteration every rank persists (issue 13, item 2): the real root (Postgres and
SQLite) and two simulated machines whose agents run the real upload code (worker_lib.agent.services.
Uploads) over real shared-memory stores and a local persistent tier.

The machines train in step but differ in speed where it matters: machine 0's uploads take longer than K
iterations (its store lets a put finish only once its ranks committed 3 K more iterations) and it
heartbeats every third iteration; machine 1 uploads at once and heartbeats every iteration. Left to each
rank's own multiples of K (today's agents), machine 1 uploads every multiple while machine 0 skips those
due during its slow upload: half the checkpoints are partial, never to complete. On the root's schedule
every rank persists the same announced iterations, each announced checkpoint completes before the next is
announced, and no shard is uploaded that is not part of a complete checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from tests.integration.conftest import admin, bearer, create_job
from worker_lib import Checkpointer
from worker_lib.agent.holdings import Holdings
from worker_lib.agent.services import Uploads
from worker_lib.agent_ipc import GENERATION_ENV
from worker_lib.api.worker import HeartbeatResponse, RegisterResponse
from worker_lib.client import RootRejected, RootUnavailable
from worker_lib.persistent import LocalDirStore, ObjectStore, PersistedShard
from worker_lib.store.manifest import Manifest

K = 4
ITERATIONS = 60
HEARTBEAT_EVERY = {0: 3, 1: 1}  # machine -> iterations between its heartbeats


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


class SlowStore:
    """A store whose puts finish only once the machine committed `lag` more iterations (an upload slower
    than K iterations), or once training ended."""

    def __init__(self, inner: ObjectStore, lag: int):
        self.inner, self.lag = inner, lag
        self.committed = 0
        self.ended = False
        self.changed = asyncio.Condition()
        self.held = 0  # puts waiting for the machine to commit further

    async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard:
        async with self.changed:
            self.held += 1
            try:
                await self.changed.wait_for(
                    lambda: self.ended or self.committed >= manifest.iteration + self.lag
                )
            finally:
                self.held -= 1
        return await self.inner.put(key, manifest, data)

    async def advance(self, iteration: int, ended: bool = False) -> None:
        async with self.changed:
            self.committed, self.ended = iteration, ended
            self.changed.notify_all()


async def settle(uploads: Uploads, store: SlowStore) -> None:
    """Wait until each of the machine's uploads finished or is held by its slow store.

    An agent stages a shard (one memcpy on a thread) long before its rank overwrites the slot; here the
    iterations are only loop turns apart, and on a loaded machine a thread can take longer than 4 of them,
    so the rank would miss the target for a reason this test is not about. Waiting for the staging keeps
    the race out: the schedule is then the only thing that decides which checkpoints complete."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while sum(not task.done() for task in uploads._running.values()) > store.held:
        assert loop.time() < deadline, "an upload neither finished nor reached the store in 30 s"
        await asyncio.sleep(0.001)


class RootOverHttp:
    """The agent's client, reduced to what uploads call, over the in-process app."""

    def __init__(self, http: httpx.AsyncClient, job: dict[str, Any]):
        self.http, self.job = http, job

    async def report_persisted(self, rank: int, body: dict[str, Any]) -> None:
        response = await self.http.post(
            f"/api/v1/worker/jobs/{self.job['id']}/machines/{rank}/persisted",
            json=body,
            headers=bearer(str(self.job["worker_token"])),
        )
        assert response.status_code == 204, response.text


async def test_every_rank_persists_the_announced_iterations_and_each_completes(
    client: httpx.AsyncClient, shm: Path
) -> None:
    job = await create_job(client, machines=2, replicas=2, persist_every=K, keep_persisted=100)
    token = bearer(str(job["worker_token"]))
    machines = []
    for m in range(2):
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines",
            json={"instance_id": f"i-{m}", "address": "127.0.0.1", "data_port": 7000 + m},
            headers=token,
        )
        assert response.status_code == 200, response.text
        registration = RegisterResponse.model_validate(response.json())
        holdings = Holdings(shm / f"m{m}")
        rank = registration.rank
        services = SimpleNamespace(
            holdings=holdings,
            registration=registration,
            registered=registration,
            client=RootOverHttp(client, job),
            identity=SimpleNamespace(instance_id=f"i-{m}"),
            machine_rank=rank,
            local_ranks=lambda rank=rank: [rank],
        )
        uploads = Uploads(services)  # type: ignore[arg-type]
        store = SlowStore(LocalDirStore(Path(str(registration.persistent.path))), 3 * K if m == 0 else 0)
        uploads._store = store  # type: ignore[assignment]
        checkpointer = Checkpointer(holdings.directory("local", rank), slots=4, blocking=True)
        machines.append((rank, uploads, store, checkpointer))

    async def heartbeat(rank: int, uploads: Uploads, iteration: int) -> set[int]:
        """A REST heartbeat with the machine's summary; the answer's persist schedule goes to its uploads."""
        summary = {"local": {str(rank): iteration}, "persist_missed": uploads.missed_report()}
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/heartbeat",
            json={"instance_id": f"i-{rank}", "summary": summary},
            headers=token,
        )
        assert response.status_code == 200, response.text
        persist = HeartbeatResponse.model_validate(response.json()).persist
        assert persist is not None and persist.every == K
        uploads.announce(persist)
        return set() if persist.iteration is None else {persist.iteration}

    announced: set[int] = set()
    try:
        for iteration in range(1, ITERATIONS + 1):
            for rank, uploads, store, checkpointer in machines:
                assert checkpointer.save(iteration, {"w": torch.full((256,), float(iteration + rank))})
                uploads.notice_commit(rank, iteration)
                await store.advance(iteration)
            for rank, uploads, _, _ in machines:
                if iteration % HEARTBEAT_EVERY[rank] == 0:
                    announced |= await heartbeat(rank, uploads, iteration)
            for _, uploads, store, _ in machines:
                await settle(uploads, store)
        # Training ended: the slow store lets its puts through; every machine hears the last target.
        for rank, uploads, store, _ in machines:
            await store.advance(ITERATIONS, ended=True)
            announced |= await heartbeat(rank, uploads, ITERATIONS)
        for _, uploads, _, _ in machines:
            await asyncio.gather(*uploads._running.values(), return_exceptions=True)
    finally:
        for _, uploads, _, checkpointer in machines:
            checkpointer.close()
            await uploads.close()

    checkpoints = (await client.get(f"/api/v1/jobs/{job['id']}/checkpoints", headers=admin())).json()
    shards = {c["iteration"]: sorted(s["rank"] for s in c["shards"]) for c in checkpoints}
    directive = (await client.get(f"/api/v1/worker/jobs/{job['id']}/directive", headers=token)).json()
    current = directive["persist"]["iteration"]
    # Every uploaded shard is part of a complete checkpoint, at an iteration the root announced (only the
    # target still in progress, if one was committed, may be partial).
    assert shards and all(ranks == [0, 1] for i, ranks in shards.items() if i != current), shards
    assert set(shards) <= announced, (shards, announced)
    assert all(iteration % K == 0 for iteration in shards)
    # The slow uploads made the schedule go at their pace, not stop: several complete checkpoints.
    assert len(shards) >= 3, shards
    # The directive announces the same target to every agent (etcd mode's channel), past the last complete.
    assert directive["persist"]["every"] == K and current % K == 0
    assert current > max(i for i, ranks in shards.items() if ranks == [0, 1])
    assert sum(u.failed for _, u, _, _ in machines) == 0


class RecordingStore:
    """A persistent tier and a root that record what reaches them."""

    def __init__(self) -> None:
        self.puts: list[str] = []
        self.reports: list[dict[str, Any]] = []

    async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard:
        self.puts.append(key)
        return PersistedShard(key, f"file:///{key}", manifest.digest, manifest.data_bytes)

    async def report_persisted(self, rank: int, body: dict[str, Any]) -> None:
        self.reports.append(body)


def commit(holdings: Holdings, *iterations: int) -> None:
    """Rank 0 of `holdings` commits `iterations` (each a tensor of its own number)."""
    with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
        for iteration in iterations:
            assert checkpointer.save(iteration, {"w": torch.full((256,), float(iteration))})


def unscheduled_uploads(holdings: Holdings, store: RecordingStore) -> Uploads:
    """Machine 0's uploads (one rank, every K iterations on its own commits) to `store`."""
    registration = SimpleNamespace(
        persist_every=K, job_id=uuid.uuid4(), persistent=SimpleNamespace(prefix="castor")
    )
    services = SimpleNamespace(
        holdings=holdings,
        registration=registration,
        registered=registration,
        client=store,
        identity=SimpleNamespace(instance_id="i-0"),
        machine_rank=0,
        local_ranks=lambda: [0],
    )
    uploads = Uploads(services)  # type: ignore[arg-type]
    uploads._store = store  # type: ignore[assignment]
    return uploads


async def test_an_upload_is_reported_in_flight_from_its_staging_until_the_root_heard_of_it(shm: Path) -> None:
    """A recovery's plan waits for the uploads the inventory names (services.root.domain.recovery): one
    staged and not yet reported is named, one reported or failed is not."""

    class HeldStore(RecordingStore):
        def __init__(self) -> None:
            super().__init__()
            self.release = asyncio.Event()
            self.fail = False

        async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard:
            await self.release.wait()
            if self.fail:
                raise OSError("the bucket is unreachable")
            return await super().put(key, manifest, data)

    holdings = Holdings(shm / "m0")
    store = HeldStore()
    uploads = unscheduled_uploads(holdings, store)

    async def named_once_staged() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while not uploads.in_flight():
            assert loop.time() < deadline, "the upload was not staged in 30 s"
            await asyncio.sleep(0.001)

    commit(holdings, K, 2 * K)
    try:
        assert uploads.in_flight() == []
        uploads.notice_commit(0, K)
        await named_once_staged()
        assert uploads.in_flight() == [{"rank": 0, "iteration": K, "generation": 1}]
        store.release.set()
        await asyncio.gather(*uploads._running.values())
        assert uploads.in_flight() == [] and [r["iteration"] for r in store.reports] == [K]

        store.release.clear()
        store.fail = True
        uploads.notice_commit(0, 2 * K)
        await named_once_staged()
        assert uploads.in_flight() == [{"rank": 0, "iteration": 2 * K, "generation": 1}]
        store.release.set()
        await asyncio.gather(*uploads._running.values())
        assert uploads.in_flight() == [] and uploads.failed == 1  # unscheduled: not retried
    finally:
        await uploads.close()
        holdings.close()


@pytest.mark.parametrize(
    ("answer", "puts"),
    [
        # The root refused the report: the same shard is not uploaded again while the target stands.
        (RootRejected(422, "persisted_iteration_unannounced", "past the announced iteration"), 1),
        # The root was unreachable, or lost a race it asks to have retried: the staged shard is sent again.
        (RootUnavailable("no root replica answered"), 2),
        (RootRejected(409, "conflict", "the request conflicts with existing data; retry or change it"), 2),
    ],
    ids=["refused", "unavailable", "conflict"],
)
async def test_a_report_the_root_refuses_is_not_uploaded_again(
    shm: Path, answer: Exception, puts: int
) -> None:
    """Before, a 4xx answer to a scheduled shard's report was retried like an unreachable root: the shard was
    uploaded again on every backoff (up to 30 s apart) for as long as the agent still held the target, and
    the upload stayed named in flight, so a recovery's plan could wait for it. A refused target is reported
    missed, so the root announces another instead of waiting for this rank's shard for good."""

    class AnsweringStore(RecordingStore):
        def __init__(self) -> None:
            super().__init__()
            self.answers: list[Exception] = [answer]

        async def report_persisted(self, rank: int, body: dict[str, Any]) -> None:
            if self.answers:
                raise self.answers.pop(0)
            await super().report_persisted(rank, body)

    holdings = Holdings(shm / "m0")
    store = AnsweringStore()
    uploads = unscheduled_uploads(holdings, store)
    uploads.RETRY_S = (0.01,)
    with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
        assert checkpointer.save(K, {"w": torch.full((256,), float(K))})
    try:
        uploads.announce(SimpleNamespace(iteration=K, generation=1))
        await asyncio.wait_for(asyncio.gather(*uploads._running.values()), 30)
    finally:
        await uploads.close()
        holdings.close()
    assert len(store.puts) == puts and uploads.failed == 1
    assert len(store.reports) == puts - 1 and uploads.in_flight() == []
    refused = {"iteration": K, "generation": 1} if puts == 1 else None
    assert uploads.missed_report() == refused


async def test_a_copy_corrupt_in_memory_is_not_uploaded(shm: Path) -> None:
    """Before, a local copy corrupted after its commit was uploaded and reported with the manifest's digest:
    counted toward a complete checkpoint (retention could then delete older good ones), found only by the
    restore that needed it."""
    from tests.integration.worker_lib.test_dataplane import flip_a_bit

    holdings = Holdings(shm / "m0")
    store = RecordingStore()
    uploads = unscheduled_uploads(holdings, store)
    commit(holdings, K, 2 * K)
    flip_a_bit(holdings.directory("local", 0), K)
    try:
        for iteration in (K, 2 * K):
            uploads.notice_commit(0, iteration)
            await asyncio.gather(*uploads._running.values())
    finally:
        await uploads.close()
        holdings.close()
    assert uploads.failed == 1 and uploads.uploaded == 1
    assert [r["iteration"] for r in store.reports] == [2 * K] and len(store.puts) == 1


async def test_a_target_announced_before_the_ranks_restart_waits_for_their_commit_of_it(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The root announces a recovery's first target with its plan, before the ranks restart; the slots still
    hold the abandoned history's commits, some past the target. Those are not the target's commit: before,
    the agent took them for a rank that had committed past it, reported the target missed, and never
    uploaded the new generation's commit of it."""
    holdings = Holdings(shm / "m0")
    store = RecordingStore()
    uploads = unscheduled_uploads(holdings, store)
    monkeypatch.setenv(GENERATION_ENV, "1")
    with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
        assert checkpointer.save(2 * K + 1, {"w": torch.full((256,), 1.0)})  # generation 1, rolled back
    try:
        uploads.announce(SimpleNamespace(iteration=K, generation=2))  # generation 2 restored K - 1
        await asyncio.wait_for(asyncio.gather(*uploads._running.values()), 30)
        assert uploads.missed_report() is None

        monkeypatch.setenv(GENERATION_ENV, "2")
        with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
            assert checkpointer.save(K, {"w": torch.full((256,), 2.0)})
        uploads.notice_commit(0, K)
        await asyncio.wait_for(asyncio.gather(*uploads._running.values()), 30)
    finally:
        await uploads.close()
        holdings.close()
    assert [(r["iteration"], r["generation"]) for r in store.reports] == [(K, 2)]
    assert uploads.missed_report() is None


async def test_a_shard_that_cannot_be_staged_is_reported_missed_and_the_next_target_uploads(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a staging failure other than a corrupt or overwritten copy (here the slot unreadable: EIO)
    ended the upload task with an exception nobody read: the rank counted as handled, nothing was retried
    or reported, and the root waited for its shard, persisting nothing, until the next recovery."""
    holdings = Holdings(shm / "m0")
    store = RecordingStore()
    uploads = unscheduled_uploads(holdings, store)
    with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
        assert checkpointer.save(K, {"w": torch.full((256,), float(K))})
    read_slot = holdings.open_read

    def unreadable_once(rank: int, iteration: int, tier: str) -> Any:
        monkeypatch.setattr(holdings, "open_read", read_slot)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(holdings, "open_read", unreadable_once)
    try:
        uploads.announce(SimpleNamespace(iteration=K, generation=1))
        await asyncio.wait_for(asyncio.gather(*uploads._running.values()), 30)
        assert uploads.missed_report() == {"iteration": K, "generation": 1}
        assert uploads.failed == 1 and uploads.in_flight() == [] and store.puts == []

        with Checkpointer(holdings.directory("local", 0), blocking=True) as checkpointer:
            assert checkpointer.save(2 * K, {"w": torch.full((256,), float(2 * K))})
        uploads.announce(SimpleNamespace(iteration=2 * K, generation=1))  # the root's answer to the miss
        await asyncio.wait_for(asyncio.gather(*uploads._running.values()), 30)
    finally:
        await uploads.close()
        holdings.close()
    assert [r["iteration"] for r in store.reports] == [2 * K]
    assert uploads.missed_report() is None


async def test_an_upload_given_up_while_its_thread_stages_cannot_overwrite_the_next_ones_shard(
    shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling an upload does not stop its staging thread. Before, that thread took the rank's staging
    buffer when it got to it: the next target's, already staged and being uploaded. Iteration K's bytes then
    went out under 2K's manifest and digest, and the root counted them toward a complete checkpoint (only a
    restore from the persistent tier would have found them)."""

    class HeldStore(RecordingStore):
        def __init__(self) -> None:
            super().__init__()
            self.release = asyncio.Event()
            self.held = asyncio.Event()
            self.sent: list[bytes] = []

        async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard:
            self.held.set()
            await self.release.wait()  # a multipart upload reads the buffer for a while
            self.sent.append(bytes(data))
            return await super().put(key, manifest, data)

    holdings = Holdings(shm / "m0")
    store = HeldStore()
    uploads = unscheduled_uploads(holdings, store)
    commit(holdings, K, 2 * K)
    with holdings.open_read(0, 2 * K, tier="local") as (_, data):
        shard_of_2k = bytes(data)
    read_slot = holdings.open_read
    opening_k, may_read_k, k_done = threading.Event(), threading.Event(), threading.Event()
    k_copied: list[bool] = []  # K's thread copied its slot out (the race below really ran)

    @contextlib.contextmanager
    def slow_to_open_k(rank: int, iteration: int, tier: str) -> Iterator[tuple[Manifest, memoryview]]:
        if iteration == K:
            opening_k.set()
            may_read_k.wait(30)
        try:
            with read_slot(rank, iteration, tier=tier) as opened:
                yield opened
            if iteration == K:
                k_copied.append(True)
        finally:
            if iteration == K:
                k_done.set()

    monkeypatch.setattr(holdings, "open_read", slow_to_open_k)
    try:
        uploads.announce(SimpleNamespace(iteration=K, generation=1))
        assert await asyncio.to_thread(opening_k.wait, 30)
        uploads.announce(SimpleNamespace(iteration=2 * K, generation=1))  # K given up: its thread still runs
        await asyncio.wait_for(store.held.wait(), 30)  # 2K staged and being uploaded
        may_read_k.set()
        assert await asyncio.to_thread(k_done.wait, 30) and k_copied
        store.release.set()
        await asyncio.wait_for(asyncio.gather(*uploads._running.values()), 30)
    finally:
        await uploads.close()
        holdings.close()
    assert [r["iteration"] for r in store.reports] == [2 * K]
    assert store.sent == [shard_of_2k]
