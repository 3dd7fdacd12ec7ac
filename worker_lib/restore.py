"""From a checkpoint to a state: fresh tensors, or the caller's own tensors filled in place.

`restore_state` is the fast path behind `Checkpointer.restore(into=...)`: it verifies each stripe of shared
memory against the manifest's checksum and copies it straight into the model's parameters and buffers while
it is still in cache, on the copy engine's threads: one pass over the checkpoint's bytes, not two.
`load_state` loads an already restored state into modules, optimizers and tensors afterwards. Both walk the
target structure the same way (`_walk`): dicts by key, lists and tuples by position, modules and optimizers
as their state_dict.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from worker_lib.sharded import (
    MeshResolver,
    ShardingMismatchError,
    check_same_sharding,
    describe_mesh,
    dtensor_type,
    live_meshes,
    local_shard,
    mesh_spec,
    same_sharding,
)
from worker_lib.store.copy import (
    CheckedGroup,
    CopyEngine,
    Extent,
    FlatTransfer,
    Op,
    RowTransfer,
    Transfer,
    compile_checked,
    flat_bytes,
    has_lazy_bits,
    plan_checked,
    row_bytes,
    row_transfer,
)
from worker_lib.store.cuda import to_device
from worker_lib.store.integrity import check_region, corrupt_error
from worker_lib.store.layout import SPAN_ALIGN, dtype_from_name, dtype_name
from worker_lib.store.manifest import JsonValue, Manifest, TensorEntry
from worker_lib.store.tree import EXTRA_STATE_SUFFIX, PLAIN_TYPES, FlatState, unflatten

Keys = tuple[Any, ...]


def load_state(state: Any, target: Any) -> None:
    """Load a restored `state` into `target`, a structure like the one that was saved.

    Modules and optimizers get `load_state_dict`, tensors are copied in place, dicts, lists and tuples are
    walked by key and position; plain values in `target` are left alone (read them from `state`). The
    optimizers' parameter groups are checked before anything is loaded.
    """
    _walk(state, target, "state", (), _OptimizerChecks())
    _walk(state, target, "state", (), _Loader())


def restore_state(
    manifest: Manifest,
    data: memoryview,
    into: Any,
    engine: CopyEngine,
    matched: FlatState | None = None,
    plans: RestorePlans | None = None,
) -> Callable[[], Any]:
    """Verify the checkpoint in `data`, filling the tensors of `into` in place; returns what decodes the state
    (see Restored.state: called when the state is read).

    Every target is matched and checked before the first byte is copied, so a mismatch leaves them untouched.
    Every stripe is checked against its checksum before its bytes are copied: a corrupt checkpoint raises
    CheckpointCorruptError, no byte of a bad stripe reaches a target, and no optimizer is loaded.

    `matched`: `into` flattened, when the caller established that it is exactly the saved structure (the
    same tree, plain values and sharding specs included, and tensors of the layout the checkpoint was
    written with: see Checkpointer.restore): tensor i of the checkpoint then goes into its tensor i, without
    matching the targets one by one. `plans`: where the copies of such restores are kept for the next.
    """
    check_region(manifest, data.nbytes)
    if matched is not None:
        targets = _Targets(manifest)
        targets.tensors = dict(enumerate(matched.tensors))
        targets.dtensors = matched.dtensors
        meshes = None
    else:
        plans = None  # cached copies only for targets matched as a whole (their layout is the saved one)
        targets = _Targets(manifest)
        sharded: list[_DTensorRef] = []
        matching = unflatten(manifest.tree, _TensorRef, partial(_DTensorRef.of, sharded))
        if into is not None:
            _walk(matching, into, "state", (), targets)
        # Sharded tensors without a live target (optimizer states) become DTensors on this process's mesh:
        # checked here, before any byte is copied.
        meshes = MeshResolver(find=partial(live_meshes, into))
        for ref in sharded:
            if ref.index not in targets.tensors:
                meshes.check(ref.spec, manifest.tensors[ref.index].key)
    tensors = _copy_out(manifest, data, targets.tensors, engine, plans)

    def dtensor(spec: dict[str, JsonValue], local: Any) -> Any:
        index = spec["tensor"]
        assert isinstance(index, int)
        live = targets.dtensors.get(index)
        if live is not None:
            return live
        assert meshes is not None  # a matched restore has a live DTensor for every shard
        return meshes.dtensor(spec, local, manifest.tensors[index].key)

    decode = partial(unflatten, manifest.tree, tensors.__getitem__, dtensor)
    if matched is not None:
        # `into` holds the saved structure (matched): its optimizers are where the tree has them.
        _optimizers_in(into, (), targets.optimizers)
        optimizers = [(o, keys) for o, keys in targets.optimizers if not _load_changes_nothing(o)]
        if not optimizers:
            # The state's tensors are the targets themselves and nothing else needs the decoded state:
            # decoded when it is read (1-2 ms for the 600 tensors of an FSDP2 decoder's shards).
            return decode
    else:
        optimizers = targets.optimizers
    state = decode()
    for module, keys, extra in targets.extra_states:
        _set_extra_states(module, _lookup(state, keys), extra)
    for optimizer, keys in optimizers:
        optimizer.load_state_dict(_lookup(state, keys))
    return partial(_same, state)


def _set_extra_states(module: nn.Module, state: dict[str, Any], keys: list[str]) -> None:
    """Give each submodule of `module` whose extra state is among `keys` (state_dict keys) its saved value,
    as load_state_dict would; the module's tensors were filled in place."""
    for key in keys:
        owner = key[: -len(EXTRA_STATE_SUFFIX)].rstrip(".")
        module.get_submodule(owner).set_extra_state(state[key])


def _same(value: Any) -> Any:
    return value


def _optimizers_in(target: Any, keys: Keys, found: list[tuple[torch.optim.Optimizer, Keys]]) -> None:
    """The optimizers of `target` (a structure like the saved one) with their keys, as _walk finds them."""
    if isinstance(target, torch.optim.Optimizer):
        found.append((target, keys))
    elif isinstance(target, dict):
        for key, value in target.items():
            _optimizers_in(value, (*keys, key), found)
    elif isinstance(target, list | tuple):
        for i, value in enumerate(target):
            _optimizers_in(value, (*keys, i), found)


def _load_changes_nothing(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.load_state_dict` of a restore matched as a whole (see Checkpointer._matched) would
    leave the optimizer's values as they are, so that it can be skipped (3 ms for the AdamW state of an
    FSDP2 decoder's 147 shards, most of it `_cast`'s `.to()` on each DTensor).

    A matched restore's optimizer state is the optimizer's own `state_dict()` (the same tree: param_groups,
    their plain values and the parameter order included) whose tensors are the optimizer's own, filled in
    place. torch's `Optimizer.load_state_dict` of that state sets a deep copy of equal param_groups, and per
    parameter a new dict of `_cast(value)`: the same tensor object wherever `value.to(dtype=..., device=...)`
    returns it unchanged (it does when the dtype and device are already the ones asked for; `step` is kept
    as it is unless the group is fused or capturable). Then the class's `__setstate__`, which for torch's
    own optimizers only fills group defaults the groups already have and turns a number `step` into a
    tensor. So: torch's own load_state_dict and optimizer class, no state_dict or
    load_state_dict hooks (they could transform either side), every state value a tensor that `_cast` would
    return unchanged. Anything else is loaded as before."""
    cls = type(optimizer)
    if (
        cls.load_state_dict is not torch.optim.Optimizer.load_state_dict
        or cls.state_dict is not torch.optim.Optimizer.state_dict
        or not cls.__module__.startswith("torch.optim.")
        or optimizer._optimizer_load_state_dict_pre_hooks
        or optimizer._optimizer_load_state_dict_post_hooks
        or optimizer._optimizer_state_dict_pre_hooks
        or optimizer._optimizer_state_dict_post_hooks
    ):
        return False
    state = optimizer.state
    seen = 0
    for group in optimizer.param_groups:
        step_cast = bool(group.get("fused")) or bool(group.get("capturable"))
        for param in group["params"]:
            values = state.get(param)
            if values is None:
                continue
            seen += 1
            if type(values) is not dict:
                return False
            dtype, device = param.dtype, param.device
            floating = dtype.is_floating_point
            on_cpu = device.type == "cpu"  # a CPU tensor's device is always the plain torch.device("cpu")
            for key, value in values.items():
                if not isinstance(value, torch.Tensor):
                    return False  # a number `step` becomes a tensor in __setstate__, for one
                if key == "step" and not step_cast:
                    continue
                wanted = torch.float32 if key == "step" else dtype if floating else value.dtype
                # is_cpu: reading a DTensor's .device costs 1 us here, is_cpu a third of it.
                if value.dtype is not wanted or not (value.is_cpu if on_cpu else value.device == device):
                    return False
    return seen == len(state)  # no state but the parameters' (load_state_dict keeps others as they are)


class RestorePlans:
    """The copies of the last restores into targets matched as a whole (see restore_state), by the address
    of the checkpoint's data: a restore into the same tensors (same addresses) of a checkpoint written with
    the same layout (the same entries, by identity, and stripe boundaries) reuses them instead of building a
    numpy view of each target again (about 10 us per tensor, 6 ms for the 600 shards of an FSDP2 decoder).
    The views hold their tensors and mappings, so an address seen again is the same memory."""

    _LIMIT = 8

    def __init__(self) -> None:
        self._plans: dict[int, _Plan] = {}

    def get(self, address: int, key: _PlanKey) -> _Plan | None:
        plan = self._plans.get(address)
        if plan is None or plan.entries is not key[0] or plan.key[1:] != key[1:]:
            return None
        return plan

    def put(self, address: int, plan: _Plan) -> None:
        if len(self._plans) >= self._LIMIT:
            self._plans.clear()
        self._plans[address] = plan

    def clear(self) -> None:
        self._plans.clear()


# (the manifest's entries, data bytes, stripe boundaries, each target's address)
_PlanKey = tuple[tuple[TensorEntry, ...], int, tuple[tuple[int, int], ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class _Plan:
    entries: tuple[TensorEntry, ...]
    key: _PlanKey
    transfers: list[Transfer]
    groups: tuple[CheckedGroup, ...]
    compiled: list[tuple[Op, ...]]


@dataclass(frozen=True, slots=True)
class _TensorRef:
    """Stands for the i-th tensor of a checkpoint while its targets are matched."""

    index: int


@dataclass(frozen=True, slots=True)
class _DTensorRef:
    """Stands for a sharded tensor of a checkpoint (its local shard is tensor `index`) while matching."""

    index: int
    spec: dict[str, JsonValue]

    @staticmethod
    def of(seen: list[_DTensorRef], spec: dict[str, JsonValue], local: Any) -> _DTensorRef:
        ref = _DTensorRef(local.index, spec)
        seen.append(ref)
        return ref


class _Visitor(Protocol):
    def tensor(self, state: Any, target: torch.Tensor, path: str) -> None: ...

    def module(self, state: Any, target: nn.Module, path: str, keys: Keys) -> None: ...

    def optimizer(self, state: Any, target: torch.optim.Optimizer, path: str, keys: Keys) -> None: ...


def _walk(state: Any, target: Any, path: str, keys: Keys, visitor: _Visitor) -> None:
    if isinstance(target, PLAIN_TYPES):
        return
    if isinstance(target, nn.Module):
        visitor.module(state, target, path, keys)
    elif isinstance(target, torch.optim.Optimizer):
        visitor.optimizer(state, target, path, keys)
    elif isinstance(target, torch.Tensor):
        visitor.tensor(state, target, path)
    elif isinstance(target, dict):
        if not isinstance(state, dict):
            raise TypeError(
                f"{path}: the checkpoint has {type(state).__qualname__} where the target has a dict"
            )
        for key, value in target.items():
            if key not in state:
                raise KeyError(f"{path}[{key!r}] is not in the checkpoint")
            _walk(state[key], value, f"{path}[{key!r}]", (*keys, key), visitor)
    elif isinstance(target, list | tuple):
        if not isinstance(state, list | tuple) or len(state) != len(target):
            raise TypeError(f"{path}: the checkpoint does not have a sequence of {len(target)} items here")
        for i, (item, value) in enumerate(zip(state, target, strict=True)):
            _walk(item, value, f"{path}[{i}]", (*keys, i), visitor)
    else:
        raise TypeError(f"{path}: cannot load into {type(target).__qualname__}")


class _Loader:
    def tensor(self, state: Any, target: torch.Tensor, path: str) -> None:
        if not isinstance(state, torch.Tensor) or state.shape != target.shape:
            raise ValueError(
                f"{path}: the checkpoint has {_describe(state)}, the target a tensor of {_shape(target)}"
            )
        with torch.no_grad():
            target.copy_(state)

    def module(self, state: Any, target: nn.Module, path: str, keys: Keys) -> None:
        target.load_state_dict(state)

    def optimizer(self, state: Any, target: torch.optim.Optimizer, path: str, keys: Keys) -> None:
        target.load_state_dict(state)


class _OptimizerChecks:
    """What load_state checks before it loads anything: the optimizers' parameter groups."""

    def tensor(self, state: Any, target: torch.Tensor, path: str) -> None:
        pass

    def module(self, state: Any, target: nn.Module, path: str, keys: Keys) -> None:
        pass

    def optimizer(self, state: Any, target: torch.optim.Optimizer, path: str, keys: Keys) -> None:
        _check_param_groups(state, target, path)


def _check_param_groups(state: Any, target: torch.optim.Optimizer, path: str) -> None:
    """load_state_dict's own checks of the parameter groups, made before anything is loaded: it runs after
    the model's tensors are copied, and a refusal then would leave the model restored and the optimizer
    not."""
    saved_groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(saved_groups, list | tuple) or not all(isinstance(g, dict) for g in saved_groups):
        raise TypeError(f"{path}: the checkpoint has {_describe(state)} where the target has an optimizer")
    saved_sizes = [len(group.get("params", ())) for group in saved_groups]
    live_sizes = [len(group["params"]) for group in target.param_groups]
    if saved_sizes != live_sizes:
        raise ValueError(
            f"{path}: the checkpoint's optimizer has {len(saved_sizes)} parameter group(s) of {saved_sizes} "
            f"parameters, this one {len(live_sizes)} of {live_sizes}: build the optimizer with the same "
            "parameter groups as the run that saved it"
        )


class _Targets:
    """Collects where each checkpoint tensor goes (checking shapes), which optimizers to load and which
    modules' extra state to set."""

    def __init__(self, manifest: Manifest):
        self._entries = manifest.tensors
        self.tensors: dict[int, torch.Tensor] = {}
        self.dtensors: dict[int, Any] = {}  # live DTensors whose local shards are filled in place
        self.optimizers: list[tuple[torch.optim.Optimizer, Keys]] = []
        # Modules with extra state, the keys of their state in the tree and their extra-state keys (see
        # module()).
        self.extra_states: list[tuple[nn.Module, Keys, list[str]]] = []

    def tensor(self, state: Any, target: torch.Tensor, path: str) -> None:
        DTensor = dtensor_type()
        if isinstance(state, _DTensorRef) or (DTensor is not None and isinstance(target, DTensor)):
            self._dtensor(state, target, path)
            return
        shape = self._entries[state.index].shape if isinstance(state, _TensorRef) else None
        if shape != tuple(target.shape):
            described = f"a tensor of {list(shape)}" if shape is not None else _describe(state)
            raise ValueError(
                f"{path}: the checkpoint has {described}, the target a tensor of {_shape(target)}"
            )
        self.tensors[state.index] = target.detach()  # in place, outside autograd

    def _dtensor(self, state: Any, target: torch.Tensor, path: str) -> None:
        DTensor = dtensor_type()
        if not isinstance(state, _DTensorRef):
            mesh = mesh_spec(getattr(target, "device_mesh", None))
            raise ShardingMismatchError(
                f"{path}: the checkpoint has {_describe_ref(state, self._entries)}, the target a DTensor "
                f"sharded over the mesh {describe_mesh(mesh)}: "
                "the checkpoint was saved unsharded; load it before sharding the model"
            )
        if DTensor is None or not isinstance(target, DTensor):
            raise ShardingMismatchError(
                f"{path}: the checkpoint has a shard of a DTensor of {state.spec['shape']} over the mesh "
                f"{describe_mesh(state.spec['mesh'])}, the target a plain tensor of {_shape(target)}: "
                "shard the model the same way (fully_shard) before restoring"
            )
        check_same_sharding(state.spec, target, path)
        local = local_shard(target)
        if tuple(local.shape) != self._entries[state.index].shape:
            raise ShardingMismatchError(
                f"{path}: the checkpoint's shard is a tensor of {list(self._entries[state.index].shape)}, "
                f"this rank's a tensor of {_shape(local)}"
            )
        self.tensors[state.index] = local  # its bytes are copied straight into the live shard
        self.dtensors[state.index] = target

    def module(self, state: Any, target: nn.Module, path: str, keys: Keys) -> None:
        own = target.state_dict(keep_vars=True)  # no detach() per DTensor; tensor() takes them detached
        if not isinstance(state, dict) or own.keys() != state.keys():
            saved = state.keys() if isinstance(state, dict) else set()
            raise KeyError(
                f"{path}: the checkpoint does not match the module: missing {sorted(own.keys() - saved)}, "
                f"unexpected {sorted(saved - own.keys())}"
            )
        extra = [key for key in own if key.endswith(EXTRA_STATE_SUFFIX)]
        for key, tensor in own.items():
            if key not in extra:
                self.tensor(state[key], tensor, f"{path}[{key!r}]")
        if extra:
            # Extra state (get_extra_state: FP8 scaling factors, say) is put back by set_extra_state: the
            # state_dict holds a copy of it, and filling that would change nothing. Once decoded.
            self.extra_states.append((target, keys, extra))

    def optimizer(self, state: Any, target: torch.optim.Optimizer, path: str, keys: Keys) -> None:
        _check_param_groups(state, target, path)
        self.optimizers.append((target, keys))
        if target.state:
            self._optimizer_in_place(state, target)

    def _optimizer_in_place(self, state: Any, target: torch.optim.Optimizer) -> None:
        """Where the optimizer already has its state (a restore into a running job), its state tensors take
        the bytes straight from shared memory, as the model's do, instead of fresh tensors (allocated and
        page-faulted, two thirds of an AdamW state) that load_state_dict then swaps in; load_state_dict then
        finds them in place (its casts return a tensor of the same dtype and device as it is). Only tensors
        that match exactly (kind, dtype, shape, sharding) are filled so; anything else takes the fresh path
        and load_state_dict's own checks, as without this."""
        if not isinstance(state, dict):
            return
        saved_groups, saved_state = state.get("param_groups"), state.get("state")
        if not isinstance(saved_groups, list | tuple) or not isinstance(saved_state, dict):
            return
        live_groups = target.param_groups  # the same number and sizes as the saved ones (checked above)
        # The saved parameter ids map to live parameters by position, as in load_state_dict.
        params = {
            saved_id: param
            for saved, live in zip(saved_groups, live_groups, strict=True)
            for saved_id, param in zip(saved["params"], live["params"], strict=True)
        }
        DTensor = dtensor_type()
        for saved_id, saved in saved_state.items():
            param = params.get(saved_id)
            own = target.state.get(param) if param is not None else None
            if not isinstance(saved, dict) or not isinstance(own, dict):
                continue
            for key, ref in saved.items():
                live = own.get(key)
                if not isinstance(live, torch.Tensor) or live.requires_grad:
                    continue
                if not isinstance(ref, _TensorRef | _DTensorRef) or ref.index in self.tensors:
                    continue
                entry = self._entries[ref.index]
                if entry.dtype != dtype_name(live.dtype) or entry.device != live.device.type:
                    continue
                if isinstance(ref, _DTensorRef):
                    if DTensor is None or not isinstance(live, DTensor) or not same_sharding(ref.spec, live):
                        continue
                    local = local_shard(live)
                    if tuple(local.shape) == entry.shape:
                        self.tensors[ref.index] = local
                        self.dtensors[ref.index] = live
                elif type(live) is torch.Tensor and tuple(live.shape) == entry.shape:
                    self.tensors[ref.index] = live


def _copy_out(
    manifest: Manifest,
    data: memoryview,
    targets: dict[int, torch.Tensor],
    engine: CopyEngine,
    plans: RestorePlans | None = None,
) -> list[torch.Tensor]:
    """Copy every tensor out of `data`, each stripe once it matched its checksum: into its target when it
    has one, else into a fresh tensor. Extents are positions in the data region, so that a piece is copied
    only out of stripes that were verified."""
    source = np.frombuffer(data, dtype=np.uint8)
    stripes = [(s.start, s.end, s.digest) for s in manifest.stripes]
    plan_key: _PlanKey | None = None
    address = source.__array_interface__["data"][0]
    if plans is not None and len(targets) == len(manifest.tensors):
        plan_key = (
            manifest.tensors,
            manifest.data_bytes,
            tuple((start, end) for start, end, _ in stripes),
            tuple(map(_DATA_PTR, [targets[i] for i in range(len(manifest.tensors))])),
        )
        plan = plans.get(address, plan_key)
        if plan is not None:
            bad = engine.check_copy(plan.groups, plan.transfers, source, stripes, plan.compiled)
            if bad:
                raise corrupt_error(manifest, bad, copied=True)
            return [targets[i] for i in range(len(manifest.tensors))]
    typed_source = _ReadOnlyTensor(data)
    transfers: list[Transfer] = []
    extents: list[Extent] = []

    def add(transfer: Transfer, entry: TensorEntry, unit: int) -> None:
        extents.append(Extent(entry.offset, entry.nbytes, unit, entry.offset + entry.nbytes))
        transfers.append(transfer)

    fresh: dict[int, torch.Tensor] = {}
    regions: dict[int, torch.Tensor] = {}  # fresh storages of shared regions, by offset in the data region
    filled: set[tuple[int, int, int]] = set()  # (offset, target address, bytes) of whole regions copied
    for i, entry in enumerate(manifest.tensors):
        dtype = dtype_from_name(entry.dtype)
        stored = source[entry.offset : entry.offset + entry.nbytes]
        target = targets.get(i)
        if target is not None and _whole_region(entry, dtype) and _flat_target(target, dtype):
            # A tensor that is all of a shared region (tied weights: one storage, saved under two keys)
            # is copied like any flat tensor, stripe by stripe on every thread, and only once per target.
            key = (entry.offset, target.data_ptr(), entry.nbytes)
            if key not in filled:
                filled.add(key)
                add(FlatTransfer(stored, flat_bytes(target)), entry, 1)
        elif target is not None and entry.view is None and _flat_target(target, dtype):
            add(FlatTransfer(stored, flat_bytes(target)), entry, 1)
        elif target is not None and entry.view is None:
            # Row by row (a strided target, or another dtype): rows are counted in the stored bytes.
            view = typed_source.view(entry, dtype)
            transfer = row_transfer(view, target)
            rows = row_bytes(view.shape, view.element_size())
            add(RowTransfer(transfer.src, transfer.dst, rows), entry, rows)
        elif target is not None:
            # A view into a shared region may read any of its bytes: copied once the whole region checked.
            add(_WholeTransfer(typed_source.view(entry, dtype), target), entry, max(entry.nbytes, 1))
        elif entry.view is None:
            fresh[i] = torch.empty(entry.shape, dtype=dtype)
            add(FlatTransfer(stored, flat_bytes(fresh[i])), entry, 1)
        elif entry.offset not in regions:
            regions[entry.offset] = torch.empty(
                -(-entry.nbytes // SPAN_ALIGN) * SPAN_ALIGN, dtype=torch.uint8
            )
            add(FlatTransfer(stored, regions[entry.offset][: entry.nbytes].numpy()), entry, 1)

    groups = plan_checked(extents, [(start, end) for start, end, _ in stripes])
    if plans is not None and plan_key is not None and not fresh and not regions:
        plans.put(
            address,
            _Plan(manifest.tensors, plan_key, transfers, groups, compile_checked(groups, transfers)),
        )
    bad = engine.check_copy(groups, transfers, source, stripes)
    if bad:
        raise corrupt_error(manifest, bad, copied=bool(targets))

    tensors: list[torch.Tensor] = []
    on_device: dict[int, torch.Tensor] = {}
    for i, entry in enumerate(manifest.tensors):
        if i in targets:
            tensors.append(targets[i])
        elif entry.view is None:
            tensors.append(to_device(fresh[i], entry.device))
        else:
            # A shared region moves to its device as one storage, so that its members keep sharing it.
            if entry.offset not in on_device:
                on_device[entry.offset] = to_device(regions[entry.offset], entry.device)
            region = on_device[entry.offset].view(dtype_from_name(entry.dtype))
            tensors.append(region.as_strided(entry.shape, entry.view.stride, entry.view.storage_offset))
    return tensors


_DATA_PTR = torch.Tensor.data_ptr


@dataclass(frozen=True, slots=True)
class _WholeTransfer:
    """A target filled from a strided view into a shared region by one torch copy_ (whatever lo and hi)."""

    src: torch.Tensor
    dst: torch.Tensor

    def copy(self, lo: int, hi: int) -> None:
        self.dst.copy_(self.src)


class _ReadOnlyTensor:
    """Typed tensor views of the read-only data region, for copies that need torch (strided targets)."""

    def __init__(self, data: memoryview):
        self._data = data
        self._tensor: torch.Tensor | None = None

    def view(self, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
        if self._tensor is None:
            with warnings.catch_warnings():
                # torch warns that it cannot protect a read-only buffer; these views are only ever read.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._tensor = torch.frombuffer(self._data, dtype=torch.uint8)
        if entry.view is None:
            return self._tensor[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)
        span = -(-entry.nbytes // SPAN_ALIGN) * SPAN_ALIGN
        region = self._tensor[entry.offset : entry.offset + span].view(dtype)
        # as_strided counts its offset from the start of the whole data region's storage, not the region's.
        start = region.storage_offset() + entry.view.storage_offset
        return region.as_strided(entry.shape, entry.view.stride, start)


def _whole_region(entry: TensorEntry, dtype: torch.dtype) -> bool:
    """The entry's region holds exactly its values in row-major order (a view of all of a storage)."""
    view = entry.view
    if view is None:
        return True
    if view.storage_offset != 0 or entry.nbytes != math.prod(entry.shape) * dtype.itemsize:
        return False
    expected = 1
    for size, stride in zip(reversed(entry.shape), reversed(view.stride), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _flat_target(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        target.is_cpu  # not device.type: it builds a torch.device, a microsecond per tensor
        and target.dtype == dtype
        and target.is_contiguous()
        and not has_lazy_bits(target)
    )


def _lookup(state: Any, keys: Keys) -> Any:
    for key in keys:
        state = state[key]
    return state


def _describe_ref(state: Any, entries: tuple[TensorEntry, ...]) -> str:
    if isinstance(state, _TensorRef):
        return f"a tensor of {list(entries[state.index].shape)}"
    return _describe(state)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of {_shape(value)}"
    return f"a {type(value).__qualname__}"


def _shape(tensor: torch.Tensor) -> str:
    return str(list(tensor.shape))
