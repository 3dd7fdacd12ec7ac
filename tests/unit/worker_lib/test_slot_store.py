"""SlotStore: slot choice, atomic commit, readers and writers across processes, capacity, integrity."""

from __future__ import annotations

import itertools
import json
import os
import threading
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.unit.worker_lib.helpers import forkserver, write_raw
from worker_lib.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ShmCapacityError,
    SlotsOnDiskWarning,
)
from worker_lib.store import slots as slots_module
from worker_lib.store.copy import CopyEngine, Extent, plan_checked, plan_stripes
from worker_lib.store.integrity import verify
from worker_lib.store.manifest import Manifest, Stripe, TensorEntry, TensorView, content_digest
from worker_lib.store.slots import SlotStore


def committed_iterations(store: SlotStore) -> list[int]:
    return [manifest.iteration for manifest in store.committed()]


def slot_iterations(directory: Path) -> dict[int, int]:
    """slot index -> committed iteration, read straight from the files."""
    found = {}
    for path in directory.glob("slot-*.json"):
        found[int(path.stem.split("-")[1])] = json.loads(path.read_bytes())["iteration"]
    return found


def test_a_new_checkpoint_never_overwrites_the_newest_one(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir, slots=3)
    for iteration in range(1, 8):
        write_raw(store, iteration, bytes([iteration]) * 100, engine)
        assert committed_iterations(store) == list(range(iteration, max(iteration - 3, 0), -1))


def test_the_writer_prefers_an_empty_slot_then_the_oldest(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir, slots=3)
    for iteration in (1, 2, 3):
        write_raw(store, iteration, b"x" * 10, engine)
    os.unlink(shm_dir / f"slot-{next(k for k, it in slot_iterations(shm_dir).items() if it == 2)}.json")
    emptied = set(range(3)) - set(slot_iterations(shm_dir))
    write_raw(store, 4, b"y" * 10, engine)
    assert slot_iterations(shm_dir)[emptied.pop()] == 4
    write_raw(store, 5, b"z" * 10, engine)
    assert sorted(slot_iterations(shm_dir).values()) == [3, 4, 5]  # 1 was the oldest


def test_an_earlier_iteration_invalidates_the_stale_timeline(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir, slots=3)
    for iteration in (10, 11, 12):
        write_raw(store, iteration, b"old" * 10, engine)
    # The recovery plan rolled every rank back to 10: training continues with a new iteration 11.
    write_raw(store, 11, b"new" * 10, engine)
    assert committed_iterations(store) == [11, 10]
    with store.open_read() as (_, data):
        assert bytes(data) == b"new" * 10


def test_a_slot_is_visible_only_once_committed(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir)
    write_raw(store, 1, b"a" * 64, engine)
    writer = store.open_write(2, 64)
    assert writer is not None
    assert committed_iterations(store) == [1]
    writer.buffer[:] = b"\x07" * 64
    writer.abort()
    assert committed_iterations(store) == [1]
    assert not (shm_dir / f"slot-{writer.slot}.json").exists()
    with pytest.raises(RuntimeError, match="already committed or aborted"):
        writer.abort()


def test_commit_checks_the_manifest_against_the_slot(shm_dir: Path) -> None:
    store = SlotStore(shm_dir)
    writer = store.open_write(3, 16)
    assert writer is not None
    with pytest.raises(ValueError, match="does not match"):
        writer.commit(Manifest(iteration=4, data_bytes=16, tensors=(), stripes=(), digest=""))
    writer.abort()


def test_open_read_gives_a_read_only_view_of_the_chosen_checkpoint(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir)
    write_raw(store, 1, b"one" * 5, engine)
    write_raw(store, 2, b"two" * 5, engine)
    with store.open_read() as (manifest, data):
        assert (manifest.iteration, bytes(data)) == (2, b"two" * 5)
        with pytest.raises(TypeError):
            data[0] = 0
    with store.open_read(1) as (manifest, data):
        assert bytes(data) == b"one" * 5
    with (
        pytest.raises(CheckpointNotFoundError, match=r"iteration 7 \(committed iterations: 2, 1\)"),
        store.open_read(7),
    ):
        pass


def test_an_empty_store_has_nothing_to_read(shm_dir: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"), SlotStore(shm_dir).open_read():
        pass


def test_another_process_sees_commits_and_reads_them(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir)
    write_raw(store, 5, b"five" * 4, engine)
    other = SlotStore(shm_dir)  # a second store object on the same files: what the agent holds
    assert committed_iterations(other) == [5]
    write_raw(store, 6, b"six!" * 4, engine)
    with other.open_read() as (manifest, data):
        assert (manifest.iteration, bytes(data)) == (6, b"six!" * 4)


def test_a_manifest_round_trips_through_json() -> None:
    manifest = Manifest(
        iteration=3,
        data_bytes=128,
        tensors=(
            TensorEntry("state['w']", "bfloat16", (2, 3), 0, 12),
            TensorEntry("state['v']", "float32", (2,), 64, 64, TensorView(1, (4,)), "cuda"),
        ),
        stripes=(Stripe(0, 64, "00000000000000aa"), Stripe(64, 128, "00000000000000bb")),
        digest=content_digest_of("00000000000000aa", "00000000000000bb"),
        tree={"dict": [["w", {"tensor": 0}], ["v", {"tensor": 1}]]},
        meta={"rank": 2},
        committed_at=1700000000.25,
    )
    assert Manifest.from_json(manifest.to_json()) == manifest


def content_digest_of(*digests: str) -> str:
    return content_digest(digests)


def test_an_unreadable_manifest_is_reported_to_readers_and_overwritten_by_writers(
    shm_dir: Path, engine: CopyEngine
) -> None:
    store = SlotStore(shm_dir)
    write_raw(store, 1, b"a" * 8, engine)
    (shm_dir / "slot-1.json").write_text('{"format": 99}')
    with pytest.raises(CheckpointCorruptError, match=r"slot-1\.json"):
        store.committed()
    write_raw(store, 2, b"b" * 8, engine)  # takes slot 1, the only one not holding iteration 1
    assert committed_iterations(store) == [2, 1]


def test_verify_names_the_tensors_of_a_bad_stripe(shm_dir: Path, engine: CopyEngine) -> None:
    data = np.arange(4096, dtype=np.uint8)
    stripes = plan_stripes([Extent(0, 4096, 1, 4096)], 4096, stripe_bytes=1024)
    digests = engine.hash(data, [(s.start, s.end) for s in stripes])
    manifest = Manifest(
        iteration=1,
        data_bytes=4096,
        tensors=(
            TensorEntry("state['a']", "uint8", (2048,), 0, 2048),
            TensorEntry("state['b']", "uint8", (2048,), 2048, 2048),
        ),
        stripes=tuple(Stripe(s.start, s.end, d) for s, d in zip(stripes, digests, strict=True)),
        digest=content_digest_of(*digests),
    )
    verify(manifest, data, engine)
    data[3000] ^= 1
    with pytest.raises(CheckpointCorruptError, match=r"affected tensors: state\['b'\]$") as caught:
        verify(manifest, data, engine)
    assert caught.value.tensors == ["state['b']"]
    assert caught.value.ranges == [(2048, 3072)]


def test_a_restore_plan_copies_only_out_of_checked_stripes() -> None:
    stripes = [(0, 100), (100, 200), (200, 300), (300, 400)]
    extents = [
        Extent(0, 150, 1, 150),  # flat: cut at the stripe boundary
        Extent(150, 90, 30, 240),  # rows of 30 bytes: the row 180..210 straddles 200
        Extent(250, 150, 1, 400),
    ]
    groups = plan_checked(extents, stripes, piece_bytes=64)
    assert [(g.first, g.last) for g in groups] == [(0, 1), (1, 3), (3, 4)]
    for group in groups:
        lo, hi = stripes[group.first][0], stripes[group.last - 1][1]
        for piece in group.pieces:
            assert lo <= piece.at and piece.at + piece.hi - piece.lo <= hi  # never outside its stripes
            assert piece.lo % extents[piece.transfer].row_bytes == 0
    covered = sorted((p.transfer, p.lo, p.hi) for g in groups for p in g.pieces)
    for index, extent in enumerate(extents):  # every byte of every extent exactly once
        spans = [(lo, hi) for t, lo, hi in covered if t == index]
        assert spans[0][0] == 0 and spans[-1][1] == extent.nbytes
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_the_capacity_check_covers_every_slot_before_allocating(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slots_module, "free_bytes", lambda directory: (3 << 20, 64 << 30))
    store = SlotStore(shm_dir)
    with pytest.raises(ShmCapacityError) as caught:
        store.open_write(1, 2 << 20)  # two slots of 2 MiB do not fit in 3 MiB
    message = str(caught.value)
    assert f"need {4 << 20:,} more bytes" in message and f"only {3 << 20:,} bytes" in message
    assert "--shm-size=" in message and "sizeLimit" in message and "remount,size=" in message
    assert (caught.value.needed, caught.value.free) == (4 << 20, 3 << 20)
    assert all(path.stat().st_size == 0 for path in shm_dir.glob("slot-*.bin"))  # nothing allocated
    writer = store.open_write(1, 1 << 20)  # two slots of 1 MiB do
    assert writer is not None and writer.buffer.nbytes == 1 << 20 and not writer.buffer.readonly
    writer.abort()


def test_slots_grow_when_a_checkpoint_needs_more(shm_dir: Path, engine: CopyEngine) -> None:
    store = SlotStore(shm_dir)
    write_raw(store, 1, b"s" * 100, engine)
    write_raw(store, 2, b"L" * 100_000, engine)
    assert all(path.stat().st_size >= 100_000 for path in shm_dir.glob("slot-*.bin"))
    with store.open_read(1) as (_, data):
        assert bytes(data) == b"s" * 100  # growing kept the older checkpoint's bytes


def test_at_least_two_slots() -> None:
    with pytest.raises(ValueError, match="at least 2 slots"):
        SlotStore("/dev/shm/never-created", slots=1)


def hold_for_reading(directory: str, iteration: int, held: threading.Event, release: threading.Event) -> None:
    """Child process: keep a checkpoint open for reading (as the agent does while streaming it)."""
    with SlotStore(directory).open_read(iteration):
        held.set()
        release.wait(60)


@pytest.mark.parametrize("on_busy", ["skip", "wait"])
def test_a_slot_being_read_by_another_process_is_not_written(
    shm_dir: Path, engine: CopyEngine, on_busy: str
) -> None:
    store = SlotStore(shm_dir)
    write_raw(store, 1, b"1" * 32, engine)
    write_raw(store, 2, b"2" * 32, engine)
    context = forkserver()
    held, release = context.Event(), context.Event()
    reader = context.Process(target=hold_for_reading, args=(str(shm_dir), 1, held, release))
    reader.start()
    try:
        assert held.wait(60)
        if on_busy == "skip":
            assert store.open_write(3, 32, on_busy="skip") is None
            assert committed_iterations(store) == [2, 1]
        else:
            opened: list[object] = []
            writer = threading.Thread(target=lambda: opened.append(store.open_write(3, 32, on_busy="wait")))
            writer.start()
            writer.join(0.5)
            assert writer.is_alive() and not opened  # still waiting for the reader
            release.set()
            writer.join(60)
            assert opened and opened[0] is not None
            assert committed_iterations(store) == [2]  # the reader's slot is now being written
            opened[0].abort()  # type: ignore[attr-defined]
    finally:
        release.set()
        reader.join(60)
    assert reader.exitcode == 0


def test_mapping_gives_the_slots_shared_memory_and_changes_when_the_slot_grows(shm_dir: Path) -> None:
    """What a CUDA host registration of a slot pins (worker_lib.store.cuda.SlotRegistrations): the slot's
    whole mapping, which a writer's buffer lies in, and a new one once the slot is mapped anew."""
    import mmap

    store = SlotStore(shm_dir)
    assert store.mapping(0) == (0, 0)
    writer = store.open_write(1, 10_000)
    assert writer is not None
    address, length = store.mapping(writer.slot)
    buffer_address = np.frombuffer(writer.buffer, dtype=np.uint8).__array_interface__["data"][0]
    assert address == buffer_address and length >= 10_000 and length % mmap.PAGESIZE == 0
    writer.abort()
    grown = store.open_write(2, 10 * length)
    assert grown is not None
    assert store.mapping(grown.slot)[1] >= 10 * length
    grown.abort()
    store.close()


def test_a_condemned_checkpoint_stays_condemned_until_its_slot_is_written(
    shm_dir: Path, engine: CopyEngine
) -> None:
    store = SlotStore(shm_dir, slots=3)
    first, second = (write_raw(store, it, bytes([it]) * 100, engine) for it in (1, 2))
    assert store.condemn(second, "stripe 0: checksum mismatch")
    assert store.condemned(second) == "stripe 0: checksum mismatch"
    assert store.condemned(first) is None
    # Another process (the agent) reads the record; the same iteration with other bytes is not condemned.
    other = SlotStore(shm_dir, slots=3)
    assert other.condemned(second) == "stripe 0: checksum mismatch"
    assert other.condemned(replace(second, digest="another history")) is None
    # Rolled back to 1: writing iteration 2 again reuses the condemned slot and drops its record.
    third = write_raw(store, 2, b"\x07" * 100, engine)
    assert store.condemned(third) is None and not list(shm_dir.glob("slot-*.corrupt"))
    # A checkpoint no slot holds any more cannot be condemned.
    assert not store.condemn(second, "gone")
    store.close()
    other.close()


MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw
31 22 0:27 / /mnt/fast\\040scratch rw master:7 - tmpfs scratch rw,size=8g
32 22 0:28 / /mnt/fast\\040scratch/nfs rw - nfs4 server:/export rw
40 22 0:30 / /data rw - xfs /dev/sdb rw
41 40 0:31 / /data rw - tmpfs over rw
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/home/me/ckpt", ("/", "ext4")),
        ("/dev/shm/castor-0/job/rank-0", ("/dev/shm", "tmpfs")),
        ("/dev/shmx", ("/", "ext4")),  # a sibling whose name starts like a mount point is not inside it
        ("/mnt/fast scratch/ckpt", ("/mnt/fast scratch", "tmpfs")),  # \040 is a space
        ("/mnt/fast scratch/nfs/ckpt", ("/mnt/fast scratch/nfs", "nfs4")),  # the innermost mount
        ("/data/ckpt", ("/data", "tmpfs")),  # the later mount at the same point hides the earlier one
    ],
)
def test_the_filesystem_holding_a_directory_is_read_from_mountinfo(
    path: str, expected: tuple[str, str]
) -> None:
    assert slots_module.mounted_filesystem(Path(path), MOUNTINFO) == expected


def test_dev_shm_counts_as_memory_here() -> None:
    if not Path("/dev/shm").is_dir() or not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /dev/shm or /proc here")
    held_by = slots_module.mounted_filesystem(
        Path("/dev/shm").resolve(), Path("/proc/self/mountinfo").read_text()
    )
    assert held_by is not None and held_by[1] in slots_module.MEMORY_FILESYSTEMS


def test_a_store_on_storage_warns_once_per_filesystem_and_a_store_in_memory_never(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory, disk = tmp_path / "memory", tmp_path / "disk"
    memory.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n25 22 0:21 / {memory.resolve()} rw - tmpfs tmpfs rw\n"
    )
    monkeypatch.setattr(slots_module, "_MOUNTINFO", mountinfo)
    monkeypatch.setattr(slots_module, "_warned_mount_points", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SlotStore(memory / "rank-0")
        assert caught == []
        SlotStore(disk / "rank-0")
        SlotStore(disk / "rank-1")  # the same filesystem: said once
    assert [type(w.message) for w in caught] == [SlotsOnDiskWarning]
    warning = caught[0].message
    assert isinstance(warning, SlotsOnDiskWarning)
    assert (warning.directory, warning.filesystem, warning.mount_point) == (str(disk / "rank-0"), "ext4", "/")
    assert (
        str(disk / "rank-0") in str(warning)
        and "/dev/shm" in str(warning)
        and "CASTOR_SHM_DIR" in str(warning)
    )
    with warnings.catch_warnings(record=True) as scratch:
        warnings.simplefilter("always")
        monkeypatch.setattr(slots_module, "_warned_mount_points", set())
        SlotStore(disk / "export-scratch", expect_memory=False)  # storage meant: no warning
    assert scratch == []
    # Only a warning: the store on storage works (a fresh process would say so again).
    with pytest.warns(SlotsOnDiskWarning):
        store = SlotStore(disk / "rank-0")
    write_raw(store, 1, b"kept" * 100, CopyEngine(1))
    assert committed_iterations(store) == [1]
