"""Export a Castor checkpoint to a standard torch.distributed.checkpoint (DCP) directory.

Plain `dcp.load(state, storage_reader=FileSystemReader(directory))` reads the result at any world size and
sharding (DCP reshards on load). Two ways in, one conversion:

- `export_dcp(checkpointer, directory)`: in the job, every rank runs it (a collective, with the world size
  the checkpoint was saved with); each rank writes its own shards from its shared memory.
- `export_shards(shards, directory)`: one process holding every rank's checkpoint (manifest and data),
  e.g. `castor checkpoints export`, which downloads a persisted checkpoint (`export_persisted`) first.

Each rank's checkpoint becomes a list of DCP write items without copying its bytes: a checkpoint written
through CastorWriter gives back its items as saved; one written by `Checkpointer.save` is named as
`dcp.save` names a state (nested keys joined by '.', modules and optimizers as their state_dict): a
tensor is one item (replicated, as DCP counts a plain tensor: one rank writes it), a DTensor's local shard
an item at its offsets in the global tensor, and any other value DCP's pickled bytes. DCP's FileSystemWriter
writes the files, so the directory is DCP's own format.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import shutil
import tempfile
import warnings
from collections import ChainMap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from worker_lib.checkpointer import Checkpointer
from worker_lib.dcp import (
    Ref,
    choose_iteration,
    dcp_payload,
    decode_metadata,
    find_manifest,
    is_dcp_tree,
)
from worker_lib.errors import CheckpointError, CheckpointNotFoundError
from worker_lib.persistent import LocalDirStore, ObjectStore, S3Store
from worker_lib.persistent_keys import checkpoint_prefix
from worker_lib.restore import _ReadOnlyTensor
from worker_lib.store.copy import CopyEngine
from worker_lib.store.integrity import verify
from worker_lib.store.layout import dtype_from_name
from worker_lib.store.manifest import Manifest
from worker_lib.store.slots import SlotStore
from worker_lib.store.tree import unflatten

__all__ = ["export_dcp", "export_persisted", "export_shards", "persisted_store"]

# progress(done_bytes, total_bytes), called as items are written
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class _Shard:
    """A DTensor node of a Checkpointer.save checkpoint: its local shard and where it sits."""

    spec: dict[str, Any]
    local: Ref


def export_dcp(
    checkpointer: Checkpointer,
    directory: str | os.PathLike[str],
    iteration: int | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    progress: Progress | None = None,
) -> Metadata:
    """Write a Castor checkpoint of this job as a standard DCP directory (a collective: every rank).

    `iteration` defaults to the one `Checkpointer.restore` would pick. Each rank reads its own checkpoint
    from local memory (after a recovery the agent has brought it there from a peer or the persistent tier),
    verifies every checksum, and writes its items; replicated items are written once. Refused when the
    world size differs from the one the checkpoint was saved with: each rank holds only its own shards.
    """
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(process_group) if distributed else 1
    engine = CopyEngine()
    try:
        with contextlib.ExitStack() as stack:
            problem: Exception | None = None
            items: list[_Item] = []
            try:
                if iteration is None:
                    iteration = choose_iteration(checkpointer)
                    if iteration is None:
                        raise CheckpointNotFoundError(f"{checkpointer.directory}: no checkpoint to export")
                find_manifest(checkpointer, iteration)  # a clear error when this rank lacks it
                manifest, data = stack.enter_context(checkpointer._store.open_read(iteration))
                items = _prepared(manifest, data, iteration, world, engine)
                Path(directory).mkdir(parents=True, exist_ok=True)
                if not distributed or dist.get_rank(process_group) == 0:
                    # DCP's coordinator (group rank 0) writes .metadata last, after rewriting the rank
                    # files in place: an export into a directory exported to before that failed midway
                    # would leave the old metadata over mixed data, read without complaint.
                    (Path(directory) / ".metadata").unlink(missing_ok=True)
            except Exception as exc:
                problem = exc
            # Agreed before the collective: a rank that cannot export would otherwise leave the others
            # waiting inside dcp.save until the process group's timeout.
            _all_ready(problem, distributed, process_group)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                metadata: Metadata = dcp_save(
                    {},
                    storage_writer=FileSystemWriter(os.fspath(directory)),
                    planner=_ExportPlanner(items, progress),
                    process_group=process_group,
                    no_dist=not distributed,
                )
            return metadata
    finally:
        engine.close()


def _prepared(
    manifest: Manifest, data: memoryview, iteration: int, world: int, engine: CopyEngine
) -> list[_Item]:
    saved = _saved_world_size(manifest)
    if saved is not None and saved != world:
        raise CheckpointError(
            f"iteration {iteration} was saved by {saved} ranks: export it with {saved} ranks (here "
            f"{world}), each exporting its own shards, or export the persisted checkpoint with "
            "`castor checkpoints export`"
        )
    verify(manifest, data, engine)
    return shard_items(manifest, data)


def _all_ready(problem: Exception | None, distributed: bool, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank when any rank of `group` cannot export (its own error on that rank)."""
    if distributed:
        problems: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, None if problem is None else str(problem), group=group)
    else:
        problems = [None]
    if problem is not None:
        raise problem
    for rank, text in enumerate(problems):
        if text is not None:
            raise CheckpointError(f"rank {rank} cannot export: {text}")


def export_shards(
    shards: Sequence[tuple[Manifest, memoryview]],
    directory: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
) -> Metadata:
    """Write every rank's checkpoint (`shards`: each rank's manifest and data region, in rank order) as one
    standard DCP directory, from this process alone. Every checksum is verified first."""
    if not shards:
        raise CheckpointError("no shards to export")
    iterations = {manifest.iteration for manifest, _ in shards}
    if len(iterations) != 1:
        raise CheckpointError(f"the shards are of different iterations: {sorted(iterations)}")
    items: list[_Item] = []
    engine = CopyEngine()
    try:
        for manifest, data in shards:
            verify(manifest, data, engine)
            items.extend(shard_items(manifest, data))
    finally:
        engine.close()
    Path(directory).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        metadata: Metadata = dcp_save(
            {},
            storage_writer=FileSystemWriter(os.fspath(directory)),
            planner=_ExportPlanner(items, progress),
            no_dist=True,
        )
    return metadata


@dataclass(frozen=True)
class _Item:
    item: WriteItem
    value: Callable[[], torch.Tensor | bytes]  # reads the bytes when FileSystemWriter asks for them
    nbytes: int
    planner_data: tuple[str, tuple[str | int, ...]] | None = None


def shard_items(manifest: Manifest, data: memoryview) -> list[_Item]:
    """One rank's checkpoint as DCP write items over its (verified) data region, nothing copied yet."""
    region = _ReadOnlyTensor(data)

    def tensor(index: int) -> Callable[[], torch.Tensor]:
        entry = manifest.tensors[index]
        return lambda: region.view(entry, dtype_from_name(entry.dtype))

    tree = manifest.tree
    if isinstance(tree, dict) and is_dcp_tree(tree):
        return _dcp_items(manifest, tensor)
    return _native_items(manifest, tensor)


def _dcp_items(manifest: Manifest, tensor: Callable[[int], Callable[[], torch.Tensor]]) -> list[_Item]:
    payload = dcp_payload(manifest)
    metadata = decode_metadata(payload["metadata"])
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    out: list[_Item] = []
    for fqn, kind, offsets, ref in payload["items"]:
        assert isinstance(ref, Ref)
        entry = manifest.tensors[ref.index]
        path = mappings.get(fqn)
        planner_data = (fqn, tuple(path)) if path is not None else None
        if kind == "bytes":
            read = tensor(ref.index)
            out.append(
                _Item(
                    WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, BytesIOWriteData(entry.nbytes)),
                    lambda read=read: read().numpy().tobytes(),  # type: ignore[misc]
                    entry.nbytes,
                    planner_data,
                )
            )
            continue
        described = metadata.state_dict_metadata[fqn]
        assert isinstance(described, TensorStorageMetadata)
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(entry.shape))
        item_type = WriteItemType.SHARD if kind == "shard" else WriteItemType.TENSOR
        write = WriteItem(
            MetadataIndex(fqn, offsets),
            item_type,
            tensor_data=TensorWriteData(chunk, described.properties, described.size),
        )
        out.append(_Item(write, tensor(ref.index), entry.nbytes, planner_data))
    return out


def _native_items(manifest: Manifest, tensor: Callable[[int], Callable[[], torch.Tensor]]) -> list[_Item]:
    state = unflatten(manifest.tree, Ref, lambda spec, local: _Shard(dict(spec), local))
    if not isinstance(state, dict):
        state = {"state": state}
    out: list[_Item] = []

    def visit(path: tuple[str | int, ...], value: Any) -> None:
        fqn = ".".join(map(str, path))
        if isinstance(value, Ref | _Shard):
            ref = value if isinstance(value, Ref) else value.local
            entry = manifest.tensors[ref.index]
            shape = torch.Size(entry.shape)
            offsets, size, item_type = torch.Size([0] * len(shape)), shape, WriteItemType.TENSOR
            if isinstance(value, _Shard):
                if any(p and p[0] == "partial" for p in value.spec.get("placements", [])):
                    raise CheckpointError(
                        f"{fqn}: a DTensor with a Partial placement (a pending reduction) cannot be exported"
                    )
                offsets = torch.Size(value.spec["offsets"])
                size = torch.Size(value.spec["shape"])
                item_type = WriteItemType.SHARD
            properties = TensorProperties(dtype=dtype_from_name(entry.dtype))
            write = WriteItem(
                MetadataIndex(fqn, offsets),
                item_type,
                tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, shape), properties, size),
            )
            out.append(_Item(write, tensor(ref.index), entry.nbytes, (fqn, path)))
            return
        buffer = io.BytesIO()
        # What DCP does with a value it does not traverse (read back by its planner): a tuple, tensors in
        # it included, is one pickled value.
        torch.save(_with_tensors(value, tensor, fqn), buffer)
        raw = buffer.getvalue()
        write = WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO, BytesIOWriteData(len(raw)))
        out.append(_Item(write, lambda raw=raw: raw, len(raw), (fqn, path)))  # type: ignore[misc]

    traverse_state_dict(state, visit, keep_traversing=lambda v: isinstance(v, torch.Tensor | Ref | _Shard))
    return out


def _with_tensors(value: Any, tensor: Callable[[int], Callable[[], torch.Tensor]], fqn: str) -> Any:
    """`value` (a part of the decoded tree DCP treats as one value) with the tensors it refers to."""
    if isinstance(value, Ref):
        return tensor(value.index)().clone()  # its own storage: views of one region pickle as one
    if isinstance(value, _Shard):
        raise CheckpointError(f"{fqn}: a DTensor inside a tuple cannot be exported (DCP pickles it whole)")
    if isinstance(value, dict):
        return {key: _with_tensors(item, tensor, fqn) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_with_tensors(item, tensor, fqn) for item in value)
    return value


def _saved_world_size(manifest: Manifest) -> int | None:
    tree = manifest.tree
    if isinstance(tree, dict) and is_dcp_tree(tree):
        saved = dcp_payload(manifest).get("world_size")
    else:
        saved = manifest.meta.get("world_size")
    return saved if isinstance(saved, int) else None


class _ExportPlanner(SavePlanner):
    """Plans a DCP save of checkpoint items: each rank offers its own, the global plan keeps one copy of
    each replicated item (DCP's dedup) and records the metadata as DCP's default planner does."""

    def __init__(self, items: list[_Item], progress: Progress | None):
        unique: dict[MetadataIndex, _Item] = {}
        for item in items:
            unique.setdefault(item.item.index, item)  # a process holding several ranks: one copy each
        self._items = unique
        self._progress = progress
        self._done = 0
        self._total = 0

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        mappings = {i.planner_data[0]: i.planner_data[1] for i in self._items.values() if i.planner_data}
        return SavePlan([i.item for i in self._items.values()], planner_data=mappings)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(dedup_save_plans(all_plans))
        mappings = [p.planner_data for p in all_plans if isinstance(p.planner_data, dict)]
        return plans, dataclasses.replace(metadata, planner_data=dict(ChainMap(*mappings)))

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self._total = sum(self._items[i.index].nbytes for i in new_plan.items)
        self._report()
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        item = self._items[write_item.index]
        value = item.value()
        self._done += item.nbytes
        self._report()
        if isinstance(value, bytes):
            return io.BytesIO(value)
        return value

    def _report(self) -> None:
        if self._progress is not None:
            self._progress(min(self._done, self._total), self._total)


def persisted_store(location: str, shard_key: str, *, endpoint_url: str | None = None) -> ObjectStore:
    """The persistent tier a persisted checkpoint lies in, from its location (`file:///<dir>/<prefix>` or
    `s3://<bucket>/<prefix>`, as the root records it) and one of its shard keys."""
    parsed = urlparse(location)
    prefix = checkpoint_prefix(shard_key)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, endpoint_url=endpoint_url)
    if parsed.scheme == "file":
        path = unquote(parsed.path).rstrip("/")
        if not path.endswith("/" + prefix):
            raise CheckpointError(
                f"persisted location {location!r} does not end with its key prefix {prefix!r}"
            )
        return LocalDirStore(Path(path[: -len(prefix) - 1]))
    raise CheckpointError(f"unsupported persisted location {location!r}: expected file:// or s3://")


def export_persisted(
    store: ObjectStore,
    shards: Sequence[tuple[str, str]],
    iteration: int,
    directory: str | os.PathLike[str],
    *,
    scratch: str | os.PathLike[str],
    progress: Callable[[str, int, int], None] | None = None,
) -> Metadata:
    """Download every rank's persisted shard (`shards`: (key, digest) in rank order), each verified stripe
    by stripe against the checksum the root recorded, into stores under `scratch` (removed afterwards),
    then export them with `export_shards`. `progress(phase, done, total)`: ("download", ranks done, ranks),
    then ("write", bytes, bytes)."""
    work = Path(tempfile.mkdtemp(prefix=".castor-export-", dir=scratch))
    try:
        stores = []
        for rank, (key, digest) in enumerate(shards):
            if progress is not None:
                progress("download", rank, len(shards))
            # Scratch space for one export, next to its target by default: storage is meant here.
            destination = SlotStore(work / f"rank-{rank}", expect_memory=False)
            asyncio.run(store.get(key, destination, iteration=iteration, digest=digest))
            stores.append(destination)
        if progress is not None:
            progress("download", len(shards), len(shards))
        with contextlib.ExitStack() as stack:
            for opened_store in stores:
                stack.callback(opened_store.close)  # after the reads below let go (last in, first out)
            opened = [stack.enter_context(s.open_read(iteration)) for s in stores]
            write = None if progress is None else (lambda done, total: progress("write", done, total))
            return export_shards(opened, directory, progress=write)
    finally:
        shutil.rmtree(work, ignore_errors=True)
