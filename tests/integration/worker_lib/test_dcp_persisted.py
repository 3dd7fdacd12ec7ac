"""Exporting a persisted checkpoint to DCP from the real persistent tiers (a moto S3 server, a local
directory): every rank's shard is downloaded, checked against the recorded digest, and written."""

from __future__ import annotations

import asyncio
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import aioboto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests import harness
from worker_lib import Checkpointer
from worker_lib.errors import CheckpointError
from worker_lib.export import export_persisted, persisted_store
from worker_lib.persistent import LocalDirStore, ObjectStore, PersistedShard, S3Store, shard_key
from worker_lib.store.slots import SlotStore

ITERATION = 40


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["s3", "local"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ObjectStore, str | None]:
    if request.param == "local":
        return LocalDirStore(tmp_path / "persistent"), None
    moto: harness.Moto = request.getfixturevalue("moto_server")
    bucket = f"castor-{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        async with aioboto3.Session().client("s3", endpoint_url=moto.url) as s3:
            await s3.create_bucket(Bucket=bucket)

    asyncio.run(create())
    return S3Store(bucket, endpoint_url=moto.url), moto.url


def persist(store: ObjectStore, shm: Path, states: list[dict[str, object]]) -> list[PersistedShard]:
    """Each rank's checkpoint of ITERATION, uploaded where the root would put it."""
    shards = []
    for rank, state in enumerate(states):
        with Checkpointer(shm / f"rank-{rank}", blocking=True) as checkpointer:
            checkpointer.save(ITERATION, state)
        with SlotStore(shm / f"rank-{rank}").open_read(ITERATION) as (manifest, data):
            key = shard_key("castor", "job-x", ITERATION, rank)
            shards.append(asyncio.run(store.put(key, manifest, data)))
    return shards


def test_every_rank_is_downloaded_checked_and_written(
    tier: tuple[ObjectStore, str | None], shm: Path, tmp_path: Path
) -> None:
    store, endpoint = tier
    # Two ranks holding different entries: the export must carry both (not one rank's state).
    states: list[dict[str, object]] = [
        {"a": torch.arange(300, dtype=torch.float32), "epoch": 2},
        {"b": torch.arange(50, dtype=torch.int64) * 7, "epoch": 2},
    ]
    shards = persist(store, shm, states)
    located = persisted_store(shards[0].location, shards[0].key, endpoint_url=endpoint)
    assert type(located) is type(store)
    phases: list[tuple[str, int, int]] = []
    export_persisted(
        located,
        [(s.key, s.digest) for s in shards],
        ITERATION,
        tmp_path / "out",
        scratch=shm,
        progress=lambda phase, done, total: phases.append((phase, done, total)),
    )
    state: dict[str, object] = {"a": torch.zeros(300), "b": torch.zeros(50, dtype=torch.int64), "epoch": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "out")))
    assert torch.equal(state["a"], states[0]["a"])  # type: ignore[arg-type]
    assert torch.equal(state["b"], states[1]["b"])  # type: ignore[arg-type]
    assert state["epoch"] == 2
    assert ("download", 2, 2) in phases and phases[-1][0] == "write" and phases[-1][1] == phases[-1][2] > 0
    assert [p.name for p in shm.iterdir() if p.name.startswith(".castor-export-")] == [], "scratch removed"


def test_a_shard_that_is_not_the_recorded_one_is_refused(
    tier: tuple[ObjectStore, str | None], shm: Path, tmp_path: Path
) -> None:
    store, _ = tier
    shards = persist(store, shm, [{"a": torch.ones(10)}, {"a": torch.ones(10)}])
    with pytest.raises(CheckpointError, match="not the checkpoint the root recorded"):
        export_persisted(
            store,
            [(shards[0].key, shards[0].digest), (shards[1].key, "0" * 16)],
            ITERATION,
            tmp_path / "out",
            scratch=shm,
        )
    assert not (tmp_path / "out" / ".metadata").exists()
