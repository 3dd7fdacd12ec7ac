"""The GPU path's fences (worker_lib/store/cuda.py): the pure planning logic runs everywhere; the device
copies into registered shared memory and the device-side fence need a GPU and skip without one."""

from __future__ import annotations

import mmap

import pytest
import torch

from worker_lib.store.cuda import PAGE, DirectPlan, needs_host_wait, page_span, plan_direct

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


def test_the_step_blocks_the_host_only_for_host_copies() -> None:
    assert not needs_host_wait(device_only=True, host_pending=False)
    assert needs_host_wait(device_only=True, host_pending=True)
    assert needs_host_wait(device_only=False, host_pending=False)


@gpu
def test_device_copies_land_in_registered_shared_memory_and_the_step_waits_on_the_device() -> None:
    from worker_lib.store.cuda import DirectStager, HostRegistration

    nbytes = 8 << 20
    region = mmap.mmap(-1, nbytes)  # shared memory, as a slot's mapping
    host = torch.frombuffer(region, dtype=torch.float32)
    source = torch.randn(nbytes // 4, device="cuda")
    expected = source.cpu()
    with HostRegistration(host.data_ptr(), nbytes) as registration:
        assert registration.covers(host.data_ptr(), nbytes)
        fence = DirectStager().copy([(source, host)])
        fence.order_device()  # the optimizer step's stream waits for the copy on the device
        source.mul_(0)  # queued after the copy: it must not change what lands in the slot
        fence.landed()
        assert torch.equal(host, expected)
    del host
    region.close()
