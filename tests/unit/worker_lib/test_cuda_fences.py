"""The GPU path's fences (worker_lib/store/cuda.py): the pure planning logic runs everywhere; the device
copies into registered shared memory and the device-side fence need a GPU and skip without one."""

from __future__ import annotations

import mmap

import pytest
import torch

from worker_lib.store.cuda import PAGE, DirectPlan, needs_host_wait, page_span, plain_bytes, plan_direct

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_page_span_covers_whole_pages() -> None:
    assert page_span(0, PAGE) == (0, PAGE)
    assert page_span(PAGE + 10, 5) == (PAGE, PAGE)
    assert page_span(PAGE - 1, 2) == (0, 2 * PAGE)
    assert page_span(3 * PAGE, 0) == (3 * PAGE, 0)
    start, length = page_span(12345, 999_999, page=4096)
    assert start % 4096 == 0 and length % 4096 == 0
    assert start <= 12345 and 12345 + 999_999 <= start + length < 12345 + 999_999 + 2 * 4096


def test_only_contiguous_device_sources_in_registered_memory_go_direct() -> None:
    plan = plan_direct(
        on_device=[True, True, False, True],
        contiguous=[True, False, True, True],
        registered=[True, True, True, False],
    )
    assert plan == DirectPlan(direct=(0,), host=(1, 2, 3))
    assert plan_direct([], [], []) == DirectPlan((), ())


def test_direct_copies_are_the_default_0_turns_them_off_and_a_bad_switch_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker_lib.store.cuda import direct_copies_enabled

    monkeypatch.delenv("CASTOR_CUDA_DIRECT", raising=False)
    assert direct_copies_enabled()
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "0")
    assert not direct_copies_enabled()
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "1")
    assert direct_copies_enabled()
    monkeypatch.setenv("CASTOR_CUDA_DIRECT", "yes")
    with pytest.raises(ValueError, match="CASTOR_CUDA_DIRECT='yes'"):
        direct_copies_enabled()


def test_only_plain_bytes_can_be_copied_as_they_are() -> None:
    assert plain_bytes(torch.randn(3, 4))
    assert not plain_bytes(torch.randn(3, 4).t())
    assert not plain_bytes(torch.randn(3, dtype=torch.complex64).conj())
    assert not plain_bytes(torch._neg_view(torch.randn(3)))


def test_the_step_blocks_the_host_only_for_host_copies() -> None:
    assert not needs_host_wait(device_only=True, host_pending=False)
    assert needs_host_wait(device_only=True, host_pending=True)
    assert needs_host_wait(device_only=False, host_pending=False)


@gpu
def test_device_copies_land_in_registered_shared_memory_and_the_step_waits_on_the_device() -> None:
    from worker_lib.store.cuda import DirectCopies, mark_devices

    nbytes = 8 << 20
    region = mmap.mmap(-1, nbytes + PAGE)  # shared memory, as a slot's mapping
    mapping = torch.frombuffer(region, dtype=torch.uint8)
    source = torch.randn(nbytes // 4, device="cuda")
    strided = torch.randn(64, 64, device="cuda").t()  # not plain bytes: left to the pinned stager
    expected = source.cpu()
    copies = DirectCopies()
    buffer = memoryview(region)[PAGE:]  # the data region starts inside the mapping
    marks = mark_devices([source, strided])  # what save() does: the copies run after this point
    landed, fence = copies.queue(
        0, (mapping.data_ptr(), nbytes + PAGE), buffer, [(0, nbytes), (nbytes, 0)], [source, strided], marks
    )
    assert landed == frozenset({0}) and fence
    fence.order_device()  # the optimizer step's stream waits for the copy on the device
    source.mul_(0)  # queued after the copy: it must not change what lands in the slot
    fence.landed()
    assert torch.equal(mapping[PAGE:].view(torch.float32), expected)
    copies.close()
    del buffer, mapping
    region.close()
