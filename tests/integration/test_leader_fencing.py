"""A fenced leader, on a real Postgres and etcd: a new leader's epoch refuses the deposed leader's writes
(and waits for the one it has in flight); two replicas on one Postgres without etcd never both lead, and
the second takes over when the first goes; the etcd coordinator uses every endpoint it is given (the first
one dead here) and a leader whose lease refresh hangs stops by its own clock."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from services.root.clients import etcd
from services.root.clients.etcd import EtcdCoordinator
from services.root.clients.local import LocalOperator
from services.root.db.database import Database
from services.root.db.migrate import upgrade_async
from services.root.db.models import LeaderEpoch
from services.root.orchestration import Deposed, Orchestrator, leadership
from services.root.settings import Settings
from tests import harness


@pytest.fixture
async def database(postgres_server: harness.Postgres) -> AsyncIterator[Database]:
    url = postgres_server.create_database(f"fence_{uuid.uuid4().hex[:8]}")
    await upgrade_async(url)
    db = Database(url)
    yield db
    await db.dispose()


def replica(database: Database, tmp_path: Path, name: str) -> Orchestrator:
    settings = Settings(database_url=database.url, state_dir=tmp_path / name, admin_token="x")
    operator = LocalOperator(settings.resolved_public_url, tmp_path / name, tmp_path / "shm")
    orchestrator = Orchestrator(database, settings, operator, None)
    orchestrator.candidate = name
    return orchestrator


async def epoch_row(database: Database) -> LeaderEpoch:
    async with database.session() as session:
        return (await session.execute(select(LeaderEpoch))).scalar_one()


async def test_a_deposed_leaders_writes_are_refused(database: Database, tmp_path: Path) -> None:
    old, new = replica(database, tmp_path, "old"), replica(database, tmp_path, "new")
    await old.leadership.claim_epoch(None)
    async with old.leadership.session() as session:  # the leader's transactions go through
        (await session.execute(select(LeaderEpoch))).scalar_one().holder = "written by old"

    # The old leader is in the middle of a transaction when the new one is elected: the new epoch waits
    # for it (the old leader's write lands before the hand-over, never after).
    in_flight = old.leadership.session()
    await in_flight.__aenter__()  # it holds the epoch row FOR SHARE until it commits
    claim = asyncio.create_task(new.leadership.claim_epoch(None))
    await asyncio.sleep(0.5)
    assert not claim.done(), "the new epoch waits for the old leader's transaction in flight"
    await in_flight.__aexit__(None, None, None)
    await asyncio.wait_for(claim, 10)
    assert new.epoch is not None and old.epoch is not None and new.epoch > old.epoch

    # From now on every transaction of the old leader is refused, and it steps down.
    with pytest.raises(Deposed):
        async with old.leadership.session() as session:
            (await session.execute(select(LeaderEpoch))).scalar_one().holder = "written by the deposed"
    assert old.leadership.deposed.is_set()
    assert (await epoch_row(database)).holder == "new"
    async with new.leadership.session() as session:
        (await session.execute(select(LeaderEpoch))).scalar_one().holder = "written by new"
    assert (await epoch_row(database)).holder == "written by new"


async def test_a_new_leader_ends_the_session_of_a_leader_that_froze_mid_transaction(
    database: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leadership, "EPOCH_LOCK_WAIT_S", 0.5)
    old, new = replica(database, tmp_path, "old"), replica(database, tmp_path, "new")
    await old.leadership.claim_epoch(None)
    # The old leader's host froze (or died without a FIN) inside a fenced transaction: its session holds the
    # epoch row FOR SHARE and never commits. Before, the new leader waited for it until TCP keepalive
    # dropped the session (two hours by default), and no replica led meanwhile.
    frozen = old.leadership.session()
    session = await frozen.__aenter__()
    await asyncio.wait_for(new.leadership.claim_epoch(None), 30)
    assert new.epoch is not None and old.epoch is not None and new.epoch > old.epoch
    assert (await epoch_row(database)).holder == "new"
    # The frozen transaction, if its host comes back, cannot commit: its session was ended.
    with pytest.raises(DBAPIError):
        (await session.execute(select(LeaderEpoch))).scalar_one().holder = "written by the frozen"
        await frozen.__aexit__(None, None, None)
    with contextlib.suppress(Exception):
        await frozen.__aexit__(DBAPIError, None, None)
    assert (await epoch_row(database)).holder == "new"
    async with new.leadership.session() as fenced:
        (await fenced.execute(select(LeaderEpoch))).scalar_one().holder = "written by new"
    assert (await epoch_row(database)).holder == "written by new"


async def test_two_replicas_on_one_postgres_without_etcd_never_both_lead(
    database: Database, tmp_path: Path
) -> None:
    first, second = replica(database, tmp_path, "first"), replica(database, tmp_path, "second")
    runs = {first: asyncio.create_task(first.run()), second: asyncio.create_task(second.run())}
    try:
        leader = await _eventually_one_leader([first, second])
        follower = second if leader is first else first
        for _ in range(10):  # a while, both campaigning: one leader throughout
            await asyncio.sleep(0.2)
            assert (first.is_leader, second.is_leader).count(True) == 1
        runs[leader].cancel()  # the leader goes: its session, and with it the lock, is dropped
        with contextlib.suppress(asyncio.CancelledError):
            await runs[leader]
        assert await _eventually_one_leader([follower]) is follower
        assert (await epoch_row(database)).holder == follower.candidate
    finally:
        for task in runs.values():
            task.cancel()
        await asyncio.gather(*runs.values(), return_exceptions=True)


async def test_without_etcd_a_deposed_leader_steps_down_and_a_leader_follows(
    database: Database, tmp_path: Path
) -> None:
    """A deposition ends the advisory-lock campaign by itself (its session, and the lock, dropped), and the
    replicas elect a leader again, with a newer epoch: never a root with no leader."""
    first, second = replica(database, tmp_path, "first"), replica(database, tmp_path, "second")
    runs = [asyncio.create_task(first.run()), asyncio.create_task(second.run())]
    try:
        leader = await _eventually_one_leader([first, second])
        deposed_epoch = leader.epoch
        assert deposed_epoch is not None
        leader.leadership.depose("a test deposes it")
        for _ in range(150):
            await asyncio.sleep(0.1)
            leaders = [r for r in (first, second) if r.is_leader and r.epoch is not None]
            if leaders and leaders[0].epoch != deposed_epoch:
                break
        else:
            raise TimeoutError("no replica leads again after the deposition")
        (new_leader,) = leaders
        assert new_leader.epoch is not None and new_leader.epoch > deposed_epoch
    finally:
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


async def test_a_leader_whose_connections_postgres_dropped_leads_again_and_its_writes_go_through(
    database: Database, postgres_server: harness.Postgres, tmp_path: Path
) -> None:
    """Postgres restarts (or fails over): every connection of the root dies, the advisory lock's session
    and the pooled ones, which the root does not ping before use. The leader loses the lock with its
    session, and a lone replica must lead again on its own, with a newer epoch, its transactions going
    through: a root that lost its leadership for good would drive no recovery again."""
    name = database.url.rsplit("/", 1)[1]
    only = replica(database, tmp_path, "only")
    run = asyncio.create_task(only.run())
    try:
        leader = await _eventually_one_leader([only])
        before = leader.epoch
        assert before is not None
        async with leader.leadership.session() as session:  # a pooled connection, as the leader's loops use
            (await session.execute(select(LeaderEpoch))).scalar_one()
        postgres_server.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        )
        for _ in range(300):
            await asyncio.sleep(0.1)
            if only.is_leader and only.epoch is not None and only.epoch > before:
                break
        else:
            raise TimeoutError(
                f"the replica does not lead again (leader: {only.is_leader}, epoch {only.epoch})"
            )
        written = False
        for _ in range(3):  # a pooled connection that died fails one transaction (answered 503 retry)
            try:
                async with only.leadership.session() as session:
                    (await session.execute(select(LeaderEpoch))).scalar_one().holder = "after the restart"
                written = True
                break
            except (DBAPIError, Deposed):
                await asyncio.sleep(0.2)
        assert written, "the leader's transactions go through again"
        assert (await epoch_row(database)).holder == "after the restart"
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


async def test_a_replica_starting_while_another_leads_can_run_its_migrations(
    database: Database, tmp_path: Path
) -> None:
    """A second root replica runs the migrations at start-up (a no-op here, but under their lock) while
    the first leads without etcd: the leadership's advisory lock must not be the migrations' lock, or the
    new replica never starts."""
    first = replica(database, tmp_path, "first")
    run = asyncio.create_task(first.run())
    try:
        await _eventually_one_leader([first])
        await asyncio.wait_for(upgrade_async(database.url), 60)
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


async def _eventually_one_leader(replicas: list[Orchestrator]) -> Orchestrator:
    for _ in range(150):
        leaders = [r for r in replicas if r.is_leader and r.epoch is not None]
        if leaders:
            assert len(leaders) == 1
            return leaders[0]
        await asyncio.sleep(0.1)
    raise TimeoutError("no replica became leader")


def dead_endpoint() -> str:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


async def test_the_coordinator_fails_over_to_the_next_etcd_endpoint(etcd_server: harness.Etcd) -> None:
    prefix = f"/test-{uuid.uuid4().hex[:6]}"
    coordinator = EtcdCoordinator([dead_endpoint(), etcd_server.endpoint], prefix)
    elected, lost = asyncio.Event(), asyncio.Event()
    campaign = asyncio.create_task(coordinator.lead("a", elected, lost))
    try:
        await asyncio.wait_for(elected.wait(), 10)
        assert coordinator.leading() and coordinator.epoch is not None
        assert await coordinator.leader() == "a"
        await asyncio.sleep(1.5)  # past the first endpoint's failure, refreshes keep the lease
        assert not lost.is_set() and coordinator.leading()
    finally:
        campaign.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await campaign
        await coordinator.close()


async def test_a_leader_whose_refresh_hangs_stops_by_its_own_clock(
    etcd_server: harness.Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"/test-{uuid.uuid4().hex[:6]}"
    coordinator = EtcdCoordinator([etcd_server.endpoint], prefix)
    elected, lost = asyncio.Event(), asyncio.Event()
    campaign = asyncio.create_task(coordinator.lead("a", elected, lost))
    try:
        await asyncio.wait_for(elected.wait(), 10)

        async def hang(lease: object, client: object) -> None:
            await asyncio.Event().wait()  # a refresh that never answers (a partition, a stuck server)

        monkeypatch.setattr("services.root.clients.etcd._refresh", hang)
        await asyncio.wait_for(lost.wait(), 10)
        assert not coordinator.leading()
    finally:
        campaign.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await campaign
        await coordinator.close()


async def test_a_leader_moves_to_the_next_endpoint_when_its_etcd_member_goes_silent(
    etcd_server: harness.Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that died without a RST (its host froze) answers nothing until gRPC's 5 s deadline: the
    refresh ran out the lease on it, the other endpoints never tried, and the leadership flapped."""
    prefix = f"/test-{uuid.uuid4().hex[:6]}"
    # Two clients of one server: the first goes silent, the second still answers.
    coordinator = EtcdCoordinator([etcd_server.endpoint, etcd_server.endpoint], prefix)
    elected, lost = asyncio.Event(), asyncio.Event()
    campaign = asyncio.create_task(coordinator.lead("a", elected, lost))
    try:
        await asyncio.wait_for(elected.wait(), 10)
        assert coordinator._current == 0
        refresh = etcd._refresh
        silent = coordinator._clients[0]

        async def silent_member(lease: object, client: object) -> object:
            if client is silent:
                await asyncio.Event().wait()
            return await refresh(lease, client)

        monkeypatch.setattr(etcd, "_refresh", silent_member)
        await asyncio.sleep(3 * coordinator.leader_ttl_s)
        assert not lost.is_set() and coordinator.leading(), "the lease was refreshed on the other endpoint"
        assert coordinator._current == 1
    finally:
        campaign.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await campaign
        await coordinator.close()
