"""The persistent tier's key layout, the local directory store's delete scope (real files, links), and what an
S3 delete that leaves objects behind says."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from worker_lib.persistent import LocalDirStore, S3Store
from worker_lib.persistent_keys import check_key, is_within, job_prefix, rank_prefix, shard_key

JOB = "0b6c7f5e-53a1-4d5e-9f3a-0c1d2e3f4a5b"


def test_the_layout_is_prefix_job_iteration_rank_generation() -> None:
    assert shard_key("castor", JOB, 20, 3, 2) == f"castor/{JOB}/iteration-20/rank-3/gen-2"
    assert shard_key("/team/castor/", JOB, 0, 0) == f"team/castor/{JOB}/iteration-0/rank-0/gen-1"
    assert shard_key("", JOB, 1, 1) == f"{JOB}/iteration-1/rank-1/gen-1", "no leading '/' without a prefix"
    assert rank_prefix("castor", JOB, 20, 3) == f"castor/{JOB}/iteration-20/rank-3"


@pytest.mark.parametrize(
    "key", ["", "/etc", "castor//x", "castor/../x", "..", "../", "./x", "castor/.", "a\\b", "a\x00b", "a\nb"]
)
def test_keys_that_are_not_plain_relative_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError):
        check_key(key)


@pytest.mark.parametrize("job_id", ["", "a/b", "..", "."])
def test_a_job_id_must_be_one_plain_segment(job_id: str) -> None:
    with pytest.raises(ValueError):
        job_prefix("castor", job_id)


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_numbers_in_a_key_are_counts(value: int) -> None:
    with pytest.raises(ValueError):
        shard_key("castor", JOB, value, 0)


def test_within_means_strictly_below_the_scope() -> None:
    scope = job_prefix("castor", JOB)
    assert is_within(rank_prefix("castor", JOB, 10, 0), scope)
    assert not is_within(scope, scope), "the scope itself is not inside it"
    assert not is_within(f"{scope}-other/iteration-1", scope), "a sibling sharing the text is not inside"
    assert not is_within(f"{scope}/../other", scope)
    assert not is_within("castor", scope)


def tree(root: Path, *keys: str) -> None:
    for key in keys:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(b"x")


async def test_local_delete_stays_inside_its_scope(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "tier")
    mine, theirs = job_prefix("castor", JOB), job_prefix("castor", "other-job")
    tree(
        store.root, f"{mine}/iteration-1/rank-0/gen-1/data.bin", f"{theirs}/iteration-1/rank-0/gen-1/data.bin"
    )
    tree(tmp_path, "outside.bin")
    for key in ("castor", mine, theirs, f"{theirs}/iteration-1", f"{mine}/../other-job/iteration-1", "../"):
        with pytest.raises(ValueError):
            await store.delete(key, within=mine)
    assert (store.root / theirs / "iteration-1/rank-0/gen-1/data.bin").exists()
    assert (tmp_path / "outside.bin").exists()
    await store.delete(f"{mine}/iteration-1", within=mine)
    assert not (store.root / mine / "iteration-1").exists()


async def test_local_delete_follows_no_symlink_out_of_its_scope(tmp_path: Path) -> None:
    """A link inside the job's own prefix that points at another job's directory, or out of the tier: the
    key is in scope, the directory it reaches is not."""
    store = LocalDirStore(tmp_path / "tier")
    mine, theirs = job_prefix("castor", JOB), job_prefix("castor", "other-job")
    tree(store.root, f"{theirs}/iteration-1/rank-0/gen-1/data.bin")
    tree(tmp_path, "elsewhere/keep.bin")
    (store.root / mine / "iteration-1").mkdir(parents=True)
    os.symlink(store.root / theirs / "iteration-1" / "rank-0", store.root / mine / "iteration-1" / "rank-0")
    os.symlink(tmp_path / "elsewhere", store.root / mine / "iteration-2")
    for key in (f"{mine}/iteration-1/rank-0", f"{mine}/iteration-1/rank-0/gen-1", f"{mine}/iteration-2"):
        with pytest.raises(ValueError, match="symbolic link"):
            await store.delete(key, within=mine)
    assert (store.root / theirs / "iteration-1/rank-0/gen-1/data.bin").exists()
    assert (tmp_path / "elsewhere/keep.bin").exists()
    # A link deeper in the tree being removed is removed as a link; its target stays.
    (store.root / mine / "iteration-3" / "rank-0").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", store.root / mine / "iteration-3" / "rank-0" / "gen-1")
    await store.delete(f"{mine}/iteration-3", within=mine)
    assert not (store.root / mine / "iteration-3").exists()
    assert (tmp_path / "elsewhere/keep.bin").exists()


class DeniedS3:
    """An S3 client, reduced to what S3Store.delete calls, listing two keys a page, whose first batch delete
    refuses one key (S3 answers 200 and lists the refusals in Errors)."""

    def __init__(self, keys: list[str]):
        self.keys = keys
        self.deleted: list[str] = []

    async def __aenter__(self) -> DeniedS3:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def get_paginator(self, operation: str) -> DeniedS3:
        assert operation == "list_objects_v2"
        return self

    async def paginate(self, Bucket: str, Prefix: str) -> AsyncIterator[dict[str, Any]]:
        keys = [key for key in self.keys if key.startswith(Prefix)]
        for start in range(0, len(keys), 2):
            yield {"Contents": [{"Key": key} for key in keys[start : start + 2]]}

    async def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        keys = [item["Key"] for item in Delete["Objects"]]
        if self.deleted:
            self.deleted += keys
            return {}
        self.deleted += keys[:-1]
        return {"Errors": [{"Key": keys[-1], "Code": "AccessDenied", "Message": "Access Denied"}]}


async def test_an_s3_delete_that_leaves_objects_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, a batch delete's refusals (listed in its 200 answer) went unnoticed: retention believed the
    checkpoint gone while its objects stayed in the bucket. Now the delete fails, and the root logs it; the
    other pages' objects are deleted all the same."""
    store = S3Store("bucket")
    keys = [f"castor/job/iteration-4/rank-{rank}/data.bin" for rank in range(3)]
    client = DeniedS3(keys)
    monkeypatch.setattr(store, "_client", lambda: client)
    with pytest.raises(OSError, match=r"did not delete 1 of 3 objects .*rank-1/data.bin: AccessDenied"):
        await store.delete("castor/job/iteration-4", within="castor/job")
    assert client.deleted == [keys[0], keys[2]]
