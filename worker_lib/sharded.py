"""Sharded states: DTensor (FSDP2 `fully_shard`, tensor parallelism, HSDP) saved shard by shard.

Each rank saves only its local shard (`dt.to_local()`), as an ordinary tensor of the checkpoint, and the
state tree records where the shard sits in the global tensor, as a `{"dtensor": spec}` node:

    {"tensor": <index of the local shard>,
     "mesh": {"device": "cpu", "shape": [4], "dims": ["dp"], "ranks": [0, 1, 2, 3]},
     "coordinate": [1],                    # this rank's place in the mesh
     "placements": [["shard", 0]],         # ["replicate"], ["partial", op], ["strided_shard", dim, split]
     "shape": [1024, 512], "stride": [512, 1],   # the global tensor
     "local_shape": [256, 512], "offsets": [256, 0]}

The bytes are plain, so replication, the peer and persistent tiers and the planner handle them like any
other checkpoint. A restore fills the live DTensors' local shards in place, and only into an identically
sharded state: a different mesh, world size, placement or shard is refused (ShardingMismatchError), since
resharding needs every rank's shards; export the checkpoint to torch.distributed.checkpoint (DCP) for that.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

import torch

from worker_lib.store.manifest import JsonValue

RESHARD_HINT = (
    "Castor restores sharded states only in place, into the same mesh and sharding; to load them with "
    "another world size or mesh, export the checkpoint to DCP (`castor checkpoints export`, README "
    '"FSDP2 and sharded states") and load it with torch.distributed.checkpoint'
)

FSDP1_HINT = (
    "FSDP1's SHARDED_STATE_DICT (ShardedTensor) is not supported: shard the model with FSDP2 "
    "(torch.distributed.fsdp.fully_shard), whose DTensor parameters and optimizer states Castor saves "
    "shard by shard"
)


class ShardingMismatchError(ValueError):
    """The checkpoint's sharding (mesh, placements, shard) differs from the live state's."""


def dtensor_type() -> type | None:
    """torch.distributed.tensor.DTensor, or None where torch.distributed is not available or that module was
    never imported: no tensor can be a DTensor then, and importing it (torch.fx and sympy with it) costs
    about 0.7 s of CPU, which a restarted process would pay inside its first restore()."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    return _dtensor_type()


@lru_cache(maxsize=1)
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def is_sharded_tensor(tensor: torch.Tensor) -> bool:
    """An FSDP1 / torch.distributed._shard ShardedTensor (checked by name: no import of that package)."""
    return any(cls.__name__ == "ShardedTensor" for cls in type(tensor).__mro__)


def local_shard(dtensor: Any) -> torch.Tensor:
    """The rank's own shard of a DTensor, outside autograd, sharing its storage (no copy)."""
    local: torch.Tensor = dtensor._local_tensor  # to_local() without the autograd Function's per-call cost
    return local.detach() if local.requires_grad else local


def spec_of(dtensor: Any, index: int) -> dict[str, JsonValue]:
    """The `dtensor` node of a DTensor whose local shard is the checkpoint's tensor `index`."""
    spec = dict(_live_spec(dtensor)[0])
    spec["tensor"] = index
    return spec


def _live_spec(dtensor: Any) -> tuple[dict[str, JsonValue], Signature]:
    """A live DTensor's spec (without "tensor") and its signature, computed once per layout.

    Cached by the mesh's identity, placements, global shape and stride (comparing meshes or DTensorSpecs
    by value, or reading a mesh's rank tensor, costs more than the whole lookup): it runs for every sharded
    tensor of every save and of every restore into a live model. The cache holds the mesh, so its id is not
    reused while the entry lives.
    """
    # First by the identity of the DTensorSpec's parts (mesh, placements tuple, TensorMeta: immutable
    # values, held by the entry so their ids are not reused), which needs no hashing of placements and
    # shapes; then by value.
    dtensor_spec = getattr(dtensor, "_spec", None)
    parts = (getattr(dtensor_spec, "mesh", None), getattr(dtensor_spec, "placements", None))
    meta = getattr(dtensor_spec, "tensor_meta", None)
    identity = (id(parts[0]), id(parts[1]), id(meta))
    known = _BY_IDENTITY.get(identity)
    if known is not None and known[0] is parts[0] and known[1] is parts[1] and known[2] is meta:
        return known[3], known[4]
    mesh, placements, shape, stride = _layout(dtensor)
    key = (id(mesh), placements, shape, stride)
    cached = _SPECS.get(key)
    if cached is None or cached[0] is not mesh:
        if len(_SPECS) > _CACHE_LIMIT:
            _SPECS.clear()
        spec = _placement_spec(mesh, key[1], key[2], key[3])
        cached = _SPECS[key] = (mesh, spec, spec_signature(spec))
    if meta is not None:
        if len(_BY_IDENTITY) > _IDENTITY_LIMIT:
            _BY_IDENTITY.clear()
        _BY_IDENTITY[identity] = (parts[0], parts[1], meta, cached[1], cached[2])
    return cached[1], cached[2]


def _layout(dtensor: Any) -> tuple[Any, tuple[Any, ...], tuple[int, ...], tuple[int, ...]]:
    """A DTensor's mesh, placements, global shape and stride, read from its DTensorSpec: `dtensor.shape`
    and `dtensor.stride()` go through the tensor subclass's dispatch (15-25 us each here, against 0.2 us for
    the spec's fields), twice per sharded tensor of every save and restore."""
    spec: Any = getattr(dtensor, "_spec", None)
    meta = getattr(spec, "tensor_meta", None)
    if meta is not None:
        return spec.mesh, tuple(spec.placements), tuple(meta.shape), tuple(meta.stride)
    return dtensor.device_mesh, tuple(dtensor.placements), tuple(dtensor.shape), tuple(dtensor.stride())


# A spec's identity for comparisons: every field a restore checks (mesh, placements, global shape, this
# rank's coordinate, its shard's offsets and shape), see spec_signature.
Signature = tuple[Any, ...]

_CACHE_LIMIT = 4096
# One entry per DTensor (each has its own TensorMeta): room for the states of large models.
_IDENTITY_LIMIT = 1 << 16
_BY_IDENTITY: dict[tuple[int, int, int], tuple[Any, Any, Any, dict[str, JsonValue], Signature]] = {}
_SPECS: dict[tuple[Any, ...], tuple[Any, dict[str, JsonValue], Signature]] = {}
_MESH_SPECS: dict[int, tuple[Any, dict[str, JsonValue]]] = {}


def spec_signature(spec: dict[str, JsonValue]) -> Signature:
    """The fields of a shard's spec that must match for an in-place restore, hashable and cheap to compare:
    two shards with equal signatures are sharded alike (sharding_difference finds nothing). repr() of the
    JSON lists (ints and strings, from a manifest or computed live) is exact and runs in C: a few
    microseconds per tensor, where walking the nested lists in Python cost ten times that."""
    mesh = spec["mesh"]
    assert isinstance(mesh, dict)
    # One repr() of them all: one C call per shard instead of eight.
    fields = (
        mesh.get("device"),
        mesh.get("shape"),
        mesh.get("dims"),
        mesh.get("ranks"),
        spec["placements"],
        spec["shape"],
        spec.get("coordinate"),
        spec.get("offsets"),
        spec.get("local_shape"),
    )
    return (repr(fields),)


def _placement_spec(
    mesh: Any, placements: tuple[Any, ...], shape: tuple[int, ...], stride: tuple[int, ...]
) -> dict[str, JsonValue]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    coordinate = mesh.get_coordinate()
    return {
        "mesh": mesh_spec(mesh),
        "coordinate": list(coordinate) if coordinate is not None else None,
        "placements": [_encode_placement(p) for p in placements],
        "shape": list(shape),
        "stride": list(stride),
        "local_shape": list(local_shape),
        "offsets": list(offsets),
    }


def mesh_spec(mesh: Any) -> dict[str, JsonValue]:
    """A mesh as the checkpoint records it (shared: do not modify). Cached by the mesh's identity: reading
    `mesh.mesh` rebuilds its rank tensor from the layout (about 0.1 ms), once per mesh instead of per
    tensor."""
    cached = _MESH_SPECS.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        if len(_MESH_SPECS) > _CACHE_LIMIT:
            _MESH_SPECS.clear()
        names = mesh.mesh_dim_names
        ranks = mesh.mesh
        spec: dict[str, JsonValue] = {
            "device": mesh.device_type,
            "shape": list(ranks.shape),
            "dims": list(names) if names is not None else None,
            "ranks": ranks.tolist(),
        }
        cached = _MESH_SPECS[id(mesh)] = (mesh, spec)
    return cached[1]


def _encode_placement(placement: Any) -> JsonValue:
    from torch.distributed.tensor import Partial, Replicate, Shard

    kind = type(placement).__name__
    if kind == "_StridedShard":  # FSDP2 + TP: a Shard(dim) with a split factor
        return ["strided_shard", placement.dim, placement.split_factor]
    if isinstance(placement, Shard):
        return ["shard", placement.dim]
    if isinstance(placement, Replicate):
        return ["replicate"]
    if isinstance(placement, Partial):
        return ["partial", str(placement.reduce_op)]
    raise TypeError(f"unsupported DTensor placement {placement!r}")


def _decode_placement(raw: JsonValue) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    assert isinstance(raw, list) and raw and isinstance(raw[0], str)
    kind = raw[0]
    if kind == "shard":
        return Shard(int(raw[1]))  # type: ignore[arg-type]
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial(str(raw[1]))
    if kind == "strided_shard":
        from torch.distributed.tensor.placement_types import _StridedShard

        return _StridedShard(int(raw[1]), split_factor=int(raw[2]))  # type: ignore[arg-type]
    raise ValueError(f"malformed checkpoint structure: unknown placement {raw!r}")


def describe_mesh(mesh: JsonValue) -> str:
    """'(4,) dp' (shape and dimension names), as errors show a mesh."""
    assert isinstance(mesh, dict)
    shape = tuple(mesh["shape"]) if isinstance(mesh["shape"], list) else mesh["shape"]
    dims = mesh.get("dims")
    names = ",".join(str(d) for d in dims) if isinstance(dims, list) else "(unnamed)"
    return f"{shape} {names}"


def check_same_sharding(saved: dict[str, JsonValue], live: Any, path: str) -> None:
    """Refuse to restore the shard `saved` into the live DTensor `live` unless they are sharded alike.

    The live side's signature is cached per layout, so a match costs one tuple comparison; the fields are
    compared one by one, for the error's words, only when they differ."""
    current, live_signature = _live_spec(live)
    if spec_signature(saved) == live_signature:
        return
    problem = sharding_difference(saved, current)
    if problem is not None:
        raise ShardingMismatchError(f"{path}: {problem}. {RESHARD_HINT}")


def same_sharding(saved: dict[str, JsonValue], live: Any) -> bool:
    """Whether the saved shard `saved` can be restored into the live DTensor `live` (check_same_sharding
    without the error)."""
    return spec_signature(saved) == _live_spec(live)[1]


def sharding_difference(saved: dict[str, JsonValue], current: dict[str, JsonValue]) -> str | None:
    """What differs between a saved shard's spec and the live one, in words (None: nothing)."""
    saved_mesh, live_mesh = saved["mesh"], current["mesh"]
    if saved_mesh != live_mesh:
        assert isinstance(saved_mesh, dict) and isinstance(live_mesh, dict)
        detail = f"checkpoint mesh {describe_mesh(saved_mesh)} vs this process {describe_mesh(live_mesh)}"
        if (saved_mesh["shape"], saved_mesh["dims"]) == (live_mesh["shape"], live_mesh["dims"]):
            if saved_mesh["device"] != live_mesh["device"]:
                detail += f" (device {saved_mesh['device']} vs {live_mesh['device']})"
            else:
                detail += f" (ranks {saved_mesh['ranks']} vs {live_mesh['ranks']})"
        return detail
    for field, words in (
        ("placements", "placements"),
        ("shape", "global shape"),
        ("coordinate", "mesh coordinate of this rank"),
        ("offsets", "shard offsets"),
        ("local_shape", "shard shape"),
    ):
        if saved.get(field) != current.get(field):
            return f"checkpoint {words} {saved.get(field)} vs this process {current.get(field)}"
    return None


def _mesh_key(mesh: JsonValue) -> str:
    import json

    return json.dumps(mesh, sort_keys=True)


class MeshResolver:
    """Finds this process's DeviceMesh for a saved shard's mesh, to rebuild DTensors that have no live
    target to be copied into (optimizer states, a restore without `into`): the meshes of the live state,
    else, for a one-dimensional mesh over the whole default process group, a mesh made from that group.

    Each distinct layout (signature) is checked once per restore, and its DTensorSpec built once: an
    optimizer's states repeat their parameters' layouts, and a model's blocks repeat each other's."""

    def __init__(self, live: Iterable[Any] = (), *, find: Callable[[], Iterable[Any]] | None = None):
        """`live`: meshes of the live state; `find`: a function that lists them, called only once a saved
        mesh must be looked up (a restore whose every shard has a live target never walks the state)."""
        self._meshes: dict[str, Any] = {}
        self._find = find
        self._checked: dict[Signature, Any] = {}  # signature -> this process's mesh, checked
        self._dtensor_specs: dict[tuple[Signature, torch.dtype], Any] = {}
        for mesh in live:
            self.add(mesh)

    def add(self, mesh: Any) -> None:
        self._meshes.setdefault(_mesh_key(mesh_spec(mesh)), mesh)

    def check(self, spec: dict[str, JsonValue], path: str) -> Any:
        """This process's mesh for the saved shard `spec`; ShardingMismatchError when there is none, or
        when this rank's shard of it differs from the saved one."""
        return self._check(spec, spec_signature(spec), path)

    def _check(self, spec: dict[str, JsonValue], signature: Signature, path: str) -> Any:
        mesh = self._checked.get(signature)
        if mesh is not None:
            return mesh
        mesh = self._resolve(spec["mesh"], path)
        problem = sharding_difference(spec, self._spec_in(mesh, spec))
        if problem is not None:
            raise ShardingMismatchError(f"{path}: {problem}. {RESHARD_HINT}")
        self._checked[signature] = mesh
        return mesh

    def dtensor(self, spec: dict[str, JsonValue], local: torch.Tensor, path: str = "state") -> Any:
        """The DTensor of the saved `spec` around its restored local shard `local`."""
        from torch.distributed.tensor import DTensor

        signature = spec_signature(spec)
        mesh = self._check(spec, signature, path)
        key = (signature, local.dtype)
        dtensor_spec = self._dtensor_specs.get(key)
        if dtensor_spec is None:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            placements, shape, stride = spec["placements"], spec["shape"], spec["stride"]
            assert isinstance(placements, list) and isinstance(shape, list) and isinstance(stride, list)
            # What DTensor.from_local builds (with run_check=False, shape and stride given), once per
            # layout: specs are immutable and shared between DTensors, as DTensor's own operators do.
            dtensor_spec = self._dtensor_specs[key] = DTensorSpec(
                mesh,
                tuple(_decode_placement(p) for p in placements),
                tensor_meta=TensorMeta(
                    torch.Size(int(n) for n in shape),  # type: ignore[arg-type]
                    tuple(int(n) for n in stride),  # type: ignore[arg-type]
                    local.dtype,
                ),
            )
        # The constructor from_local's autograd Function calls, without that Function's per-call cost.
        return DTensor(local, dtensor_spec, requires_grad=local.requires_grad)  # type: ignore[no-untyped-call]

    @staticmethod
    def _spec_in(mesh: Any, saved: dict[str, JsonValue]) -> dict[str, JsonValue]:
        placements, shape, stride = saved["placements"], saved["shape"], saved["stride"]
        assert isinstance(placements, list) and isinstance(shape, list) and isinstance(stride, list)
        return _placement_spec(
            mesh,
            tuple(_decode_placement(p) for p in placements),
            tuple(int(n) for n in shape),  # type: ignore[arg-type]
            tuple(int(n) for n in stride),  # type: ignore[arg-type]
        )

    def _resolve(self, saved: JsonValue, path: str) -> Any:
        if self._find is not None:
            find, self._find = self._find, None
            for mesh in find():
                self.add(mesh)
        key = _mesh_key(saved)
        if key in self._meshes:
            return self._meshes[key]
        world = _world_mesh(saved)
        if world is not None:
            self._meshes[key] = world
            return world
        if self._meshes:
            live = next(iter(self._meshes.values()))
            problem = (
                f"checkpoint mesh {describe_mesh(saved)} vs this process {describe_mesh(mesh_spec(live))}"
            )
        else:
            problem = (
                f"the checkpoint has a tensor sharded over the mesh {describe_mesh(saved)} and this process "
                "has no such mesh: pass the sharded model and optimizer as `into` to restore()"
            )
        raise ShardingMismatchError(f"{path}: {problem}. {RESHARD_HINT}")


def _world_mesh(saved: JsonValue) -> Any:
    """A 1-D mesh over the whole default process group, when that is the saved mesh (None otherwise)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not isinstance(saved, dict):
        return None
    world = dist.get_world_size()
    if saved["ranks"] != list(range(world)) or saved["device"] != _default_device():
        return None
    from torch.distributed.device_mesh import DeviceMesh

    dims = saved.get("dims")
    names = tuple(str(d) for d in dims) if isinstance(dims, list) else None
    group = dist.group.WORLD
    assert group is not None
    return DeviceMesh.from_group(group, str(saved["device"]), mesh_dim_names=names)


def _default_device() -> str:
    import torch.distributed as dist

    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def live_meshes(target: Any) -> list[Any]:
    """The device meshes of a restore target's DTensors (modules' parameters and buffers, optimizers'
    parameters, tensors), each once."""
    DTensor = dtensor_type()
    if DTensor is None:
        return []
    meshes: dict[int, Any] = {}

    def add(tensors: Iterable[Any]) -> None:
        for tensor in tensors:
            if isinstance(tensor, DTensor):
                mesh = getattr(tensor, "device_mesh")  # noqa: B009 (DTensor is only known at run time)
                meshes.setdefault(id(mesh), mesh)

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            add([value])
        elif isinstance(value, torch.nn.Module):
            add(value.parameters())
            add(value.buffers())
        elif isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:
                add(group["params"])
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(target)
    return list(meshes.values())
