"""Where each tensor's bytes go in a slot's data region, planned once per state structure.

Tensors are placed in the order they appear in the state, each region 64-byte aligned. A tensor that shares
its storage with another tensor of the state (tied weights, views of one buffer) is not copied twice: the
span of the storage that the group uses is saved once, and each member is recorded as a strided view into
it, so restore rebuilds one storage with the same views.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from worker_lib.store.copy import (
    Bytes,
    Extent,
    FlatTransfer,
    LandedTransfer,
    StripePlan,
    Transfer,
    flat_bytes,
    has_lazy_bits,
    plan_stripes,
    row_bytes,
    row_transfer,
)
from worker_lib.store.manifest import TensorEntry, TensorView

ALIGN = 64
# The largest itemsize (complex128): a shared span starts on a multiple of it in its storage, and restore
# rounds its fresh storage up to a multiple of it, so every member can be viewed with its own dtype.
SPAN_ALIGN = 16

Signature = tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class Blob:
    """A region of the data area and the tensor whose bytes fill it."""

    offset: int
    nbytes: int
    source: int  # index of the tensor
    span_start: int | None  # shared storage: the region is its bytes from here on; None: the tensor's values
    flat: bool  # raw bytes copied by numpy; else a strided tensor copied row by row by torch


@dataclass(frozen=True)
class Layout:
    entries: tuple[TensorEntry, ...]
    blobs: tuple[Blob, ...]
    stripes: tuple[StripePlan, ...]
    data_bytes: int


def signature(
    tensors: Sequence[torch.Tensor], keys: Sequence[str], storages: Sequence[int] | None = None
) -> Signature:
    """Everything the layout depends on; a save whose signature matches the last one reuses its layout.

    Per tensor its dtype, shape, strides, storage offset, device and lazy bits, and which tensors share a
    storage (`storages`: each tensor's storage address, see storage_addresses, when the caller has them).
    Addresses themselves are not in it: a state whose tensors were reallocated keeps its layout. It runs on
    the training thread at every save (and at a restore into the saved state), hence one plain loop of as
    few calls per tensor as will do (about 1 us per tensor here).
    """
    described = [
        (t.dtype, t.shape, t.stride(), t.storage_offset(), t.get_device(), t.is_neg() or t.is_conj())
        for t in tensors
    ]
    if storages is None:
        storages = storage_addresses(tensors)
    return (tuple(keys), tuple(described), _owners(tensors, storages, [d[4] for d in described]))


def storage_addresses(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's storage address (its device is apart: get_device())."""
    return list(map(torch.UntypedStorage.data_ptr, map(torch.Tensor.untyped_storage, tensors)))


def plan(tensors: Sequence[torch.Tensor], keys: Sequence[str]) -> Layout:
    """Place each tensor, or each shared storage span, in the data region and cut the region into stripes."""
    owners = _storage_owners(tensors)
    members: dict[int, list[torch.Tensor]] = {}
    for tensor, owner in zip(tensors, owners, strict=True):
        if owner >= 0:
            members.setdefault(owner, []).append(tensor)

    blobs: list[Blob] = []
    entries: list[TensorEntry] = []
    spans: dict[int, tuple[int, int, int]] = {}  # owner -> (offset, span start in the storage, nbytes)
    offset = 0
    for i, (tensor, key, owner) in enumerate(zip(tensors, keys, owners, strict=True)):
        dtype, shape, device = dtype_name(tensor.dtype), tuple(tensor.shape), tensor.device.type
        if owner < 0:
            nbytes = tensor.numel() * tensor.element_size()
            # Device tensors are staged into contiguous pinned memory first, so they are always flat here.
            flat = device == "cuda" or (tensor.is_contiguous() and not has_lazy_bits(tensor))
            blobs.append(Blob(offset, nbytes, i, None, flat))
            entries.append(TensorEntry(key, dtype, shape, offset, nbytes, None, device))
            offset = _align(offset + nbytes, ALIGN)
            continue
        if owner == i:
            used = [_byte_extent(member) for member in members[owner]]
            start = min(lo for lo, _ in used) // SPAN_ALIGN * SPAN_ALIGN
            nbytes = max(hi for _, hi in used) - start
            blobs.append(Blob(offset, nbytes, i, start, True))
            spans[owner] = (offset, start, nbytes)
            offset = _align(offset + nbytes, ALIGN)
        region, start, nbytes = spans[owner]
        itemsize = tensor.element_size()
        view = TensorView((tensor.storage_offset() * itemsize - start) // itemsize, tuple(tensor.stride()))
        entries.append(TensorEntry(key, dtype, shape, region, nbytes, view, device))

    extents = [
        Extent(
            blob.offset,
            blob.nbytes,
            1 if blob.flat else row_bytes(tensors[blob.source].shape, tensors[blob.source].element_size()),
            _align(blob.offset + blob.nbytes, ALIGN),
        )
        for blob in blobs
    ]
    return Layout(tuple(entries), tuple(blobs), plan_stripes(extents, offset), offset)


def blob_source(blob: Blob, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor whose bytes fill `blob`: the tensor itself, or a uint8 view of its storage span."""
    tensor = tensors[blob.source]
    if blob.span_start is None:
        return tensor
    span = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return span.set_(tensor.untyped_storage(), blob.span_start, (blob.nbytes,), (1,))


def save_transfers(
    layout: Layout, sources: Sequence[torch.Tensor], slot: Bytes, landed: frozenset[int] = frozenset()
) -> list[Transfer]:
    """How to copy each blob's source (CPU tensors, see blob_source) into its region of `slot`; the blobs in
    `landed` are already there (copied from the device straight into the slot)."""
    transfers: list[Transfer] = []
    for i, (blob, source) in enumerate(zip(layout.blobs, sources, strict=True)):
        region = slot[blob.offset : blob.offset + blob.nbytes]
        if i in landed:
            transfers.append(LandedTransfer())
        elif blob.flat:
            transfers.append(FlatTransfer(flat_bytes(source), region))
        else:
            target = torch.from_numpy(region).view(source.dtype).view(source.shape)
            transfers.append(row_transfer(source, target))
    return transfers


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {name!r} in checkpoint")
        _DTYPES[name] = dtype
    return dtype


_DTYPES: dict[str, torch.dtype] = {}


def _storage_owners(tensors: Sequence[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first tensor sharing its storage, or -1 when it shares nothing."""
    return list(_owners(tensors, storage_addresses(tensors), [t.get_device() for t in tensors]))


def _owners(
    tensors: Sequence[torch.Tensor], storages: Sequence[int], devices: Sequence[int]
) -> tuple[int, ...]:
    """_storage_owners from each tensor's storage address and device (get_device(): -1 on the CPU). Only
    tensors whose storage another one has too are looked at further: in most states there are none."""
    if len(set(storages)) == len(storages):
        return (-1,) * len(storages)  # no two tensors share a storage (distinct addresses: a set of ints)
    first: dict[tuple[int, int], int] = {}
    owner = [first.setdefault(key, i) for i, key in enumerate(zip(devices, storages, strict=True))]
    if len(first) == len(owner):
        return (-1,) * len(owner)  # the same addresses on different devices
    groups: dict[int, list[int]] = {o: [] for i, o in enumerate(owner) if o != i}
    for i, o in enumerate(owner):
        if o in groups:
            groups[o].append(i)
    owners = [-1] * len(owner)
    for members in groups.values():
        # Empty and conjugate/negative views are always saved on their own: they have no bytes to share, or
        # their raw bits are not their values.
        sharing = [
            i for i in members if tensors[i].numel() and not (tensors[i].is_conj() or tensors[i].is_neg())
        ]
        if len(sharing) > 1:
            for i in sharing:
                owners[i] = sharing[0]
    return tuple(owners)


def _byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes of a non-empty tensor in its storage."""
    itemsize = tensor.element_size()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = int(tensor.storage_offset()) * itemsize
    return start, start + (int(last) + 1) * itemsize


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment
