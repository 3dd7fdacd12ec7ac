"""CUDA tensors, through pinned host memory. The only module that touches CUDA; tested only with a GPU.

Saving: device-to-host copies into one reusable pinned buffer, issued without blocking on a side stream that
first waits for the work already queued on the tensor's current stream, so they capture the values the
training step has computed when save() is called. The copy engine reads the staged bytes once the events
have fired; the next save reuses the buffer only after that (save waits for the previous copy).
"""

from __future__ import annotations

from collections.abc import Sequence

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
