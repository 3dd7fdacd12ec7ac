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
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from worker_lib.sharded import FSDP1_HINT, dtensor_type, is_sharded_tensor, local_shard, spec_of
from worker_lib.store.manifest import JsonValue

PLAIN_TYPES = (str, int, float, bool, bytes, type(None))


@dataclass
class FlatState:
    tree: JsonValue = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # key path of each tensor, e.g. state['model']['fc.weight']
    modules: list[nn.Module] = field(default_factory=list)  # modules given as objects, in the order met


def flatten(state: object) -> FlatState:
    """Split `state` into its JSON structure and its tensors; TypeError names the path of anything else."""
    flat = FlatState()
    flat.tree = _Encoder(flat).encode(state, "state")
    return flat


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
    def __init__(self, flat: FlatState):
        self._flat = flat
        self._open: set[int] = set()  # ids of the containers on the current path, to refuse cycles

    def encode(self, value: object, path: str) -> JsonValue:
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor and type(value) is not nn.Parameter:
                if isinstance(value, dtensor_type() or ()):
                    return self._encode_dtensor(value, path)
                # Before _check_tensor, which fails reading a ShardedTensor's layout.
                if is_sharded_tensor(value):
                    raise TypeError(f"{path}: unsupported tensor: {FSDP1_HINT}")
            _check_tensor(value, path)
            self._flat.tensors.append(value.detach() if value.requires_grad else value)
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
        self._flat.tensors.append(local)
        self._flat.keys.append(path)
        return {"dtensor": spec_of(value, len(self._flat.tensors) - 1)}

    def _encode_container(self, value: object, path: str) -> JsonValue:
        if isinstance(value, nn.Module):
            self._flat.modules.append(value)
            # keep_vars: the parameters themselves, not a detach() of each (detaching a DTensor goes through
            # its dispatch, tens of microseconds per tensor); encode() takes them outside autograd.
            return {"module": self._encode_dict(value.state_dict(keep_vars=True), path)}
        if isinstance(value, torch.optim.Optimizer):
            return {"optimizer": self._encode_dict(value.state_dict(), path)}
        if isinstance(value, dict):
            return self._encode_dict(value, path)
        if type(value) in (list, tuple):
            assert isinstance(value, list | tuple)
            items = [self.encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
            return {type(value).__name__: items}
        raise TypeError(f"{path}: unsupported type {type(value).__qualname__}")

    def _encode_dict(self, value: dict[Any, Any], path: str) -> JsonValue:
        pairs: list[JsonValue] = []
        for key, item in value.items():
            if not isinstance(key, PLAIN_TYPES):
                raise TypeError(f"{path}: unsupported dict key type {type(key).__qualname__} ({key!r})")
            pairs.append([_encode_plain(key, path), self.encode(item, f"{path}[{key!r}]")])
        metadata = getattr(value, "_metadata", None)
        if isinstance(metadata, dict):
            return {"dict": pairs, "metadata": self.encode(metadata, f"{path}._metadata")}
        return {"dict": pairs}


def _check_tensor(tensor: torch.Tensor, path: str) -> None:
    # The common case first, as cheaply as possible: it runs for every tensor of every save.
    if (
        tensor.layout is torch.strided
        and (tensor.is_cpu or tensor.is_cuda)
        and not tensor.is_nested
        and not tensor.is_quantized
        and type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    ):
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
