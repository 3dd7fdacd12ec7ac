"""The state tree codec: a training state <-> (JSON structure, list of tensors), without pickle.

Containers and values that JSON cannot tell apart are tagged with a one-key object: {"dict": [[key, value],
...]} (keys of any plain type, order kept), {"list": [...]}, {"tuple": [...]}, {"tensor": index},
{"module": <dict>} and {"optimizer": <dict>} (an nn.Module or Optimizer saved as its state_dict),
{"dtensor": <spec>} (a DTensor: its local shard is a tensor of the checkpoint, see worker_lib.sharded),
{"float": "nan" | "inf" | "-inf"} and {"bytes": "<base64>"}. str, int, bool, None and finite floats are
plain JSON, which keeps them apart exactly (1 vs 1.0 vs true). A state_dict's `_metadata` (module versions
read by load_state_dict) is kept as {"dict": ..., "metadata": ...}.
"""

from __future__ import annotations

import base64
import json
import math
import operator
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

import torch
from torch import nn

from worker_lib.sharded import FSDP1_HINT, dtensor_type, is_sharded_tensor, local_shard, spec_of
from worker_lib.store.manifest import JsonValue

PLAIN_TYPES = (str, int, float, bool, bytes, type(None))
# The suffix of a module's extra state in its state_dict (nn.Module.get_extra_state).
EXTRA_STATE_SUFFIX = "_extra_state"


def has_extra_state(module: nn.Module) -> bool:
    """Whether `module` or a submodule keeps extra state (overrides get_extra_state, as torch decides what
    its state_dict holds): only set_extra_state puts that back, never a fill of the state_dict's copy."""
    return any(type(m).get_extra_state is not nn.Module.get_extra_state for m in module.modules())


# The plain types that are JSON values as they are (see _encode_plain).
_JSON_SCALARS = frozenset((str, int, bool, type(None)))


@dataclass
class FlatState:
    tree: JsonValue = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # key path of each tensor, e.g. state['model']['fc.weight']
    modules: list[nn.Module] = field(default_factory=list)  # modules given as objects, in the order met
    # The DTensor each sharded tensor of `tensors` is the local shard of, by index.
    dtensors: dict[int, Any] = field(default_factory=dict)
    # Tensors that were detached from autograd outside a module (an optimizer's state that requires grad):
    # a restore fills such a target only through the slow path's checks.
    detached_outside_modules: bool = False
    # Indices of the tensors in optimizers' parameter groups (a tensor `lr`, as compiled and capturable
    # optimizers use): a scheduler changes them in place outside the optimizer step, so save() snapshots
    # them.
    group_tensors: list[int] = field(default_factory=list)


def flatten(state: object, memo: FlattenMemo | None = None) -> FlatState:
    """Split `state` into its JSON structure and its tensors; TypeError names the path of anything else.

    With `memo` (kept from one call to the next), the dicts whose values are all tensors (a module's
    state_dict, an optimizer's per-parameter state) that hold the same keys and the same tensor objects
    at the same place as in the previous call reuse their encoding: see FlattenMemo."""
    flat = FlatState()
    encoder = _Encoder(flat, memo)
    flat.tree = encoder.encode(state, "state")
    if memo is not None:
        memo.retain(encoder.used)
    return flat


@dataclass(slots=True)
class _MemoEntry:
    base: int  # index of its first tensor in the state's tensor list
    keys: list[Any]
    values: list[Any]  # the dict's values (held: their ids are not reused while the entry lives)
    # Values that are dicts of tensors (compared by content, not identity): each one's size and all their
    # keys in a row (their tensors are `leaves`); None: the values are tensors.
    inner_sizes: list[int] | None
    inner_keys: list[Any]
    leaves: list[Any]  # every tensor, in order (the values, or the inner dicts' values)
    plain: list[int]  # positions in `leaves` of plain tensors
    sharded: list[int]  # positions in `leaves` of DTensors
    dtensors: list[Any]  # those DTensors
    parts: list[tuple[Any, Any, Any]]  # their specs' (mesh, placements, tensor_meta)
    locals: list[Any]  # the local shards last taken from them
    paths: list[str]  # key path of each tensor
    metadata: Any  # the dict's _metadata as it was (compared by value), or None
    node: JsonValue  # the encoded dict
    json: str | None = None  # its JSON text, once asked for


_SPEC_PARTS = operator.attrgetter("_spec.mesh", "_spec.placements", "_spec.tensor_meta")
_LOCAL = operator.attrgetter("_local_tensor")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class FlattenMemo:
    """The encodings of the tensor dicts of the last flatten, by key path.

    A steady-state save flattens the same modules and optimizers again and again: encoding each tensor (its
    path, its checks, its sharding spec, the small dicts and lists of its node) cost about 10 us per tensor
    here, 6 ms for the 600 tensors of an FSDP2 decoder's shards, and its allocations woke the garbage
    collector on top. A dict whose values are all tensors and which has the same keys, the same tensor
    objects (by identity), the same sharding specs (by identity, as the spec cache in worker_lib.sharded)
    and the same `_metadata` as the dict encoded at the same path and tensor index last time reuses that
    node; its tensors are still taken afresh (detach(), the local shard), so a parameter whose `.data` was
    replaced is saved from its new storage, and anything else is encoded from scratch. The nodes are never
    modified, so trees may share them; `tree_json` splices their JSON text, encoded once."""

    def __init__(self) -> None:
        self._entries: dict[str, _MemoEntry] = {}
        self._nodes: dict[int, _MemoEntry] = {}  # id(entry.node) -> entry, for tree_json

    def get(self, path: str) -> _MemoEntry | None:
        return self._entries.get(path)

    def put(self, path: str, entry: _MemoEntry) -> None:
        old = self._entries.get(path)
        if old is not None:
            self._nodes.pop(id(old.node), None)
        self._entries[path] = entry
        self._nodes[id(entry.node)] = entry

    def retain(self, used: set[str]) -> None:
        """Forget the entries a flatten did not use (their tensors are released)."""
        for path in [path for path in self._entries if path not in used]:
            self._nodes.pop(id(self._entries.pop(path).node), None)

    def clear(self) -> None:
        self._entries.clear()
        self._nodes.clear()

    def node_json(self, node: object) -> str | None:
        entry = self._nodes.get(id(node))
        if entry is None or entry.node is not node:
            return None
        if entry.json is None:
            entry.json = _dumps(entry.node)
        return entry.json


def tree_json(tree: JsonValue, memo: FlattenMemo | None = None) -> str:
    """The JSON text of a tree (compact, as the manifest stores it), with the memo's nodes spliced in from
    their cached text instead of encoded again."""
    if memo is None:
        return _dumps(tree)
    parts: list[str] = []
    _tree_json(tree, memo, parts)
    return "".join(parts)


def _tree_json(node: JsonValue, memo: FlattenMemo, out: list[str]) -> None:
    if isinstance(node, dict):
        known = memo.node_json(node)
        if known is not None:
            out.append(known)
            return
        out.append("{")
        for i, (key, value) in enumerate(node.items()):
            if i:
                out.append(",")
            out.append(_dumps(key))
            out.append(":")
            _tree_json(value, memo, out)
        out.append("}")
    elif isinstance(node, list):
        out.append("[")
        for i, value in enumerate(node):
            if i:
                out.append(",")
            _tree_json(value, memo, out)
        out.append("]")
    else:
        out.append(_dumps(node))


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False, check_circular=False)


# A sharded tensor's decoder: (its spec, its local shard) -> what the state holds in its place.
DTensorDecoder = Callable[[dict[str, JsonValue], Any], object]


def unflatten(tree: JsonValue, tensor: Callable[[int], object], dtensor: DTensorDecoder | None = None) -> Any:
    """Rebuild a state from its structure; `tensor(i)` supplies the i-th tensor, and `dtensor` a sharded
    tensor from its local shard (without it, a sharded tensor comes back as its local shard)."""
    if not isinstance(tree, dict):
        return tree
    if "dict" in tree:
        return _decode_dict(tree, tensor, dtensor)
    ((tag, payload),) = tree.items()
    if tag == "tensor":
        assert isinstance(payload, int)
        return tensor(payload)
    if tag == "dtensor":
        assert isinstance(payload, dict) and isinstance(payload["tensor"], int)
        local = tensor(payload["tensor"])
        return local if dtensor is None else dtensor(payload, local)
    if tag in ("module", "optimizer"):
        return unflatten(payload, tensor, dtensor)
    if tag in ("list", "tuple"):
        assert isinstance(payload, list)
        items = [unflatten(item, tensor, dtensor) for item in payload]
        return items if tag == "list" else tuple(items)
    return _decode_plain(tree)


def _decode_dict(
    node: dict[str, JsonValue], tensor: Callable[[int], object], dtensor: DTensorDecoder | None
) -> dict[Any, Any]:
    pairs = node["dict"]
    assert isinstance(pairs, list)
    decoded = [
        (_decode_plain(pair[0]), unflatten(pair[1], tensor, dtensor))
        for pair in pairs
        if isinstance(pair, list)
    ]
    if "metadata" not in node:
        return dict(decoded)
    # A state_dict: load_state_dict reads module versions from its _metadata attribute.
    restored: OrderedDict[Any, Any] = OrderedDict(decoded)
    restored._metadata = unflatten(node["metadata"], tensor, dtensor)  # type: ignore[attr-defined]
    return restored


class _Encoder:
    def __init__(self, flat: FlatState, memo: FlattenMemo | None = None):
        self._flat = flat
        self._open: set[int] = set()  # ids of the containers on the current path, to refuse cycles
        self._memo = memo
        self.used: set[str] = set()  # paths of the memo entries this flatten used or made
        self._in_modules = 0  # depth of module state_dicts being encoded

    def encode(self, value: object, path: str) -> JsonValue:
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and type(value) is not nn.Parameter:
                if isinstance(value, dtensor_type() or ()):
                    return self._encode_dtensor(value, path)
                # Before _check_tensor, which fails reading a ShardedTensor's layout.
                if is_sharded_tensor(value):
                    raise TypeError(f"{path}: unsupported tensor: {FSDP1_HINT}")
            _check_tensor(value, path)
            if value.requires_grad:
                if not self._in_modules:
                    self._flat.detached_outside_modules = True
                value = value.detach()
            self._flat.tensors.append(value)
            self._flat.keys.append(path)
            return {"tensor": len(self._flat.tensors) - 1}
        if isinstance(value, PLAIN_TYPES):
            return _encode_plain(value, path)
        if id(value) in self._open:
            raise TypeError(f"{path}: the state contains itself (a reference cycle)")
        self._open.add(id(value))
        try:
            return self._encode_container(value, path)
        finally:
            self._open.discard(id(value))

    def _encode_dtensor(self, value: torch.Tensor, path: str) -> JsonValue:
        # Only this rank's shard is saved; the spec says where it sits in the global tensor.
        local = local_shard(value)
        _check_tensor(local, path)
        self._flat.dtensors[len(self._flat.tensors)] = value
        self._flat.tensors.append(local)
        self._flat.keys.append(path)
        return {"dtensor": spec_of(value, len(self._flat.tensors) - 1)}

    def _encode_container(self, value: object, path: str) -> JsonValue:
        if isinstance(value, nn.Module):
            self._flat.modules.append(value)
            # keep_vars: the parameters themselves, not a detach() of each (detaching a DTensor goes through
            # its dispatch, tens of microseconds per tensor); encode() takes them outside autograd.
            self._in_modules += 1
            try:
                return {"module": self._encode_dict(value.state_dict(keep_vars=True), path)}
            finally:
                self._in_modules -= 1
        if isinstance(value, torch.optim.Optimizer):
            state_dict = value.state_dict()
            base = len(self._flat.tensors)
            node = {"optimizer": self._encode_dict(state_dict, path)}
            groups = state_dict.get("param_groups", ())
            in_groups = {id(v) for group in groups for v in group.values() if isinstance(v, torch.Tensor)}
            if in_groups:
                found = self._flat.tensors[base:]
                self._flat.group_tensors += [base + i for i, t in enumerate(found) if id(t) in in_groups]
            return node
        if isinstance(value, dict):
            return self._encode_dict(value, path)
        if type(value) in (list, tuple):
            assert isinstance(value, list | tuple)
            if _JSON_SCALARS.issuperset(map(type, value)):
                # Encoded as they are (an optimizer's parameter ids: hundreds of ints at every save).
                return {type(value).__name__: list(value)}
            items = [self.encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return {type(value).__name__: items}
        raise TypeError(f"{path}: unsupported type {type(value).__qualname__}")

    def _encode_dict(self, value: dict[Any, Any], path: str) -> JsonValue:
        memo = self._memo
        if memo is None or not value:
            return self._encode_new_dict(value, path)
        self.used.add(path)
        entry = memo.get(path)
        if entry is not None:
            node = self._reuse(entry, value)
            if node is not None:
                return node
        flat = self._flat
        base = len(flat.tensors)
        detached = flat.detached_outside_modules
        node = self._encode_new_dict(value, path)
        if flat.detached_outside_modules and not detached:
            return node  # such dicts take the long way, which notes it
        values = list(value.values())
        inner_sizes: list[int] | None = None
        inner_keys: list[Any] = []
        if all(isinstance(v, torch.Tensor) for v in values):
            leaves = values
        elif all(
            type(v) is dict and v and all(isinstance(t, torch.Tensor) for t in v.values()) for v in values
        ):
            inner_sizes = [len(v) for v in values]
            inner_keys = [key for v in values for key in v]
            leaves = [t for v in values for t in v.values()]
        else:
            return node
        if len(flat.tensors) - base != len(leaves):
            return node
        DTensor = dtensor_type()
        sharded = [i for i, t in enumerate(leaves) if DTensor is not None and isinstance(t, DTensor)]
        dtensors = [leaves[i] for i in sharded]
        memo.put(
            path,
            _MemoEntry(
                base=base,
                keys=list(value),
                values=values,
                inner_sizes=inner_sizes,
                inner_keys=inner_keys,
                leaves=leaves,
                plain=[i for i, t in enumerate(leaves) if DTensor is None or not isinstance(t, DTensor)],
                sharded=sharded,
                dtensors=dtensors,
                parts=list(map(_SPEC_PARTS, dtensors)),
                locals=[flat.tensors[base + i] for i in sharded],
                paths=flat.keys[base:],
                metadata=getattr(value, "_metadata", None),
                node=node,
            ),
        )
        return node

    def _reuse(self, entry: _MemoEntry, value: dict[Any, Any]) -> JsonValue:
        """The memo's node for `value` when it holds what the entry was made from (None otherwise), with
        its tensors appended to the flat state. The checks run as C loops (map) where they can: this is
        what a steady-state save costs per tensor."""
        flat = self._flat
        if entry.base != len(flat.tensors) or len(value) != len(entry.values):
            return None
        if entry.inner_sizes is None:
            if not all(map(operator.is_, value.values(), entry.values)):
                return None
        else:
            # Dicts of tensors, by content: optimizer.load_state_dict makes new ones around the same tensors.
            items = list(value.values())
            if (
                not all(map(operator.is_, map(type, items), repeat(dict)))
                or list(map(len, items)) != entry.inner_sizes
                or not all(map(operator.is_, chain.from_iterable(map(dict.values, items)), entry.leaves))
                or list(chain.from_iterable(items)) != entry.inner_keys
            ):
                return None
        if list(value) != entry.keys or getattr(value, "_metadata", None) != entry.metadata:
            return None
        leaves = list(entry.leaves)
        if entry.dtensors:
            if list(map(_SPEC_PARTS, entry.dtensors)) != entry.parts:
                return None
            shards = list(map(_LOCAL, entry.dtensors))
            if any(map(_REQUIRES_GRAD, shards)):
                return None
            if not all(map(operator.is_, shards, entry.locals)):
                if not all(map(_plain_ok, shards)):
                    return None
                entry.locals = shards
            for i, shard in zip(entry.sharded, shards, strict=True):
                leaves[i] = shard
        for i in entry.plain:
            tensor = leaves[i]
            if tensor.requires_grad:
                if not self._in_modules:
                    return None
                tensor = leaves[i] = tensor.detach()
            if not _plain_ok(tensor):
                return None  # the long way, which names the problem
        base = entry.base
        flat.tensors.extend(leaves)
        flat.keys.extend(entry.paths)
        flat.dtensors.update(zip([base + i for i in entry.sharded], entry.dtensors, strict=True))
        return entry.node

    def _encode_new_dict(self, value: dict[Any, Any], path: str) -> JsonValue:
        pairs: list[JsonValue] = []
        for key, item in value.items():
            if not isinstance(key, PLAIN_TYPES):
                raise TypeError(f"{path}: unsupported dict key type {type(key).__qualname__} ({key!r})")
            pairs.append([_encode_plain(key, path), self.encode(item, f"{path}[{key!r}]")])
        metadata = getattr(value, "_metadata", None)
        if isinstance(metadata, dict):
            return {"dict": pairs, "metadata": self.encode(metadata, f"{path}._metadata")}
        return {"dict": pairs}


def _plain_ok(tensor: torch.Tensor) -> bool:
    """A tensor the checkpoint can hold as it is (see _check_tensor)."""
    return (
        tensor.layout is torch.strided
        and (tensor.is_cpu or tensor.is_cuda)
        and not tensor.is_nested
        and not tensor.is_quantized
        and type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    )


def _check_tensor(tensor: torch.Tensor, path: str) -> None:
    # The common case first, as cheaply as possible: it runs for every tensor of every save.
    if _plain_ok(tensor):
        return
    if tensor.is_nested:
        problem = "nested tensors are not supported"
    elif tensor.layout != torch.strided:
        problem = f"{tensor.layout} tensors are not supported, only dense ones"
    elif tensor.is_quantized:
        problem = "quantized tensors are not supported"
    elif tensor.device.type not in ("cpu", "cuda"):
        problem = f"tensors on {tensor.device.type} are not supported, only cpu and cuda"
    else:
        problem = f"tensor subclass {type(tensor).__qualname__} is not supported"
    raise TypeError(f"{path}: unsupported tensor: {problem}")


def _encode_plain(value: object, path: str) -> JsonValue:
    # Exact types only: a subclass (numpy.float64, an IntEnum) would come back as its base type.
    if value is None or type(value) in (str, int, bool):
        return value  # type: ignore[return-value]
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if type(value) is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    raise TypeError(f"{path}: unsupported type {type(value).__qualname__}")


def _decode_plain(node: JsonValue) -> Any:
    if not isinstance(node, dict):
        return node
    if "float" in node:
        assert isinstance(node["float"], str)
        return float(node["float"])
    if "bytes" in node:
        assert isinstance(node["bytes"], str)
        return base64.b64decode(node["bytes"])
    raise ValueError(f"malformed checkpoint structure: {node!r}")
