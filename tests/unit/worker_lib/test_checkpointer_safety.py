"""Checkpointer safety: async copies finish before state changes, integrity, capacity, slot policy, agent
hooks (directory, notification, recovery plan)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _global_forward_pre_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _global_optimizer_pre_hooks

from tests.unit.worker_lib.helpers import assert_bit_equal, forkserver
from worker_lib import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointNotFoundError,
    ShmCapacityError,
)
from worker_lib.checkpointer import default_directory
from worker_lib.store import copy as copy_module
from worker_lib.store import slots as slots_module
from worker_lib.store.slots import SlotStore


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every background copy take a while, so that a race with it would be lost for sure."""
    copy = copy_module.FlatTransfer.copy

    def slow_copy(self: copy_module.FlatTransfer, lo: int, hi: int) -> None:
        threading.Event().wait(0.05)
        copy(self, lo, hi)

    monkeypatch.setattr(copy_module.FlatTransfer, "copy", slow_copy)


def test_an_optimizer_step_right_after_save_waits_for_the_copy(shm_dir: Path, slow_copies: None) -> None:
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.ones(4, 64)).sum().backward()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        optimizer.step()  # changes every parameter in place
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(restored.state["model"], before)
    assert not torch.equal(model.weight, before["weight"])


def test_a_save_from_another_thread_waits_for_the_copy_an_optimizer_step_is_waiting_for(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dcp.async_save calls save() from DCP's thread. Before, while the training thread's optimizer step
    waited for the previous copy, that save found nothing pending and took the slot the copy was still
    writing (its manifest invalidated: the preferred one), so two writes shared it."""
    release = threading.Event()  # the first save's copy is held until the test lets it go
    copy = copy_module.FlatTransfer.copy

    def held_copy(self: copy_module.FlatTransfer, lo: int, hi: int) -> None:
        assert release.wait(30)
        copy(self, lo, hi)

    monkeypatch.setattr(copy_module.FlatTransfer, "copy", held_copy)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.ones(4, 64)).sum().backward()
    staged = {"model": {key: value.clone() for key, value in model.state_dict().items()}}  # DCP's copy
    with Checkpointer(shm_dir) as checkpointer:
        writing = threading.Event()  # set while a background write runs
        overlapped: list[bool] = []
        write, open_write = checkpointer._write, checkpointer._store.open_write

        def tracked_write(*args: Any) -> None:
            writing.set()
            try:
                write(*args)
            finally:
                writing.clear()

        def tracked_open_write(*args: Any, **kwargs: Any) -> Any:
            overlapped.append(writing.is_set())
            return open_write(*args, **kwargs)

        checkpointer._write = tracked_write  # type: ignore[method-assign]
        checkpointer._store.open_write = tracked_open_write  # type: ignore[method-assign]
        checkpointer.save(1, {"model": model})
        assert writing.wait(10)
        step = threading.Thread(target=optimizer.step)  # the training thread, waiting for the copy
        step.start()
        deadline = time.monotonic() + 10
        while checkpointer._pending is not None and time.monotonic() < deadline:
            time.sleep(0.001)  # until the step's wait has taken the pending save
        assert checkpointer._pending is None
        dcp_thread = threading.Thread(target=checkpointer.save, args=(2, staged))
        dcp_thread.start()
        deadline = time.monotonic() + 1  # without the fix it takes a slot at once; with it, it waits
        while len(overlapped) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()
        step.join(30)
        dcp_thread.join(30)
        checkpointer.wait()
        restored = checkpointer.restore(iteration=2)
    assert overlapped == [False, False]
    assert restored is not None
    assert_bit_equal(restored.state["model"], staged["model"])


def test_a_forward_that_updates_buffers_after_save_leaves_the_saved_values(
    shm_dir: Path, slow_copies: None
) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        model(torch.randn(16, 8))  # training mode: updates the running statistics in place
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(restored.state["model"], before)
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])


def test_a_scheduler_step_after_save_leaves_the_saved_tensor_learning_rate(
    shm_dir: Path, slow_copies: None
) -> None:
    """A tensor `lr` (compiled and capturable optimizers) is set in place by the scheduler, outside the
    optimizer step that waits for the copy: save() snapshots it (before, the copy read the new value)."""
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    model(torch.ones(4, 64)).sum().backward()
    optimizer.step()
    with Checkpointer(shm_dir) as checkpointer:
        for iteration in (1, 2):  # the second save reuses the first one's side copies
            saved = optimizer.param_groups[0]["lr"].clone()
            checkpointer.save(iteration, {"optimizer": optimizer})
            scheduler.step()  # lr.fill_(lr * 0.5) while the copy runs
            checkpointer.wait()
            restored = checkpointer.restore()
            assert restored is not None
            assert torch.equal(restored.state["optimizer"]["param_groups"][0]["lr"], saved)
            assert not torch.equal(optimizer.param_groups[0]["lr"], saved)


def test_distributed_data_parallel_buffer_sync_after_save_leaves_the_saved_values(
    shm_dir: Path, slow_copies: None, tmp_path: Path
) -> None:
    """DDP overwrites the buffers with rank 0's before the forward (broadcast_buffers): the checkpoint
    still holds the values of save() time, whether the inner module or the wrapper was saved."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        ddp = DistributedDataParallel(model)
        sync = ddp._sync_buffers

        def changing_sync() -> None:
            sync()
            with torch.no_grad():
                model[1].running_mean.add_(1.0)  # what a broadcast of other values does in place

        ddp._sync_buffers = changing_sync  # type: ignore[method-assign]
        for saved in (model, ddp):
            before = {key: value.clone() for key, value in saved.state_dict().items()}
            with Checkpointer(shm_dir) as checkpointer:
                checkpointer.save(1, {"model": saved})
                ddp(torch.randn(16, 8))
                restored = checkpointer.restore()
            assert restored is not None
            assert_bit_equal(restored.state["model"], before)
    finally:
        dist.destroy_process_group()


def test_close_removes_the_hooks(shm_dir: Path) -> None:
    hooks = _global_optimizer_pre_hooks
    count = len(hooks)
    model = nn.BatchNorm1d(4)
    module_hooks = _global_forward_pre_hooks
    module_count = len(module_hooks)
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        # Only the optimizer step waits for the copy; buffers are captured inside save().
        assert len(hooks) == count + 1 and not model._forward_pre_hooks
        assert len(module_hooks) == module_count
    assert len(hooks) == count and not model._forward_pre_hooks
    assert len(module_hooks) == module_count


def test_a_failed_background_save_is_reported_by_wait(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: copy_module.FlatTransfer, lo: int, hi: int) -> None:
        raise OSError("simulated failure")

    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"x": torch.ones(8)})
        checkpointer.wait()
        monkeypatch.setattr(copy_module.FlatTransfer, "copy", broken)
        checkpointer.save(2, {"x": torch.zeros(8)})
        with pytest.raises(CheckpointError, match="simulated failure"):
            checkpointer.wait()
        monkeypatch.undo()
        restored = checkpointer.restore()
    assert restored is not None and restored.iteration == 1


def corrupt_one_byte(directory: Path, iteration: int, key: str, at: int) -> None:
    """Flip a bit inside tensor `key` of the committed checkpoint `iteration`, in shared memory."""
    for manifest_path in directory.glob("slot-*.json"):
        manifest = json.loads(manifest_path.read_bytes())
        if manifest["iteration"] == iteration:
            (entry,) = [t for t in manifest["tensors"] if t["key"] == key]
            with open(manifest_path.with_suffix(".bin"), "r+b") as data:
                data.seek(entry["offset"] + at)
                byte = data.read(1)[0]
                data.seek(entry["offset"] + at)
                data.write(bytes([byte ^ 0x10]))
            return
    raise AssertionError(f"no committed iteration {iteration}")


def test_a_corrupt_byte_is_detected_named_and_never_loaded(shm_dir: Path) -> None:
    # 16 MiB of embedding fill eight stripes on their own: the damaged stripe holds only the head.
    state = {"embedding": torch.randn(4096, 1024), "head": torch.randn(64, 10), "step": 3}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(2, {"embedding": torch.zeros(4096, 1024), "head": torch.zeros(64, 10), "step": 2})
        checkpointer.save(3, state)
        checkpointer.wait()
        corrupt_one_byte(shm_dir, 3, "state['head']", at=100)
        targets = {"embedding": torch.full((4096, 1024), 7.0), "head": torch.full((64, 10), 7.0)}
        expected = (
            r"iteration 3 is corrupt: 1 of 9 stripes .* affected tensors: state\['head'\]; "
            r"no byte of a bad stripe was copied"
        )
        with pytest.raises(CheckpointCorruptError, match=expected) as caught:
            checkpointer.restore(into=targets)
        assert caught.value.tensors == ["state['head']"]
        # Not one byte of the bad stripe reached its target. The embedding's stripes were checked and
        # copied stripe by stripe: each holds either the target's old values or verified saved bytes.
        assert torch.equal(targets["head"], torch.full((64, 10), 7.0))
        for half in (slice(i, i + 512) for i in range(0, 4096, 512)):
            got = targets["embedding"][half]
            assert torch.equal(got, torch.full_like(got, 7.0)) or torch.equal(got, state["embedding"][half])
        # The older, intact checkpoint is not silently used instead.
        with pytest.raises(CheckpointCorruptError):
            checkpointer.restore()
        older = checkpointer.restore(iteration=2)  # the control plane may choose it explicitly
    assert older is not None and older.iteration == 2
    # The failed restore condemned the copy where it lies: the machine's next inventory reports it
    # corrupt (so no plan chooses it again).
    store = SlotStore(shm_dir)
    corrupt, intact = store.committed()
    assert corrupt.iteration == 3 and "state['head']" in (store.condemned(corrupt) or "")
    assert store.condemned(intact) is None
    store.close()


def test_once_a_stripe_is_found_corrupt_nothing_more_is_copied(shm_dir: Path) -> None:
    # One copy thread takes the stripes in order: the first is bad, so the three good ones after it are
    # checked (the error names every bad stripe) but never copied, and the optimizer is not loaded.
    weights = torch.nn.Parameter(torch.randn(1 << 20))  # 4 MiB: two stripes, and two of momentum
    optimizer = torch.optim.SGD([weights], lr=0.1, momentum=0.9)
    weights.grad = torch.ones_like(weights)
    optimizer.step()
    with Checkpointer(shm_dir, threads=1) as checkpointer:
        checkpointer.save(1, {"weights": weights, "optimizer": optimizer})
        checkpointer.wait()
        corrupt_one_byte(shm_dir, 1, "state['weights']", at=5)
        target = torch.full((1 << 20,), 7.0)
        fresh_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1 << 20))], lr=0.1, momentum=0.9)
        with pytest.raises(CheckpointCorruptError, match=r"1 of 4 stripes") as caught:
            checkpointer.restore(into={"weights": target, "optimizer": fresh_optimizer})
    assert caught.value.ranges == [(0, 2 << 20)]
    assert torch.equal(target, torch.full((1 << 20,), 7.0))
    assert fresh_optimizer.state_dict()["state"] == {}


def test_a_too_small_shared_memory_fails_the_first_save_with_advice(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slots_module, "free_bytes", lambda directory: (10 << 20, 64 << 20))
    with Checkpointer(shm_dir) as checkpointer:  # async by default: the check still happens in save()
        expected = r"need 16,777,216 more bytes .* only 10,485,760"
        with pytest.raises(ShmCapacityError, match=expected) as caught:
            checkpointer.save(1, {"weights": torch.zeros(2 << 20)})  # 8 MiB, two slots
        assert "--shm-size=" in str(caught.value) and "CASTOR_SHM_DIR" in str(caught.value)
        assert checkpointer.restore() is None


def test_unsupported_values_fail_save_and_commit_nothing(shm_dir: Path) -> None:
    with Checkpointer(shm_dir) as checkpointer:
        expected = r"^state\['optimizer'\]\['state'\]\[3\]\['foo'\]: unsupported type object$"
        with pytest.raises(TypeError, match=expected):
            checkpointer.save(1, {"optimizer": {"state": {3: {"foo": object()}}}})
        assert checkpointer.restore() is None


def test_a_structure_change_keeps_a_complete_checkpoint_at_every_instant(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []

    def check_while_writing(phase: str) -> None:
        # The writer has just invalidated its target slot: the previous checkpoint must still be complete.
        if phase == "after-invalidate" and SlotStore(shm_dir).committed():
            with Checkpointer(shm_dir, blocking=True) as reader:
                restored = reader.restore()
            assert restored is not None
            assert_bit_equal(restored.state, states[restored.iteration])
            seen.append(restored.iteration)

    monkeypatch.setattr(slots_module, "pause_point", check_while_writing)
    states = {
        1: {"a": torch.randn(10)},
        2: {"a": torch.randn(10), "b": torch.randn(5000)},  # a new key, more bytes: the slots grow
        3: {"a": torch.randn(20, 2)},  # a new shape
        4: {"a": torch.randn(20, 2)},
        5: {"c": [torch.randn(3)] * 2},  # aliasing
    }
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        for iteration, state in states.items():
            checkpointer.save(iteration, state)
        restored = checkpointer.restore()
    assert seen == [1, 2, 3, 4]
    assert restored is not None
    assert_bit_equal(restored.state, states[5])


def test_training_after_a_rollback_replaces_the_stale_timeline(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(shm_dir, slots=3, blocking=True) as checkpointer:
        for iteration in range(1, 5):
            checkpointer.save(iteration, {"x": torch.full((4,), float(iteration))})
        monkeypatch.setenv("CASTOR_RESTORE_ITERATION", "2")  # the recovery plan for all ranks
        restored = checkpointer.restore()
        assert restored is not None and restored.iteration == 2
        monkeypatch.delenv("CASTOR_RESTORE_ITERATION")
        checkpointer.save(3, {"x": torch.full((4,), -3.0)})
        assert [m.iteration for m in SlotStore(shm_dir).committed()] == [3, 2]  # 4 is gone
        newest = checkpointer.restore()
    assert newest is not None and torch.equal(newest.state["x"], torch.full((4,), -3.0))


def test_the_recovery_plan_decides_which_iteration_to_restore(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(1, {"i": 1})
        checkpointer.save(2, {"i": 2})
        monkeypatch.setenv("CASTOR_RESTORE_ITERATION", "1")
        assert (restored := checkpointer.restore()) is not None and restored.state == {"i": 1}
        assert (restored := checkpointer.restore(iteration=2)) is not None and restored.iteration == 2
        monkeypatch.setenv("CASTOR_RESTORE_ITERATION", "none")
        assert checkpointer.restore() is None
        monkeypatch.setenv("CASTOR_RESTORE_ITERATION", "5")
        expected = r"no checkpoint of iteration 5 \(committed iterations: 2, 1\)"
        with pytest.raises(CheckpointNotFoundError, match=expected):
            checkpointer.restore()
        monkeypatch.setenv("CASTOR_RESTORE_ITERATION", "latest")
        with pytest.raises(ValueError, match="expected an iteration number or 'none'"):
            checkpointer.restore()


def hold_newest_for_reading(directory: str, held: threading.Event, release: threading.Event) -> None:
    """Child process: the agent streaming the older slot to a peer."""
    store = SlotStore(directory)
    with store.open_read(store.committed()[-1].iteration):
        held.set()
        release.wait(60)


def test_a_save_is_skipped_while_the_agent_reads_the_slot_it_needs(shm_dir: Path) -> None:
    context = forkserver()
    held, release = context.Event(), context.Event()
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(1, {"x": torch.ones(4)})
        checkpointer.save(2, {"x": torch.ones(4)})
        reader = context.Process(target=hold_newest_for_reading, args=(str(shm_dir), held, release))
        reader.start()
        try:
            assert held.wait(60)
            assert checkpointer.save(3, {"x": torch.ones(4)}) is False
            assert checkpointer.stats.saves_skipped == 1 and checkpointer.stats.saves_committed == 2
        finally:
            release.set()
            reader.join(60)
        assert checkpointer.save(4, {"x": torch.ones(4)}) is True
        assert [m.iteration for m in SlotStore(shm_dir).committed()] == [4, 2]


def test_an_async_save_waits_in_the_background_for_a_reader_to_let_go(shm_dir: Path) -> None:
    """The agent streams the older slot; the save lands as soon as it lets go, without blocking save()."""
    context = forkserver()
    held, release = context.Event(), context.Event()
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"x": torch.full((4,), 1.0)})
        checkpointer.save(2, {"x": torch.full((4,), 2.0)})
        checkpointer.wait()
        reader = context.Process(target=hold_newest_for_reading, args=(str(shm_dir), held, release))
        reader.start()
        try:
            assert held.wait(60)
            assert checkpointer.save(3, {"x": torch.full((4,), 3.0)}) is True
            threading.Timer(0.2, release.set).start()
            checkpointer.wait()  # an explicit wait() waits for the slot, then for the copy
        finally:
            release.set()
            reader.join(60)
        assert (checkpointer.stats.saves_committed, checkpointer.stats.saves_skipped) == (3, 0)
        restored = checkpointer.restore()
    assert restored is not None and restored.iteration == 3
    assert torch.equal(restored.state["x"], torch.full((4,), 3.0))


def test_an_async_save_is_skipped_when_the_optimizer_step_comes_first(shm_dir: Path) -> None:
    """Training never waits for a reader: the next optimizer step gives the busy save up."""
    context = forkserver()
    held, release = context.Event(), context.Event()
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model})
        checkpointer.save(2, {"model": model})
        checkpointer.wait()
        reader = context.Process(target=hold_newest_for_reading, args=(str(shm_dir), held, release))
        reader.start()
        try:
            assert held.wait(60)
            checkpointer.save(3, {"model": model})
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()  # the reader still holds the slot: save 3 is skipped, the step goes ahead
            assert checkpointer.stats.saves_skipped == 1
        finally:
            release.set()
            reader.join(60)
        assert [m.iteration for m in SlotStore(shm_dir).committed()] == [2, 1]
        checkpointer.save(4, {"model": model})
        checkpointer.wait()
        assert [m.iteration for m in SlotStore(shm_dir).committed()] == [4, 2]


@pytest.fixture
def agent_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, Path]]:
    path = tmp_path / "agent.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    receiver.settimeout(10)
    yield receiver, path
    receiver.close()


def test_each_commit_notifies_the_agent(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, agent_socket: tuple[socket.socket, Path]
) -> None:
    receiver, path = agent_socket
    monkeypatch.setenv("CASTOR_AGENT_NOTIFY", str(path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(7, {"x": torch.ones(2)})
        message = json.loads(receiver.recv(65536))
        restored = checkpointer.restore()
    stall = {key: message.pop(key) for key in ("pid", "stalled_s", "save_calls")}  # test_checkpoint_stall
    assert message == {"event": "commit", "rank": 3, "iteration": 7, "slot": 0, "dir": str(shm_dir)}
    assert stall["pid"] == os.getpid()
    assert json.loads((shm_dir / "slot-0.json").read_bytes())["iteration"] == 7
    assert restored is not None and restored.meta == {"rank": 3, "world_size": 8}


def _notices(receiver: socket.socket) -> list[dict[str, object]]:
    received = []
    receiver.setblocking(False)
    try:
        while True:
            received.append(json.loads(receiver.recv(65536)))
    except BlockingIOError:
        return received


@pytest.mark.parametrize(
    ("ending", "finished"),
    [(None, True), (SystemExit(0), True), (SystemExit(3), False), (RuntimeError("nan loss"), False)],
)
def test_only_a_clean_end_of_training_tells_the_agent_this_rank_finished(
    shm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    agent_socket: tuple[socket.socket, Path],
    ending: BaseException | None,
    finished: bool,
) -> None:
    receiver, path = agent_socket
    monkeypatch.setenv("CASTOR_AGENT_NOTIFY", str(path))
    monkeypatch.setenv("RANK", "2")
    try:
        with Checkpointer(shm_dir) as checkpointer:
            checkpointer.save(4, {"x": torch.ones(2)})
            if ending is not None:
                raise ending
    except BaseException as raised:
        assert raised is ending
    events = [(m["event"], m["rank"], m["iteration"]) for m in _notices(receiver)]
    assert events == [("commit", 2, 4)] + ([("finished", 2, 4)] if finished else [])


def test_saving_goes_on_when_the_agent_is_not_listening(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CASTOR_AGENT_NOTIFY", str(tmp_path / "nobody-here.sock"))
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        assert checkpointer.save(1, {"x": torch.ones(2)})
        assert checkpointer.stats.saves_committed == 1


def test_the_directory_comes_from_the_agent_or_the_job_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_directory() == Path(f"/dev/shm/castor-{os.getuid()}/default/rank-0")
    monkeypatch.setenv("CASTOR_JOB", "gpt")
    monkeypatch.setenv("RANK", "5")
    assert default_directory() == Path(f"/dev/shm/castor-{os.getuid()}/gpt/rank-5")
    monkeypatch.setenv("CASTOR_SHM_DIR", "/dev/shm/agent-chosen")
    assert default_directory() == Path("/dev/shm/agent-chosen")


def test_stats_count_saves_and_bytes(shm_dir: Path) -> None:
    with Checkpointer(shm_dir) as checkpointer:
        for iteration in range(3):
            checkpointer.save(iteration, {"x": torch.zeros(1000)})
        checkpointer.wait()
        stats = checkpointer.stats
    assert (stats.saves_committed, stats.saves_skipped) == (3, 0)
    assert stats.last_bytes == 4032 and stats.total_bytes == 3 * 4032  # 4000 bytes, 64-byte aligned
    assert stats.last_copy_s > 0 and stats.last_save_s > 0


def test_a_closed_checkpointer_refuses_work(shm_dir: Path) -> None:
    checkpointer = Checkpointer(shm_dir)
    checkpointer.close()
    checkpointer.close()
    with pytest.raises(CheckpointError, match="closed"):
        checkpointer.save(1, {})
