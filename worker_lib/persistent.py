"""The persistent tier: S3 (production, aioboto3 multipart uploads) or a local directory (embedded mode).

A persisted checkpoint of one rank is two objects under `<prefix>/<job>/iteration-<I>/rank-<r>/gen-<g>/`
(the layout is `worker_lib.persistent_keys`): `data.bin` (the slot's data region, byte for byte) and
`manifest.json` (written last: a rank's shard is complete only when its manifest exists). Downloads go
straight into a slot of the destination store; the manifest must be the one the root recorded (digest)
and every stripe is verified before the slot is committed.

Every key is checked (`check_key`: relative, no '.' or '..' segment), and a delete names the scope it
must stay strictly inside (the root passes `<prefix>/<job>`): the root deletes with its own credentials,
so a key that reached it wrongly must not reach another job's checkpoints, or anything else.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from worker_lib.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from worker_lib.persistent_keys import check_key, checkpoint_prefix, is_within, shard_key
from worker_lib.store.integrity import check_structure
from worker_lib.store.manifest import Manifest, UnsupportedManifestError

if TYPE_CHECKING:
    # Only a type here: slots imports the copy engine (torch), and the root service deletes checkpoints
    # through this module without torch (tests/unit/test_import_boundary.py).
    from worker_lib.store.slots import SlotStore

PART_BYTES = 16 << 20  # multipart part size: S3 needs >= 5 MiB parts, bigger parts mean fewer requests
UPLOAD_CONCURRENCY = 4


__all__ = [
    "LocalDirStore",
    "ObjectStore",
    "PersistedShard",
    "S3Store",
    "checkpoint_prefix",
    "object_store",
    "shard_key",
]


def check_expected(
    manifest: Manifest, where: str, iteration: int | None = None, digest: str | None = None
) -> None:
    """The downloaded manifest is self-consistent and the one the recovery plan chose."""
    check_structure(manifest)
    if iteration is not None and manifest.iteration != iteration:
        raise CheckpointCorruptError(
            f"{where} holds iteration {manifest.iteration}, not the planned iteration {iteration}"
        )
    if digest is not None and manifest.digest != digest:
        raise CheckpointCorruptError(
            f"{where} is not the checkpoint the root recorded (digest {manifest.digest}, expected {digest})"
        )


@dataclass(frozen=True)
class PersistedShard:
    key: str  # the shard's key prefix (data.bin and manifest.json below it)
    location: str  # URI of the checkpoint (all ranks), e.g. s3://bucket/prefix/job/iteration-20
    digest: str
    nbytes: int


class ObjectStore(Protocol):
    async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard: ...

    async def get(
        self, key: str, destination: SlotStore, iteration: int | None = None, digest: str | None = None
    ) -> Manifest:
        """Download a shard into `destination`, verified: its manifest must be self-consistent (and of
        `iteration`, with `digest`, when given), every stripe must match its checksum."""

    async def delete(self, key: str, *, within: str) -> None:
        """Delete everything under `key` (a shard or a whole checkpoint), which must lie strictly inside
        `within` (ValueError otherwise, and nothing is deleted)."""


def _check_scope(key: str, within: str) -> None:
    if not is_within(key, within):
        raise ValueError(f"refusing to delete {key!r}: it is not a key strictly inside {within!r}")


def object_store(config: dict[str, Any]) -> ObjectStore:
    """The store the root describes at registration: {"kind": "s3", "bucket", "region", "endpoint_url"} or
    {"kind": "local", "path"}."""
    if config["kind"] == "s3":
        return S3Store(config["bucket"], region=config.get("region"), endpoint_url=config.get("endpoint_url"))
    return LocalDirStore(Path(config["path"]))


def _verify_stripe(view: memoryview, manifest: Manifest, index: int) -> None:
    stripe = manifest.stripes[index]
    if xxhash.xxh3_64_hexdigest(view[stripe.start : stripe.end]) != stripe.digest:
        raise CheckpointCorruptError(
            f"persisted checkpoint of iteration {manifest.iteration}: stripe {index} (bytes "
            f"{stripe.start}..{stripe.end}) does not match its checksum",
            ranges=[(stripe.start, stripe.end)],
        )


def _write_durably(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _served_manifest(raw: bytes, where: str) -> Manifest:
    """A shard's manifest as the tier served it. One that does not decode is corruption like a failed stripe
    (CheckpointCorruptError): the agent reports the shard unusable and the root's next plan rolls back past
    it. A plain ValueError reported nothing, so every plan named the same object until the job failed."""
    try:
        return Manifest.from_json(raw)
    except UnsupportedManifestError as exc:
        # Another Castor version's shard, not a damaged one: condemning it could have retention delete a
        # checkpoint that version reads. This restore fails without naming it unusable.
        raise CheckpointError(f"{where}/manifest.json: {exc}; this Castor version cannot read it") from exc
    except ValueError as exc:
        raise CheckpointCorruptError(f"{where}/manifest.json is unreadable: {exc}") from exc


class LocalDirStore:
    """A directory as the persistent tier (embedded one-machine mode)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"key {key!r} escapes the persistent directory")
        return path

    async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard:
        await asyncio.to_thread(self._put, key, manifest, data)
        location = f"file://{self._path(checkpoint_prefix(key))}"
        return PersistedShard(key, location, manifest.digest, manifest.data_bytes)

    def _put(self, key: str, manifest: Manifest, data: memoryview) -> None:
        """Durable before it returns: the root then counts the shard toward a complete checkpoint and
        retention deletes older ones, so after a power loss (in embedded mode this tier is the one that
        survives) the newest must be whole. Each file is fsynced before its rename, and each directory
        after the entries made in it."""
        directory = self._path(key)
        made = [d for d in (directory, *directory.parents) if not d.exists()]
        directory.mkdir(parents=True, exist_ok=True)
        for created in reversed(made):  # each new directory's entry in its parent
            _fsync_directory(created.parent)
        _write_durably(directory / "data.bin.tmp", data)
        os.replace(directory / "data.bin.tmp", directory / "data.bin")
        _write_durably(directory / "manifest.json.tmp", manifest.to_json())
        os.replace(directory / "manifest.json.tmp", directory / "manifest.json")  # complete only now
        _fsync_directory(directory)  # both renames

    async def get(
        self, key: str, destination: SlotStore, iteration: int | None = None, digest: str | None = None
    ) -> Manifest:
        return await asyncio.to_thread(self._get, key, destination, iteration, digest)

    def _get(self, key: str, destination: SlotStore, iteration: int | None, digest: str | None) -> Manifest:
        directory = self._path(key)
        try:
            raw = (directory / "manifest.json").read_bytes()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no persisted checkpoint at {directory}") from None
        manifest = _served_manifest(raw, str(directory))
        check_expected(manifest, str(directory), iteration, digest)
        writer = destination.open_write(manifest.iteration, manifest.data_bytes, on_busy="wait")
        assert writer is not None
        try:
            view = memoryview(writer.buffer)
            with open(directory / "data.bin", "rb") as source:
                for index, stripe in enumerate(manifest.stripes):
                    if source.readinto(view[stripe.start : stripe.end]) != stripe.end - stripe.start:
                        raise CheckpointCorruptError(
                            f"{directory}/data.bin is shorter than its manifest says"
                        )
                    _verify_stripe(view, manifest, index)
            writer.commit(manifest)
        except BaseException:
            writer.abort()
            raise
        return manifest

    async def delete(self, key: str, *, within: str) -> None:
        await asyncio.to_thread(self._delete, key, within)

    def _delete(self, key: str, within: str) -> None:
        _check_scope(key, within)
        # No symlink anywhere on the way: a link inside the tier could point the delete at another job's
        # directory (or out of the tier) although the key itself is in scope. rmtree does not follow
        # links inside the tree it removes.
        root = self.root.resolve()
        path = root / key
        if path.resolve() != path:
            raise ValueError(f"refusing to delete {key!r}: a symbolic link is on its path")
        shutil.rmtree(path, ignore_errors=True)


class S3Store:
    """An S3 bucket as the persistent tier, through aioboto3 (multipart uploads, streamed ranged reads)."""

    def __init__(self, bucket: str, *, region: str | None = None, endpoint_url: str | None = None):
        import aioboto3

        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self._session = aioboto3.Session(region_name=region)

    def _client(self) -> Any:
        return self._session.client("s3", endpoint_url=self.endpoint_url)

    async def put(self, key: str, manifest: Manifest, data: memoryview) -> PersistedShard:
        check_key(key)
        async with self._client() as s3:
            await self._put_data(s3, f"{key}/data.bin", data)
            await s3.put_object(Bucket=self.bucket, Key=f"{key}/manifest.json", Body=manifest.to_json())
        location = f"s3://{self.bucket}/{checkpoint_prefix(key)}"
        return PersistedShard(key, location, manifest.digest, manifest.data_bytes)

    async def _put_data(self, s3: Any, key: str, data: memoryview) -> None:
        if len(data) <= PART_BYTES:
            await s3.put_object(Bucket=self.bucket, Key=key, Body=bytes(data))
            return
        upload = await s3.create_multipart_upload(Bucket=self.bucket, Key=key)
        upload_id = upload["UploadId"]
        try:
            offsets = list(range(0, len(data), PART_BYTES))
            limit = asyncio.Semaphore(UPLOAD_CONCURRENCY)

            async def part(number: int, offset: int) -> dict[str, Any]:
                async with limit:
                    body = bytes(
                        data[offset : offset + PART_BYTES]
                    )  # botocore needs bytes, one part at a time
                    result = await s3.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                    )
                    return {"ETag": result["ETag"], "PartNumber": number}

            uploads = [asyncio.ensure_future(part(n, o)) for n, o in enumerate(offsets, start=1)]
            try:
                parts = await asyncio.gather(*uploads)
            except BaseException:
                # The other parts are stopped and awaited before the abort below: a part that completed
                # after it would be stored (and billed) as an orphan of an upload that no longer exists.
                for upload_task in uploads:
                    upload_task.cancel()
                await asyncio.gather(*uploads, return_exceptions=True)
                raise
            await s3.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
            )
        except BaseException:
            await s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    async def get(
        self, key: str, destination: SlotStore, iteration: int | None = None, digest: str | None = None
    ) -> Manifest:
        check_key(key)
        async with self._client() as s3:
            try:
                response = await s3.get_object(Bucket=self.bucket, Key=f"{key}/manifest.json")
            except s3.exceptions.NoSuchKey:
                raise CheckpointNotFoundError(
                    f"no persisted checkpoint at s3://{self.bucket}/{key}"
                ) from None
            async with response["Body"] as body:
                manifest = _served_manifest(await body.read(), f"s3://{self.bucket}/{key}")
            check_expected(manifest, f"s3://{self.bucket}/{key}", iteration, digest)
            writer = destination.open_write(manifest.iteration, manifest.data_bytes, on_busy="wait")
            assert writer is not None
            try:
                view = memoryview(writer.buffer)
                response = await s3.get_object(Bucket=self.bucket, Key=f"{key}/data.bin")
                position, stripe = 0, 0
                stream = response["Body"]
                try:
                    async for chunk in stream.iter_chunks(8 << 20):
                        end = position + len(chunk)
                        if end > manifest.data_bytes:
                            raise CheckpointCorruptError(f"s3://{self.bucket}/{key}/data.bin is too long")
                        view[position:end] = chunk
                        position = end
                        while stripe < len(manifest.stripes) and manifest.stripes[stripe].end <= position:
                            _verify_stripe(view, manifest, stripe)
                            stripe += 1
                finally:
                    stream.close()
                if position != manifest.data_bytes:
                    raise CheckpointCorruptError(
                        f"s3://{self.bucket}/{key}/data.bin is shorter than its manifest"
                    )
                writer.commit(manifest)
            except BaseException:
                writer.abort()
                raise
        return manifest

    async def delete(self, key: str, *, within: str) -> None:
        _check_scope(key, within)
        listed, errors = 0, []
        async with self._client() as s3:
            paginator = s3.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=key + "/"):
                objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if objects:
                    listed += len(objects)
                    answer = await s3.delete_objects(
                        Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True}
                    )
                    # A batch delete answers 200 even when some keys were not deleted (access denied, a
                    # bucket policy, throttling): each is listed in Errors, not raised. The other pages
                    # are still deleted.
                    errors += answer.get("Errors", [])
        if errors:
            first = errors[0]
            raise OSError(
                f"S3 did not delete {len(errors)} of {listed} objects under s3://{self.bucket}/{key}/, "
                f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
            )
