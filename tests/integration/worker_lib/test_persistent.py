"""The persistent tier against real endpoints: a moto S3 server (multipart) and a local directory."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import aioboto3
import pytest
import torch

from tests import harness
from worker_lib import CheckpointCorruptError, Checkpointer, CheckpointError
from worker_lib.persistent import LocalDirStore, ObjectStore, S3Store, shard_key
from worker_lib.store.slots import SlotStore


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["s3", "local"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalDirStore(tmp_path / "persistent")
    moto: harness.Moto = request.getfixturevalue("moto_server")
    bucket = f"castor-{uuid.uuid4().hex[:8]}"
    async with aioboto3.Session().client("s3", endpoint_url=moto.url) as s3:
        await s3.create_bucket(Bucket=bucket)
    return S3Store(bucket, endpoint_url=moto.url)


def checkpoint(directory: Path, iteration: int, numel: int) -> SlotStore:
    with Checkpointer(directory, blocking=True) as checkpointer:
        checkpointer.save(
            iteration, {"w": torch.arange(numel, dtype=torch.float32) + iteration, "it": iteration}
        )
    return SlotStore(directory)


async def test_round_trip_is_bit_exact_and_restorable(store: ObjectStore, shm: Path) -> None:
    source = checkpoint(shm / "src", 20, 9 << 20)  # 36 MiB: three multipart parts on S3
    key = shard_key("castor", "job-1", 20, 3)
    with source.open_read() as (manifest, data):
        shard = await store.put(key, manifest, data)
        original = bytes(data)
    assert shard.digest == manifest.digest and shard.nbytes == manifest.data_bytes
    assert shard.location.endswith("job-1/iteration-20")

    destination = SlotStore(shm / "dst")
    fetched = await store.get(key, destination)
    assert fetched.digest == manifest.digest
    with destination.open_read() as (_, data):
        assert bytes(data) == original
    restored = Checkpointer(shm / "dst").restore()
    assert restored is not None and restored.iteration == 20 and restored.state["w"][5].item() == 25.0

    await store.delete(key, within="castor/job-1")
    with pytest.raises(Exception, match="no persisted checkpoint"):
        await store.get(key, SlotStore(shm / "again"))


async def test_corrupted_object_is_detected_and_not_committed(
    store: ObjectStore, shm: Path, tmp_path: Path
) -> None:
    source = checkpoint(shm / "src", 7, 1 << 20)
    key = shard_key("castor", "job-2", 7, 0)
    with source.open_read() as (manifest, data):
        damaged = bytearray(data)
        damaged[1000] ^= 1
        await store.put(key, manifest, memoryview(damaged))
    destination = SlotStore(shm / "dst")
    with pytest.raises(CheckpointCorruptError, match="stripe 0"):
        await store.get(key, destination)
    assert destination.committed() == [], "a checkpoint that failed its checksum is never committed"


async def overwrite_manifest(store: ObjectStore, key: str, raw: bytes) -> None:
    if isinstance(store, LocalDirStore):
        (store.root / key / "manifest.json").write_bytes(raw)
        return
    assert isinstance(store, S3Store)
    async with aioboto3.Session().client("s3", endpoint_url=store.endpoint_url) as s3:
        await s3.put_object(Bucket=store.bucket, Key=f"{key}/manifest.json", Body=raw)


@pytest.mark.parametrize(
    "garbage",
    [b"{", b"\xff\xfe not text", b'{"format": 1}', b'{"format": 1, "iteration": "seven"}'],
    ids=["truncated", "not-utf8", "fields-missing", "ill-typed"],
)
async def test_an_unreadable_manifest_is_corruption(store: ObjectStore, shm: Path, garbage: bytes) -> None:
    """Before, a manifest the tier served that did not decode raised a plain ValueError: the agent reported
    no unusable shard, so the root condemned nothing and every new plan named the same object until the
    job failed, where a corrupt shard makes the next plan roll back to an older checkpoint."""
    source = checkpoint(shm / "src", 7, 1 << 12)
    key = shard_key("castor", "job-4", 7, 0)
    with source.open_read() as (manifest, data):
        await store.put(key, manifest, data)
    await overwrite_manifest(store, key, garbage)
    destination = SlotStore(shm / "dst")
    with pytest.raises(CheckpointCorruptError, match="manifest"):
        await store.get(key, destination, iteration=7, digest=manifest.digest)
    assert destination.committed() == []


async def test_another_versions_manifest_is_refused_but_not_called_corrupt(
    store: ObjectStore, shm: Path
) -> None:
    """A manifest of a format this version does not read is another version's shard, not a damaged one: the
    restore fails, but the shard is not reported unusable (the root would condemn it for good)."""
    source = checkpoint(shm / "src", 7, 1 << 12)
    key = shard_key("castor", "job-5", 7, 0)
    with source.open_read() as (manifest, data):
        await store.put(key, manifest, data)
    newer = json.loads(manifest.to_json())
    newer["format"] += 1
    await overwrite_manifest(store, key, json.dumps(newer).encode())
    with pytest.raises(CheckpointError, match="cannot read it") as refused:
        await store.get(key, SlotStore(shm / "dst"), iteration=7, digest=manifest.digest)
    assert not isinstance(refused.value, CheckpointCorruptError)


async def test_a_shard_that_is_not_the_planned_one_is_refused(store: ObjectStore, shm: Path) -> None:
    """After a rollback the same iteration number is another history: the digest the root recorded tells
    them apart, and the wrong one is never committed."""
    source = checkpoint(shm / "src", 12, 1 << 16)
    key = shard_key("castor", "job-3", 12, 0, generation=2)
    assert key.endswith("iteration-12/rank-0/gen-2")
    with source.open_read() as (manifest, data):
        await store.put(key, manifest, data)
    destination = SlotStore(shm / "dst")
    with pytest.raises(CheckpointCorruptError, match="not the checkpoint the root recorded"):
        await store.get(key, destination, iteration=12, digest="0" * 16)
    with pytest.raises(CheckpointCorruptError, match="not the planned iteration 11"):
        await store.get(key, destination, iteration=11, digest=manifest.digest)
    assert destination.committed() == []
    fetched = await store.get(key, destination, iteration=12, digest=manifest.digest)
    assert [m.digest for m in destination.committed()] == [fetched.digest]


async def test_a_delete_outside_its_scope_is_refused_and_touches_nothing(
    store: ObjectStore, shm: Path
) -> None:
    """The root deletes with its own credentials: a key outside the job's prefix (or the prefix itself, or
    one with '..') is refused by the store itself, and a delete never reaches a sibling sharing the text."""
    source = checkpoint(shm / "src", 1, 1 << 10)
    keys = [
        shard_key("castor", "job-a", 1, 0),
        shard_key("castor", "job-b", 1, 0),
        shard_key("castor", "job-b", 10, 0),  # "iteration-1" is a textual prefix of "iteration-10"
    ]
    with source.open_read() as (manifest, data):
        for key in keys:
            await store.put(key, manifest, data)
    for hostile in ("castor", "castor/job-b", "castor/job-a/iteration-1", "castor/job-b/../job-a", "/castor"):
        with pytest.raises(ValueError):
            await store.delete(hostile, within="castor/job-b")
    await store.delete("castor/job-b/iteration-1", within="castor/job-b")
    with pytest.raises(Exception, match="no persisted checkpoint"):
        await store.get(keys[1], SlotStore(shm / "gone"))
    for index, key in ((0, keys[0]), (2, keys[2])):
        fetched = await store.get(key, SlotStore(shm / f"kept-{index}"))
        assert fetched.digest == manifest.digest
