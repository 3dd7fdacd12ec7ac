"""Fences: where training needs the saved tensors back while a background copy may still read them.

An asynchronous save copies the state in background threads (checkpointer.py). Parameters and optimizer
states change in place only in the optimizer step, so a pre-hook on every optimizer step waits for the
copy (`fence_optimizer_steps`); the next save, restore, wait() and close() wait too. Module buffers change
in forward, so save() snapshots them instead of making forward wait (`BufferSnapshot`); a state of detached
tensors (a DCP state dict) has no modules to find them in, so there every tensor that is no parameter or
state of an optimizer seen stepping is snapshotted (`SteppedOptimizers`). A save whose slot
a reader (a replication stream) holds keeps trying in the background until a fence needs the state back
(`open_when_free`), and is skipped then.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from worker_lib.store.slots import SlotStore, SlotWriter

# How long a save whose slot is being read keeps trying when nothing in training needs the state back
# (an explicit wait() or close()): a replication stream lets go within a stripe once it sees the store's
# `want` marker (SlotStore.writer_waiting), which a save finding every slot held leaves.
BUSY_WAIT_LIMIT_S = 10.0
_BUSY_POLL_S = 0.002


class Fenced(Protocol):
    _stepped: SteppedOptimizers

    def _fence(self) -> None:
        """Training needs the saved state back: finish (or give up) the pending copy."""


def fence_optimizer_steps(owner: Fenced) -> RemovableHandle:
    """Make every optimizer step (of any optimizer) call `owner._fence()` first, and note the optimizer in
    `owner._stepped`. The hook holds only a weak reference, so a forgotten owner does not keep itself
    alive."""
    return register_optimizer_step_pre_hook(partial(_wait_before_step, weakref.ref(owner)))


def _wait_before_step(
    checkpointer: weakref.ref[Fenced], optimizer: object, args: object, kwargs: object
) -> None:
    if (alive := checkpointer()) is not None:
        alive._stepped.note(optimizer)
        alive._fence()


class SteppedOptimizers:
    """The optimizers whose step the fence has seen (weakly held): their parameters and states are the
    tensors an optimizer step, which waits for the copy, changes in place.

    A state of detached tensors (a DCP state dict: get_state_dict's tensors, no module or optimizer objects)
    does not say which of its tensors are parameters and which are buffers; the storages of these optimizers'
    tensors do (see `unprotected`)."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()

    def note(self, optimizer: object) -> None:
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer not in self._seen:
            self._seen.add(optimizer)

    def storages(self) -> set[tuple[int, int]]:
        """The storage (device, address) of every parameter and state tensor of the optimizers seen (a
        DTensor's: its local shard's, which is what a state dict's item holds)."""
        keys: set[tuple[int, int]] = set()
        for optimizer in list(self._seen):
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            owned += [v for state in optimizer.state.values() for v in state.values()]
            for tensor in owned:
                if isinstance(tensor, torch.Tensor):
                    local = getattr(tensor, "_local_tensor", tensor)
                    if isinstance(local, torch.Tensor) and local.numel():
                        keys.add(_storage_key(local))
        return keys

    def unprotected(
        self, tensors: Sequence[torch.Tensor], storages: Sequence[int], fresh: Sequence[torch.Tensor] = ()
    ) -> list[int] | None:
        """Which of `tensors` (with their storage addresses) a save of detached tensors must snapshot: those
        that are no parameter or state of an optimizer seen stepping (buffers, which forward changes in
        place; a tensor `lr`; any other tensor), nor one of `fresh` (made for the save, held by nothing
        else). None when these come to more than half of the state's bytes (no optimizer has stepped yet, or
        a large frozen part): the save is then as good as a copy of it all, and waits for its copy instead
        of holding a second copy in memory."""
        protected = self.storages()
        protected.update(_storage_key(t) for t in fresh if t.numel())
        addresses = {address for _, address in protected}
        chosen: list[int] = []
        total = outside = 0
        for i, (tensor, address) in enumerate(zip(tensors, storages, strict=True)):
            if not tensor.numel():
                continue
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            if address in addresses and _storage_key(tensor) in protected:
                continue
            chosen.append(i)
            outside += nbytes
        return None if 2 * outside > total else chosen


def open_when_free(
    store: SlotStore, iteration: int, nbytes: int, give_up: threading.Event
) -> SlotWriter | None:
    """Background: wait for a reader to let go of a slot and take it for writing; None (skip the save) when
    training needs the state back first (`give_up`) or the reader holds on for longer than
    BUSY_WAIT_LIMIT_S."""
    deadline = time.monotonic() + BUSY_WAIT_LIMIT_S
    while (writer := store.open_write(iteration, nbytes, "skip")) is None:
        if give_up.wait(_BUSY_POLL_S) or time.monotonic() > deadline:
            return None
    return writer


class BufferSnapshot:
    """Copies of the saved modules' buffers taken inside save(), so that no forward waits for the copy (and
    of the tensors in an optimizer's parameter groups: a learning-rate scheduler sets a tensor `lr` in
    place, outside the optimizer step).

    A forward changes buffers in place (BatchNorm running statistics; DistributedDataParallel overwrites them
    with rank 0's first, with `broadcast_buffers`), while parameters change only in the optimizer step,
    which waits for the copy. Buffers are small (statistics, masks, RoPE tables): their storages are copied
    into side buffers reused from save to save (the previous copy has finished reading them when save()
    runs), and the background copy reads those. Each snapshot keeps the storage offsets, strides and sharing
    of the originals, so the layout and the restored views are the same as without it. On a GPU the side
    copy is queued on the current stream, ahead of any later forward.
    """

    def __init__(self) -> None:
        self._side: list[torch.Tensor] = []
        # Per group of the last capture: what it was made for, the view of the buffer's storage that is
        # copied, and each member's view of the side copy (made again only when the group changes: two
        # torch calls per view, about 10 us per buffer).
        self._views: list[tuple[tuple[object, ...], torch.Tensor, list[torch.Tensor]]] = []

    def capture(
        self,
        tensors: list[torch.Tensor],
        modules: Sequence[nn.Module],
        storages: list[int],
        also: Sequence[int] = (),
    ) -> tuple[list[torch.Tensor], list[int]]:
        """`tensors` with those that live in a buffer's storage (or in the storage of a tensor of `also`,
        indices into `tensors`) replaced by views of a fresh copy, and the storage address of each
        (`storages`: those of `tensors`, see layout.storage_addresses)."""
        if not modules and not also:
            return tensors, storages
        owned = {
            _storage_key(local)
            for module in modules
            for buffer in module.buffers()
            # A sharded buffer's local tensor is what the state holds.
            if type(local := getattr(buffer, "_local_tensor", buffer)) is torch.Tensor and local.numel()
        }
        owned.update(_storage_key(tensors[i]) for i in also if tensors[i].numel())
        if not owned:
            return tensors, storages
        addresses = {address for _, address in owned}
        groups: dict[tuple[int, int], list[int]] = {}
        for i, address in enumerate(storages):
            # The address alone first: a set of ints, then the device and bytes of the few it finds.
            if address in addresses and (key := _storage_key(tensors[i])) in owned and tensors[i].numel():
                groups.setdefault(key, []).append(i)
        captured = list(tensors)
        captured_storages = list(storages)
        side: list[torch.Tensor] = []
        views: list[tuple[tuple[object, ...], torch.Tensor, list[torch.Tensor]]] = []
        for n, (storage_key, members) in enumerate(groups.items()):
            # Everything the views depend on: the buffer's storage (device, address, and its size: a
            # storage resized in place keeps its address) and each member's place in it.
            first = tensors[members[0]]
            described = [
                (i, t.dtype, t.storage_offset(), t.shape, t.stride(), t.is_conj(), t.is_neg())
                for i in members
                for t in (tensors[i],)
            ]
            made_for = (storage_key, first.untyped_storage().nbytes(), tuple(described))
            cached = self._views[n] if n < len(self._views) else None
            if cached is not None and cached[0] == made_for:
                kept = self._side[n]
                kept.copy_(cached[1])
                side.append(kept)
                views.append(cached)
                address = kept.untyped_storage().data_ptr()
                for i, view in zip(members, cached[2], strict=True):
                    captured_storages[i] = address
                    captured[i] = view
                continue
            extents = [_byte_extent(tensors[i]) for i in members]
            start = min(lo for lo, _ in extents) // 16 * 16  # every itemsize divides it
            nbytes = max(hi for _, hi in extents) - start
            source = torch.empty(0, dtype=torch.uint8, device=first.device)
            source.set_(first.untyped_storage(), start, (nbytes,), (1,))
            copy = self._side[n] if n < len(self._side) else None
            if copy is None or copy.numel() != nbytes or copy.device != first.device:
                copy = torch.empty(nbytes, dtype=torch.uint8, device=first.device)
            copy.copy_(source)
            side.append(copy)
            address = copy.untyped_storage().data_ptr()
            made: list[torch.Tensor] = []
            for i in members:
                captured_storages[i] = address
                tensor = tensors[i]
                itemsize = tensor.element_size()
                view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
                view.set_(
                    copy.untyped_storage(),
                    (tensor.storage_offset() * itemsize - start) // itemsize,
                    tensor.shape,
                    tensor.stride(),
                )
                if tensor.is_conj():
                    view = view.conj()
                if tensor.is_neg():
                    view = torch._neg_view(view)
                captured[i] = view
                made.append(view)
            views.append((made_for, source, made))
        self._side = side
        self._views = views
        return captured, captured_storages

    def release(self) -> None:
        self._side = []
        self._views = []


# A GPU job's host-side tensors (AdamW's `step` counters, a few scalars) are snapshotted inside save() when
# they are at most this large together, so that the optimizer step waits for the save's copies on the device
# alone; a state with more of it on the host (CPU-offloaded optimizer states) keeps the host wait.
HOST_SNAPSHOT_BYTES = 16 << 20


class HostSnapshot:
    """Copies, taken inside save(), of the host tensors a save with device copies still reads in the
    background, so the optimizer step need not wait for the host (see DeviceFence.order_device). The side
    tensors are reused from save to save (the previous save has finished reading them when save() runs),
    so their addresses stay the same and the background copies keep their compiled plans."""

    def __init__(self) -> None:
        self._side: list[torch.Tensor] = []
        self._made_for: tuple[list[int], list[tuple[Any, ...]]] | None = None

    def capture(self, sources: list[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
        """`sources` with each of `indices` (host tensors) replaced by a copy of its current values."""
        originals = [sources[i] for i in indices]
        made_for = (
            list(indices),
            list(zip(map(_DTYPE_AND_SHAPE, originals), map(torch.Tensor.stride, originals), strict=True)),
        )
        if made_for != self._made_for:
            self._side = [torch.empty_like(original) for original in originals]
            self._made_for = made_for
        # One call for all of them (AdamW's 0-d `step` counters, one per parameter): 0.18 ms instead of
        # 0.47 ms for 291 of them here with a copy_() each.
        if originals:  # (no host tensors at all: a state wholly on the device; foreach wants one at least)
            torch._foreach_copy_(self._side, originals)
        captured = list(sources)
        for i, copy in zip(indices, self._side, strict=True):
            captured[i] = copy
        return captured

    def release(self) -> None:
        self._side = []
        self._made_for = None


_DTYPE_AND_SHAPE = operator.attrgetter("dtype", "shape")


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    # get_device() is -1 on the CPU and the device index on CUDA.
    return tensor.get_device(), tensor.untyped_storage().data_ptr()


def _byte_extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes of a non-empty tensor in its storage."""
    itemsize = tensor.element_size()
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    start = int(tensor.storage_offset()) * itemsize
    return start, start + (int(last) + 1) * itemsize
