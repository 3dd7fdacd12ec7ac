"""CUDA tensors, through pinned host memory. The only module that touches CUDA; tested only with a GPU.

Saving: device-to-host copies into one reusable pinned buffer, issued without blocking on a side stream that
first waits for the work already queued on the tensor's current stream, so they capture the values the
training step has computed when save() is called. The copy engine reads the staged bytes once the events
have fired; the next save reuses the buffer only after that (save waits for the previous copy).

The GPU path's fences (issue 12 item 4), building blocks not yet wired into Checkpointer.save:

- `HostRegistration` registers a slot's shared-memory mapping with the CUDA host allocator
  (cudaHostRegister), so that device-to-host copies land straight in the slot (`DirectStager`): host memory
  then holds no third copy of the state (the pinned staging buffer), and the background thread only hashes.
- `DeviceFence` is what the optimizer step waits on once every device copy is queued: the step's stream
  waits for the copies' events on the device (`current_stream().wait_event`), and the host is not blocked.
  The host still waits for host-side sources (`needs_host_wait`), which are small on a GPU job (AdamW's
  `step` counters) and can be snapshotted in save() like the buffers.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ALIGN = 64


class PinnedStager:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, sources: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.cuda.Event]]:
        """Host copies of the device tensors among `sources` (others pass through) and the events that mark
        when the copies have landed."""
        on_device = [source for source in sources if source.is_cuda]
        if not on_device:
            return list(sources), []
        buffer = self._reserve(sum(_aligned_nbytes(source) for source in on_device))
        streams: dict[torch.device, torch.cuda.Stream] = {}
        staged: list[torch.Tensor] = []
        offset = 0
        for source in sources:
            if not source.is_cuda:
                staged.append(source)
                continue
            nbytes = source.numel() * source.element_size()
            host = buffer[offset : offset + nbytes].view(source.dtype).view(source.shape)
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = self._stream_after_current(source.device)
            with torch.cuda.stream(stream):
                host.copy_(source, non_blocking=True)
            # The caching allocator must not hand the source's memory out again before the copy has run.
            source.record_stream(stream)
            staged.append(host)
            offset += _aligned_nbytes(source)
        return staged, [stream.record_event() for stream in streams.values()]

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the smaller buffer before pinning the larger one
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._buffer

    def _stream_after_current(self, device: torch.device) -> torch.cuda.Stream:
        """The device's side stream, ordered after everything queued so far on its current stream."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream


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


class DirectStager:
    """Device-to-host copies into registered slot memory, queued on a side stream per device after the work
    already queued on the source's current stream (the values save() was called with)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DeviceFence:
        """Queue `destination.copy_(source)` for each (device source, slot view) pair, without blocking the
        host; the fence says when they have run."""
        events: dict[torch.device, torch.cuda.Event] = {}
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for source, destination in pairs:
            stream = streams.get(source.device)
            if stream is None:
                stream = streams[source.device] = self._stream_after_current(source.device)
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            source.record_stream(stream)
        for device, stream in streams.items():
            events[device] = stream.record_event()
        return DeviceFence(events)

    def _stream_after_current(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream


class DeviceFence:
    """The events of a save's device-to-host copies, one per device."""

    def __init__(self, events: dict[torch.device, torch.cuda.Event]):
        self.events = events

    def order_device(self) -> None:
        """The optimizer step's fence: its stream (the current one) waits on the device for the copies
        that read the parameters it is about to change; the host goes on at once."""
        for device, event in self.events.items():
            torch.cuda.current_stream(device).wait_event(event)

    def landed(self) -> None:
        """Block the host until the copies are in the slot: the background thread, before hashing it."""
        for event in self.events.values():
            event.synchronize()


def needs_host_wait(device_only: bool, host_pending: bool) -> bool:
    """Whether the optimizer step must block the host on the pending save: only while host-side sources
    are still being copied by the background thread. A save whose every mutable source went through the
    device (copies ordered by `DeviceFence.order_device`) lets the step run at once; hashing and commit go
    on in the background, reading only the slot."""
    return host_pending or not device_only
