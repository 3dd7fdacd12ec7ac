"""CUDA tensors: the only module that touches CUDA; its device paths are tested only with a GPU.

A save of device tensors:

- **Straight into the slot** (`DirectCopies`, the default; CASTOR_CUDA_DIRECT=0 turns it off): the slot's
  shared-memory mapping is registered once with the CUDA host allocator (`SlotRegistrations`,
  cudaHostRegister), and each contiguous device tensor is copied into its region of the slot by the copy
  engine, on a side stream that first waits for the work already queued on the tensor's current stream (so
  it captures the values the training step computed when save() was called). Host memory holds no third
  copy of the state; the background thread only hashes those bytes. Measured on an H200 host: 55 GB/s into
  registered shared memory, as into pinned memory, against 15 GB/s into the same memory unregistered;
  registering costs 42-57 ms per GiB, once per mapping.
- **Through one reusable pinned buffer** (`PinnedStager`): strided device tensors, those with lazy
  conjugate or negative bits, all of them when registering is refused, and every one with
  CASTOR_CUDA_DIRECT=0; the background thread then copies the staged bytes into the slot.

The background thread queues the copies, on a side stream per device that waits for the event save()
recorded on the current stream (`mark_devices`): they read the values training had computed at save().
They end in events (`DeviceFence`). The optimizer step, which changes the saved tensors in place, waits for
them on the device (`DeviceFence.order_device`: its stream waits for the events) instead of blocking the
host until the save is done, once nothing host-side is left for the background thread to read from the
live state (`needs_host_wait`; save() snapshots the few small host tensors of a GPU job, such as AdamW's
`step` counters). With CASTOR_CUDA_DIRECT=0 the step blocks the host until the save is committed.

Run on an H200 (torch 2.11, 2026-11-28): every CUDA test, both paths (scripts/gpu-check).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ALIGN = 64
# "1" (the default): device tensors go straight into the slot and the optimizer step waits for them on the
# device. "0": every device tensor is staged through pinned memory; the step waits for the save on the host.
DIRECT_ENV = "CASTOR_CUDA_DIRECT"

log = logging.getLogger(__name__)


class DeviceFence:
    """The events that mark a save's device copies as done, with the device each was recorded on."""

    def __init__(self, events: Sequence[tuple[torch.device, torch.cuda.Event]] = ()):
        self.events = tuple(events)

    def __bool__(self) -> bool:
        return bool(self.events)

    def __add__(self, other: DeviceFence) -> DeviceFence:
        return DeviceFence(self.events + other.events)

    def order_device(self) -> None:
        """The optimizer step's fence: its stream (the current one) waits on the device for the copies
        that read the tensors it is about to change; the host goes on at once."""
        for device, event in self.events:
            torch.cuda.current_stream(device).wait_event(event)

    def landed(self) -> None:
        """Block the host until the copies are in host memory: the background thread, before reading."""
        for _, event in self.events:
            event.synchronize()


Marks = dict[torch.device, torch.cuda.Event]


def mark_devices(sources: Sequence[torch.Tensor]) -> Marks:
    """An event on the current stream of each device among `sources`, recorded when save() is called: the
    save's copies, queued later by the background thread, run after it, so they read the values training
    had computed then. Empty without device tensors (no CUDA call at all)."""
    devices = {source.device for source in sources if source.is_cuda}
    return {device: torch.cuda.current_stream(device).record_event() for device in devices}


class IssuedCopies:
    """Hands the fence of a save's device copies from the background thread, which queues them, to the
    optimizer step, which waits for it on the device. None: queuing failed (the step then waits for the
    save on the host, which raises its error)."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._fence: DeviceFence | None = None

    def publish(self, fence: DeviceFence | None) -> None:
        """The first call counts (the background thread publishes None on its way out, whatever happened)."""
        if not self._ready.is_set():
            self._fence = fence
            self._ready.set()

    def wait(self) -> DeviceFence | None:
        self._ready.wait()
        return self._fence


class _SideStreams:
    """One side stream per device, ordered after a save's mark on the device's current stream."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def after(self, device: torch.device, marks: Marks) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_event(marks[device])
        return stream

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], marks: Marks) -> DeviceFence:
        """Queue `destination.copy_(source)` for each (device source, host destination) pair, after the
        marks, without blocking the host; the fence says when they have run."""
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for source, destination in pairs:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = self.after(source.device, marks)
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            # The caching allocator must not hand the source's memory out again before the copy has run.
            source.record_stream(stream)
        return DeviceFence([(device, stream.record_event()) for device, stream in streams.items()])


class PinnedStager:
    """Device tensors staged through one reusable pinned buffer (grown, never shrunk). The next save reuses
    the buffer only after the background thread has copied it out (save settles the previous save first)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._streams = _SideStreams()

    def stage(self, sources: Sequence[torch.Tensor], marks: Marks) -> tuple[list[torch.Tensor], DeviceFence]:
        """Host copies of the device tensors among `sources` (others pass through), and their fence."""
        on_device = [source for source in sources if source.is_cuda]
        if not on_device:
            return list(sources), DeviceFence()
        buffer = self._reserve(sum(_aligned_nbytes(source) for source in on_device))
        staged: list[torch.Tensor] = []
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = 0
        for source in sources:
            if not source.is_cuda:
                staged.append(source)
                continue
            nbytes = source.numel() * source.element_size()
            host = buffer[offset : offset + nbytes].view(source.dtype).view(source.shape)
            pairs.append((source, host))
            staged.append(host)
            offset += _aligned_nbytes(source)
        return staged, self._streams.copy(pairs, marks)

    @property
    def staging_bytes(self) -> int:
        """Pinned host memory held for staging (0 while every device tensor goes straight to the slot)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the smaller buffer before pinning the larger one
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buffer


def to_device(tensor: torch.Tensor, device_type: str) -> torch.Tensor:
    """Move a freshly restored CPU tensor back to the device type it was saved from, when there is one.

    It goes to the current CUDA device: a restarted rank selects its device before restoring.
    """
    if device_type == "cuda" and torch.cuda.is_available():
        return tensor.to(torch.device("cuda", torch.cuda.current_device()))
    return tensor


def _aligned_nbytes(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN


PAGE = mmap.PAGESIZE


def page_span(address: int, nbytes: int, page: int = PAGE) -> tuple[int, int]:
    """The page-aligned (start, length) covering [address, address + nbytes): what cudaHostRegister is given
    (it registers whole pages; a slot's mapping starts on a page, its data region need not end on one)."""
    if nbytes <= 0:
        return address - address % page, 0
    start = address - address % page
    end = -(-(address + nbytes) // page) * page
    return start, end - start


# cudaHostRegisterPortable: the registration is visible to every CUDA context, whichever device a rank uses.
_REGISTER_PORTABLE = 1


class HostRegistration:
    """A host memory range (a slot's mapping) registered with the CUDA host allocator, so device-to-host
    copies write into it directly at full speed (page-locked); unregistered by close() (before the mapping
    is unmapped: the driver holds the pages until then)."""

    def __init__(self, address: int, nbytes: int):
        self.start, self.length = page_span(address, nbytes)
        self._registered = False
        if self.length:
            _check(torch.cuda.cudart().cudaHostRegister(self.start, self.length, _REGISTER_PORTABLE))  # type: ignore[no-untyped-call]
            self._registered = True

    def covers(self, address: int, nbytes: int) -> bool:
        return self._registered and self.start <= address and address + nbytes <= self.start + self.length

    def close(self) -> None:
        if self._registered:
            self._registered = False
            _check(torch.cuda.cudart().cudaHostUnregister(self.start))  # type: ignore[no-untyped-call]

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check(status: object) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"CUDA host registration failed: {status}")


def direct_copies_enabled() -> bool:
    """On unless CASTOR_CUDA_DIRECT=0 (unset or empty: on)."""
    value = os.environ.get(DIRECT_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{DIRECT_ENV}={value!r}: expected 1 (direct device copies) or 0 (pinned staging)")
    return value != "0"


@dataclass(frozen=True)
class DirectPlan:
    """Which sources a save copies from the device straight into the slot (`direct`: indices), and which
    the background thread still copies from host memory (`host`)."""

    direct: tuple[int, ...]
    host: tuple[int, ...]


def plan_direct(
    on_device: Sequence[bool], contiguous: Sequence[bool], registered: Sequence[bool]
) -> DirectPlan:
    """A source goes straight to the slot when it is a contiguous device tensor whose slot bytes are
    registered; anything else (host tensors, strided device tensors, a slot not registered) is copied by
    the background thread as before (a strided device tensor through the pinned stager)."""
    direct = tuple(
        i
        for i, (device, flat, mapped) in enumerate(zip(on_device, contiguous, registered, strict=True))
        if device and flat and mapped
    )
    chosen = set(direct)
    return DirectPlan(direct, tuple(i for i in range(len(on_device)) if i not in chosen))


def plain_bytes(tensor: torch.Tensor) -> bool:
    """Whether a tensor's memory holds exactly its values, in order: contiguous, no lazy conj/neg bits."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


class SlotRegistrations:
    """Each slot mapping registered with the CUDA host allocator once (registering pins its pages), and
    again only when the store maps the slot anew (it grew); all unregistered by close(). Where the driver
    refuses (no CUDA host registration on this platform, memory locked beyond its limit), the reason is
    logged once and every later save stages through pinned memory."""

    def __init__(self) -> None:
        self._by_slot: dict[int, HostRegistration] = {}
        self.refused: str | None = None

    def ensure(self, slot: int, address: int, length: int) -> bool:
        current = self._by_slot.get(slot)
        if current is not None and (current.start, current.length) == page_span(address, length):
            return True
        if current is not None:
            del self._by_slot[slot]
            try:
                current.close()
            except RuntimeError as exc:  # the old mapping may be gone already: nothing left to unpin
                log.warning("castor: unregistering a slot's previous mapping: %s", exc)
        if self.refused is not None or not length:
            return False
        try:
            self._by_slot[slot] = HostRegistration(address, length)
        except RuntimeError as exc:
            self.refused = str(exc)
            log.warning("castor: device tensors are staged through pinned memory: %s", exc)
            return False
        return True

    def close(self) -> None:
        registrations, self._by_slot = list(self._by_slot.values()), {}
        for registration in registrations:
            registration.close()


class DirectCopies:
    """Device-to-host copies of a save straight into its slot: the registrations, the side streams, and
    the last save's (source, slot view) pairs per slot, reused while the layout, the slot's memory and the
    sources' addresses stay the same (views cost microseconds each; an FSDP2 rank saves ~600 tensors)."""

    def __init__(self) -> None:
        self.registrations = SlotRegistrations()
        self._streams = _SideStreams()
        self._pairs: dict[int, tuple[tuple[object, ...], list[tuple[torch.Tensor, torch.Tensor]]]] = {}

    def queue(
        self,
        slot: int,
        mapping: tuple[int, int],
        buffer: memoryview,
        regions: Sequence[tuple[int, int]],
        sources: Sequence[torch.Tensor],
        marks: Marks,
    ) -> tuple[frozenset[int], DeviceFence]:
        """Queue the copies of the device sources that can go straight into `buffer` (the slot's data
        region, within the slot's mapping `(address, length)`), each source `i` to bytes `regions[i]`
        (offset, nbytes). Returns which sources were queued (their bytes land in the slot) and the fence."""
        if not self.registrations.ensure(slot, *mapping):
            self._pairs.pop(slot, None)
            return frozenset(), DeviceFence()
        chosen = plan_direct(
            [source.is_cuda for source in sources],
            [plain_bytes(source) for source in sources],
            [True] * len(sources),
        ).direct
        # The cached views keep their sources alive: an address seen again is the same tensor's memory.
        key = (mapping, tuple(regions[i] for i in chosen), *(sources[i].data_ptr() for i in chosen))
        cached = self._pairs.get(slot)
        if cached is not None and cached[0] == key:
            pairs = cached[1]
        else:
            self._pairs.pop(slot, None)  # the old views go before the new ones are made
            slot_bytes = torch.frombuffer(buffer, dtype=torch.uint8) if buffer.nbytes else None
            pairs = []
            for i in chosen:
                offset, nbytes = regions[i]
                if nbytes and slot_bytes is not None:
                    source = sources[i].detach().reshape(-1).view(torch.uint8)
                    pairs.append((source, slot_bytes[offset : offset + nbytes]))
            self._pairs[slot] = (key, pairs)
        return frozenset(chosen), self._streams.copy(pairs, marks) if pairs else DeviceFence()

    def close(self) -> None:
        self._pairs.clear()  # their views of the slots, before the registrations and mappings go
        self.registrations.close()


def needs_host_wait(device_only: bool, host_pending: bool) -> bool:
    """Whether the optimizer step must block the host on the pending save: only while host-side sources
    are still being copied by the background thread. A save whose every mutable source went through the
    device (copies ordered by `DeviceFence.order_device`) lets the step run at once; hashing and commit go
    on in the background, reading only the slot."""
    return host_pending or not device_only
