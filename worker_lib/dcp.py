"""torch.distributed.checkpoint (DCP) on Castor: a StorageWriter/StorageReader pair, and an export.

Code that checkpoints with `dcp.save` / `dcp.async_save` / `dcp.load` (torchtitan-style) switches to
Castor's memory tier by swapping the storage object:

    dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=step))
    reader = CastorReader(checkpointer)
    if reader.select() is not None:          # the iteration Checkpointer.restore would pick (or None)
        dcp.load(state, storage_reader=reader)

Each rank's write items (tensor chunks, and the bytes DCP pickles non-tensor values into) become one
ordinary Castor checkpoint of that rank (`Checkpointer.save`), so the copy, checksums, replication to peers,
the persistent tier and recovery planning are those of any other checkpoint. Two choices make a rank's
checkpoint self-sufficient, so that a load reads only its own rank's memory:

- Each rank keeps every item of its own local plan, including the replicated ones (plain tensors, bytes)
  that DCP's planner assigns to a single rank to write: a rank needs them back from its own memory.
- The coordinator computes the global metadata (every chunk of every rank, as `dcp.save` records it) while
  planning, and passes it to every rank in its plan; each rank stores it beside its items. A load then
  plans exactly as DCP does against the global metadata, and a rank that would need another rank's chunk
  (a different sharding or world size) is refused with an error that points to the export.

`worker_lib.export` turns a Castor checkpoint (written through CastorWriter, or by `Checkpointer.save`)
into a standard DCP directory that plain `dcp.load(..., storage_reader=FileSystemReader(dir))` reads at
any world size and sharding.

The metadata is stored in the manifest as JSON through Castor's state codec, never pickled (a replica
crosses machines); the bytes items are what DCP itself pickles (`torch.save`), loaded by DCP's planner.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import threading
from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from worker_lib.agent_ipc import FRESH_START
from worker_lib.checkpointer import (
    NOT_DISTRIBUTED,
    RESTORE_ITERATION_ENV,
    Checkpointer,
    held_iterations,
    newest_common_iteration,
)
from worker_lib.errors import CheckpointError, CheckpointNotFoundError
from worker_lib.store.manifest import Manifest
from worker_lib.store.tree import unflatten

__all__ = ["CastorReader", "CastorWriter"]

# The key of a DCP checkpoint's payload in the Castor state (the whole state is {KEY: payload}).
KEY = "castor_dcp"
FORMAT = 1
_KINDS = {WriteItemType.TENSOR: "tensor", WriteItemType.SHARD: "shard", WriteItemType.BYTE_IO: "bytes"}
_TYPES = {name: kind for kind, name in _KINDS.items()}

ItemKey = tuple[str, tuple[int, ...] | None]


@dataclass(frozen=True)
class CastorStorageInfo:
    """Where `dcp.save` recorded an item (Metadata.storage_data): the Castor checkpoint of `rank` at
    `iteration`. Every rank also keeps the replicated items DCP assigned to another rank to write."""

    rank: int
    iteration: int


def iteration_from_id(checkpoint_id: str | os.PathLike[str] | int) -> int:
    """The iteration a DCP checkpoint_id names: an int, or a path or name ending in digits ("step-100")."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id
    match = re.search(r"(\d+)$", str(checkpoint_id).rstrip("/"))
    if match is None:
        raise ValueError(
            f"checkpoint_id {str(checkpoint_id)!r} names no iteration: Castor needs an int, or an id ending "
            "in digits such as 'step-100'"
        )
    return int(match.group(1))


class CastorWriter(StorageWriter):
    """A DCP StorageWriter into Castor's memory tier: `dcp.save(state, storage_writer=CastorWriter(ckpt,
    iteration=step))`, or `checkpoint_id="step-100"`.

    Returns like `Checkpointer.save`: by default the copy runs in the background and is finished before
    the next optimizer step (a Checkpointer made with `blocking=True` returns once committed); call
    `checkpointer.wait()` before changing saved tensors in place anywhere else. The state's tensors that
    are no parameter or state of an optimizer seen stepping (buffers, which forward changes in place) are
    snapshotted inside the save; before any optimizer step the save waits for its copy (see
    Checkpointer._save_detached). With `dcp.async_save`, DCP stages a copy first and the save runs on its
    thread: the writer, called on another thread than the one that made it, returns once the copy is
    committed, so `.result()` means committed and the stager may reuse its buffers. A save skipped by
    `on_busy="skip"` returns normally too (as a skipped asynchronous save does) and counts in
    `checkpointer.stats.saves_skipped`.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        iteration: int | None = None,
        *,
        modules: Sequence[torch.nn.Module] = (),
    ):
        """`modules`: the models whose state is saved. Their parameters change only in optimizer steps (which
        wait for the copy) or never (frozen), so they are not copied aside inside the save; without them a
        frozen part (a LoRA base model, a frozen encoder) is, as no optimizer owns it."""
        super().__init__()
        self.checkpointer = checkpointer
        self.iteration = iteration
        self.modules = tuple(modules)
        self._local: SavePlan | None = None
        self._rank = 0
        self._world_size = 1
        self._thread = threading.get_ident()  # the training thread's, normally (see write_data)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.iteration = iteration_from_id(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP on its own: pass storage_writer=CastorWriter(...)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"castor:iteration-{self.iteration}")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self._rank = int(kwargs.get("rank", dist.get_rank() if distributed else 0))
        self._world_size = dist.get_world_size() if distributed else 1

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.iteration is None or type(self.iteration) is not int or self.iteration < 0:
            raise ValueError(
                f"CastorWriter needs the iteration to save as (a non-negative int), not {self.iteration!r}: "
                "CastorWriter(checkpointer, iteration=step) or dcp.save(..., checkpoint_id=step)"
            )
        if not plan.usable:
            raise CheckpointError(
                "CastorWriter does not support DCP's save-plan caching (enable_plan_caching)"
            )
        # Every item of this rank, before the global plan leaves each replicated item to one rank only.
        self._local = plan
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator's view of every rank's (deduplicated) items: the metadata dcp.save records,
        # handed to every rank so that each stores it with its own items.
        _, metadata = create_default_global_save_plan(plans, rewrite_index_hints=False)
        mappings = [p.planner_data for p in plans if isinstance(p.planner_data, dict)]
        encoded = encode_metadata(
            metadata.state_dict_metadata, dict(ChainMap(*mappings)) if mappings else None
        )
        return [dataclasses.replace(plan, storage_data=encoded) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._local is None or not isinstance(plan.storage_data, dict):
            raise CheckpointError("CastorWriter.write_data before its plans were prepared")
        assert self.iteration is not None
        items: list[Any] = []
        fresh: list[torch.Tensor] = []  # the bytes DCP pickled: nothing changes them, no snapshot needed
        for item in self._local.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                data = _bytes_tensor(data.getvalue())
                fresh.append(data)
            offsets = None if item.index.offset is None else list(item.index.offset)
            items.append([item.index.fqn, _KINDS[item.type], offsets, data])
        payload = {
            "format": FORMAT,
            "rank": self._rank,
            "world_size": self._world_size,
            "metadata": plan.storage_data,
            "items": items,
        }
        # Called on another thread than the one that made the writer: dcp.async_save's, with a staged copy
        # of the state (which DCP's stager may reuse for the next save once `.result()` returned), so this
        # waits for the commit. On the training thread (dcp.save) the copy runs in the background as for any
        # save, the buffers among the items snapshotted first (see Checkpointer._save_detached).
        staged = threading.get_ident() != self._thread
        parameters = [getattr(p, "_local_tensor", p) for m in self.modules for p in m.parameters()]
        self.checkpointer._save_detached(
            self.iteration, {KEY: payload}, fresh=[*fresh, *parameters], commit=staged
        )
        info = CastorStorageInfo(self._rank, self.iteration)
        results = [WriteResult(item.index, _item_bytes(item), info) for item in plan.items]
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass  # each rank committed its own checkpoint; nothing is shared between ranks


class CastorReader(StorageReader):
    """A DCP StorageReader from Castor's memory tier: `dcp.load(state, storage_reader=CastorReader(ckpt))`.

    Without `iteration` it loads the iteration `Checkpointer.restore` would: the recovery plan's
    ($CASTOR_RESTORE_ITERATION), else the newest one every rank holds (agreed over the default group;
    ShardingMismatchError on every rank when there is none and a rank holds checkpoints of another world
    size).
    `select()` tells it beforehand (None: nothing to load; a collective when distributed); `iteration`
    holds it after a load. Every checksum is verified before a byte reaches the state.
    """

    def __init__(self, checkpointer: Checkpointer, iteration: int | None = None):
        super().__init__()
        self.checkpointer = checkpointer
        self.iteration = iteration
        self._selected = iteration is not None
        self._held: dict[ItemKey, int] = {}
        self._shapes: list[tuple[int, ...] | None] = []
        self._payload: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.iteration = iteration_from_id(checkpoint_id)
            self._selected = True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def select(self) -> int | None:
        """The iteration a load reads (None: there is none to load). All ranks call it together."""
        if not self._selected:
            self.iteration = choose_iteration(self.checkpointer)
            self._selected = True
            if self.iteration is None:  # a load would restore, and tell the agent (Checkpointer.restore)
                self.checkpointer._notify_restored(FRESH_START)
        return self.iteration

    def read_metadata(self) -> Metadata:
        iteration = self.select()
        if iteration is None:
            raise CheckpointNotFoundError(f"{self.checkpointer.directory}: no checkpoint to load")
        manifest = find_manifest(self.checkpointer, iteration)
        payload = dcp_payload(manifest)
        self._payload = payload
        items = payload["items"]
        self._held = {_key(fqn, offsets): i for i, (fqn, _, offsets, _) in enumerate(items)}
        self._shapes = [
            manifest.tensors[ref.index].shape if isinstance(ref, Ref) else None for *_, ref in items
        ]
        metadata = decode_metadata(payload["metadata"])
        metadata.storage_data = {
            MetadataIndex(fqn, offsets): CastorStorageInfo(int(payload["rank"]), iteration)
            for fqn, _, offsets, _ in items
        }
        metadata.storage_meta = StorageMeta(checkpoint_id=f"castor:iteration-{iteration}")
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        saved = int(self._payload.get("world_size", 1))
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        for item in plan.items:
            index = item.storage_index
            if _key(index.fqn, index.offset) not in self._held:
                raise CheckpointError(
                    f"{index.fqn} (chunk at {list(index.offset or [])}): this rank needs a part that "
                    f"another rank saved (saved with {saved} ranks, loading with {world}, or with another "
                    "sharding). Castor's memory holds each rank's own shards: load with the same world size "
                    "and sharding, or export the checkpoint (worker_lib.export_dcp, or `castor checkpoints "
                    "export`) and load the directory with FileSystemReader, which reshards"
                )
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.iteration is not None
        targets: list[torch.Tensor | None] = [None] * len(self._held)
        direct: list[tuple[Any, torch.Tensor]] = []
        later: list[tuple[Any, int, torch.Tensor | None]] = []
        for item in plan.items:
            k = self._held[_key(item.storage_index.fqn, item.storage_index.offset)]
            if item.type == LoadItemType.BYTE_IO:
                later.append((item, k, None))
                continue
            dest = planner.resolve_tensor(item)
            whole = not any(item.storage_offsets) and tuple(item.lengths) == self._shapes[k]
            # A whole saved chunk into a CPU tensor of its shape: restored straight into the state, each
            # stripe checked then copied. Anything else (a part of a chunk, a GPU tensor) is restored into
            # a fresh tensor first and copied from there.
            cpu = dest.device.type == "cpu"
            if whole and cpu and targets[k] is None and tuple(dest.shape) == self._shapes[k]:
                targets[k] = dest.detach()
                direct.append((item, dest))
            else:
                later.append((item, k, dest))
        into = {KEY: {"items": [[None, None, None, target] for target in targets]}}
        restored = self.checkpointer.restore(into=into, iteration=self.iteration)
        assert restored is not None
        stored = restored.state[KEY]["items"]
        for item, k, maybe_dest in later:
            value = stored[k][3]
            if maybe_dest is None:
                planner.load_bytes(item, io.BytesIO(value.numpy().tobytes()))
                continue
            source = value
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                source = source.narrow(dim, start, length)
            with torch.no_grad():
                maybe_dest.detach().copy_(source)
            direct.append((item, maybe_dest))
        for item, dest in direct:
            planner.commit_tensor(item, dest)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def choose_iteration(checkpointer: Checkpointer) -> int | None:
    """The iteration `Checkpointer.restore()` without an iteration would read (None: none). A collective
    over the default group when torch.distributed is initialized and there is no recovery plan. Like
    restore(), it first waits for this rank's save in flight: a load right after dcp.save would otherwise
    choose the iteration before it (the other slot still holds it) and load it without a word."""
    checkpointer._wait_agreeing(True)
    planned = os.environ.get(RESTORE_ITERATION_ENV, "").strip()
    if planned.lower() == "none":
        return None
    if planned:
        try:
            return int(planned)
        except ValueError:
            raise ValueError(
                f"{RESTORE_ITERATION_ENV}={planned!r}: expected an iteration number or 'none'"
            ) from None
    held, world_sizes = held_iterations(checkpointer._store.committed())
    agreed = newest_common_iteration(held, world_sizes)
    if agreed is NOT_DISTRIBUTED:
        return max(held, default=None)
    return agreed


def find_manifest(checkpointer: Checkpointer, iteration: int) -> Manifest:
    checkpointer._wait()  # the iteration may be this rank's save in flight
    for manifest in checkpointer._store.committed():
        if manifest.iteration == iteration:
            return manifest
    raise CheckpointNotFoundError(f"{checkpointer.directory}: no checkpoint of iteration {iteration}")


def dcp_payload(manifest: Manifest) -> dict[str, Any]:
    """The DCP payload of a CastorWriter checkpoint, tensors as references (nothing read)."""
    if not (isinstance(manifest.tree, dict) and is_dcp_tree(manifest.tree)):
        raise CheckpointError(
            f"iteration {manifest.iteration} was not saved through CastorWriter (dcp.save): restore it with "
            "Checkpointer.restore, or export it with worker_lib.export_dcp"
        )
    state = unflatten(manifest.tree, Ref)
    payload = state[KEY]
    if payload.get("format") != FORMAT:
        raise CheckpointError(f"unsupported Castor DCP format {payload.get('format')!r}")
    return dict(payload)


def is_dcp_tree(tree: dict[str, Any]) -> bool:
    pairs = tree.get("dict")
    return isinstance(pairs, list) and len(pairs) == 1 and isinstance(pairs[0], list) and pairs[0][0] == KEY


@dataclass(frozen=True)
class Ref:
    index: int


def encode_metadata(state_dict_metadata: dict[str, STORAGE_TYPES], planner_data: Any) -> dict[str, Any]:
    """DCP's metadata as plain values (Castor's state codec keeps tuples apart from lists)."""
    tensors: dict[str, Any] = {}
    byte_items: list[str] = []
    for fqn, described in state_dict_metadata.items():
        if isinstance(described, BytesStorageMetadata):
            byte_items.append(fqn)
            continue
        props = described.properties
        tensors[fqn] = {
            "dtype": str(props.dtype).removeprefix("torch."),
            "layout": str(props.layout).removeprefix("torch."),
            "requires_grad": bool(props.requires_grad),
            "memory_format": str(props.memory_format).removeprefix("torch."),
            "pin_memory": bool(props.pin_memory),
            "size": list(described.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in described.chunks],
        }
    if not _plain_mapping(planner_data):
        planner_data = None  # a custom planner's own data: DCP's load does not read it
    return {"tensors": tensors, "bytes": byte_items, "planner_data": planner_data}


def decode_metadata(encoded: dict[str, Any]) -> Metadata:
    described: dict[str, STORAGE_TYPES] = {}
    for fqn, raw in encoded["tensors"].items():
        props = TensorProperties(
            dtype=_torch_attr(raw["dtype"], torch.dtype),
            layout=_torch_attr(raw["layout"], torch.layout),
            requires_grad=bool(raw["requires_grad"]),
            memory_format=_torch_attr(raw["memory_format"], torch.memory_format),
            pin_memory=bool(raw["pin_memory"]),
        )
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in raw["chunks"]]
        described[fqn] = TensorStorageMetadata(props, torch.Size(raw["size"]), chunks)
    for fqn in encoded["bytes"]:
        described[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=described, planner_data=encoded.get("planner_data"))


def _torch_attr(name: str, kind: type) -> Any:
    value = getattr(torch, str(name), None)
    if not isinstance(value, kind):
        raise CheckpointError(f"malformed DCP metadata: {name!r} is not a torch {kind.__name__}")
    return value


def _plain_mapping(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(type(p) in (str, int) for p in v)
        for k, v in value.items()
    )


def _key(fqn: str, offsets: Any) -> ItemKey:
    return fqn, None if offsets is None else tuple(int(n) for n in offsets)


def _bytes_tensor(raw: bytes) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _item_bytes(item: WriteItem) -> int:
    if item.bytes_io_data is not None:
        return item.bytes_io_data.nbytes
    return item.tensor_storage_size() or 0
