"""CASTOR_YIELD_CORES=1: while a background save copies beside CPU training, torch's intra-op threads give up
the cores the copy uses (worker_lib.intra_op), and take them back at the first module call after the copy
ends, at the end of the outermost forward, or at the optimizer step, whichever comes first.

The machine is made to look like 2 cores with torch on 2 threads (the benchmark's host), whatever this one
has; the copy is held by the `gate` fixture where a test needs it still running. Every assertion is about
thread counts at points in the training loop, never about time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from tests.unit.worker_lib.helpers import REGRESSION_TIMEOUT_S, Gate, assert_bit_equal
from worker_lib import Checkpointer, intra_op
from worker_lib.intra_op import CoreShare, share_cores
from worker_lib.store.copy import CopyEngine


@pytest.mark.parametrize(
    ("torch_threads", "cores", "copy_threads", "expected"),
    [
        (2, 2, 2, CoreShare(torch_threads=1, copy_threads=1)),  # the benchmark's host
        (16, 16, 16, CoreShare(torch_threads=12, copy_threads=4)),  # a quarter of the cores at most
        (8, 8, 1, CoreShare(torch_threads=7, copy_threads=1)),
        (1, 2, 2, None),  # torch has no thread to give
        (2, 4, 4, None),  # torch's threads and the copy's fit on the cores already
        (4, 2, 2, CoreShare(torch_threads=1, copy_threads=1)),  # more threads than cores
    ],
)
def test_the_cores_are_shared_only_where_torch_and_the_copy_do_not_fit(
    torch_threads: int, cores: int, copy_threads: int, expected: CoreShare | None
) -> None:
    assert share_cores(torch_threads, cores, copy_threads) == expected


class Recording(nn.Module):
    """Two layers; each forward records the intra-op thread count its inner layer ran with."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.inner_threads: list[int] = []
        self.second.register_forward_pre_hook(lambda *_: self.inner_threads.append(torch.get_num_threads()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Torch on 2 threads, 2 cores available, yielding on; the thread count is put back afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(intra_op, "available_cores", lambda: 2)
    monkeypatch.setenv("CASTOR_YIELD_CORES", "1")
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def forward_pre_hooks() -> int:
    return len(module_hooks._global_forward_pre_hooks) + len(module_hooks._global_forward_hooks)


def test_a_forward_beside_the_copy_runs_on_the_cores_left_and_gets_them_back_at_its_end(
    shm_dir: Path, gate: Gate, two_cores: None
) -> None:
    torch.manual_seed(0)
    model = Recording()
    saved = {key: value.clone() for key, value in model.state_dict().items()}
    hooks = forward_pre_hooks()
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        assert gate.entered.wait(REGRESSION_TIMEOUT_S)
        assert torch.get_num_threads() == 1  # one core for the copy
        model(torch.randn(4, 8))
        assert model.inner_threads == [1]  # the copy is still held: the forward ran on 1 thread
        assert checkpointer._pending is not None and not checkpointer._pending.done()
        # The forward is over: backward gets every thread, and the hooks are gone.
        assert torch.get_num_threads() == 2
        assert forward_pre_hooks() == hooks
        gate.release.set()
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(restored.state["model"], saved)


def test_the_threads_come_back_at_the_first_module_call_after_the_copy_ends(
    shm_dir: Path, two_cores: None
) -> None:
    model = Recording()
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        assert torch.get_num_threads() == 1
        pending = checkpointer._pending
        assert pending is not None
        pending.result(REGRESSION_TIMEOUT_S)  # the copy is over; nothing in training has noticed yet
        assert torch.get_num_threads() == 1
        model(torch.randn(4, 8))
        assert model.inner_threads == [2]


def test_the_optimizer_step_gives_the_threads_back_and_a_count_set_meanwhile_stays(
    shm_dir: Path, two_cores: None
) -> None:
    model = Recording()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        assert torch.get_num_threads() == 1
        optimizer.step()
        assert torch.get_num_threads() == 2

        checkpointer.save(2, {"model": model, "optimizer": optimizer})
        assert torch.get_num_threads() == 1
        torch.set_num_threads(3)  # the user's own setting, while the copy runs
        optimizer.step()
        assert torch.get_num_threads() == 3


def test_the_copy_runs_on_the_cores_given_up_for_it(
    shm_dir: Path, two_cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers: list[int | None] = []
    copy = CopyEngine.copy

    def recorded(engine: CopyEngine, *args: Any, **kwargs: Any) -> Any:
        workers.append(kwargs.get("workers"))
        return copy(engine, *args, **kwargs)

    monkeypatch.setattr(CopyEngine, "copy", recorded)
    model = Recording()
    with Checkpointer(shm_dir, threads=2) as checkpointer:
        checkpointer.save(1, {"model": model})
        checkpointer.wait()
    monkeypatch.setenv("CASTOR_YIELD_CORES", "0")
    with Checkpointer(shm_dir, threads=2) as checkpointer:
        checkpointer.save(2, {"model": model})
        assert torch.get_num_threads() == 2
        checkpointer.wait()
    assert workers == [1, None]  # 1 thread beside torch's other one; all of the engine's when not yielding


def test_yielding_is_off_by_default_and_a_blocking_save_never_yields(
    shm_dir: Path, two_cores: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Recording()
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(1, {"model": model})
        assert torch.get_num_threads() == 2
    monkeypatch.delenv("CASTOR_YIELD_CORES")
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(2, {"model": model})
        assert torch.get_num_threads() == 2


def test_a_bad_setting_is_refused_with_its_name(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASTOR_YIELD_CORES", "yes")
    with pytest.raises(ValueError, match="CASTOR_YIELD_CORES='yes'"):
        Checkpointer(shm_dir)
