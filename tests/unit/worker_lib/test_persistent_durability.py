"""The persistent tier's writes: a local-directory shard is durable (each file fsynced before its rename,
each directory after the entries made in it) before `put` returns, since the root then lets retention
delete older checkpoints; an S3 multipart upload that fails stops its other parts before the abort."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from worker_lib import Checkpointer, persistent
from worker_lib.persistent import LocalDirStore, S3Store, shard_key
from worker_lib.store.slots import SlotStore


@pytest.fixture
def source() -> Iterator[SlotStore]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    with Checkpointer(path, blocking=True) as checkpointer:
        checkpointer.save(7, {"w": torch.arange(1000, dtype=torch.float32)})
    yield SlotStore(path)
    shutil.rmtree(path, ignore_errors=True)


async def test_a_local_shard_is_durable_before_put_returns(
    source: SlotStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def replace(source_path: Any, target: Any) -> None:
        events.append(("rename", str(target)))
        real_replace(source_path, target)

    monkeypatch.setattr(persistent.os, "fsync", fsync)
    monkeypatch.setattr(persistent.os, "replace", replace)
    root = tmp_path / "tier"
    key = shard_key("castor", "job-1", 7, 0)
    with source.open_read() as (manifest, data):
        await LocalDirStore(root).put(key, manifest, data)
    shard = str((root / key).resolve())
    order = [(what, path.removeprefix(str(tmp_path))) for what, path in events]
    relative = shard.removeprefix(str(tmp_path))
    # Each file reaches the disk before its name does, and the names after both renames.
    assert order.index(("fsync", f"{relative}/data.bin.tmp")) < order.index(
        ("rename", f"{relative}/data.bin")
    )
    manifest_synced = order.index(("fsync", f"{relative}/manifest.json.tmp"))
    manifest_named = order.index(("rename", f"{relative}/manifest.json"))
    assert manifest_synced < manifest_named < order.index(("fsync", relative))
    # Every directory the put made has its entry synced in its parent (the tier's root included).
    made = [Path(shard), *Path(shard).parents]
    made = [d for d in made if d.is_relative_to(root.resolve())]
    for directory in made:
        assert ("fsync", str(directory.parent).removeprefix(str(tmp_path))) in order, directory


class FailingS3:
    """Just enough of an S3 client for one multipart upload whose part 2 fails while the others are on
    the wire: records when each call starts and ends."""

    def __init__(self) -> None:
        self.log: list[str] = []

    async def create_multipart_upload(self, **_: Any) -> dict[str, str]:
        return {"UploadId": "u-1"}

    async def upload_part(self, PartNumber: int, **_: Any) -> dict[str, str]:
        self.log.append(f"part {PartNumber} started")
        try:
            await asyncio.sleep(0.01 if PartNumber == 2 else 0.5)
            if PartNumber == 2:
                raise ConnectionResetError("part 2: connection reset")
        finally:
            self.log.append(f"part {PartNumber} ended")
        return {"ETag": f"e{PartNumber}"}

    async def complete_multipart_upload(self, **_: Any) -> None:
        self.log.append("complete")

    async def abort_multipart_upload(self, **_: Any) -> None:
        self.log.append("abort")


async def test_a_failed_multipart_upload_stops_its_other_parts_before_the_abort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(persistent, "PART_BYTES", 1 << 10)
    store = S3Store.__new__(S3Store)  # no session: the client is the fake
    store.bucket = "b"
    client = FailingS3()
    with pytest.raises(ConnectionResetError):
        await store._put_data(client, "k/data.bin", memoryview(bytes(4 << 10)))
    assert client.log[-1] == "abort", client.log
    assert "complete" not in client.log
    started = [entry for entry in client.log if entry.endswith("started")]
    assert len(started) == persistent.UPLOAD_CONCURRENCY
    assert all(entry.replace("started", "ended") in client.log[:-1] for entry in started)
