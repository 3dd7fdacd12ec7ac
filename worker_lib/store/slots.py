"""SlotStore: the checkpoint slots of one rank in a shared-memory directory.

Each slot k is `slot-<k>.bin` (the data region: preallocated with posix_fallocate, mapped once with
MAP_SHARED|MAP_POPULATE and reused) and `slot-<k>.json` (its manifest, present iff the slot holds a committed
checkpoint). A write takes an exclusive flock on `slot-<k>.bin`, unlinks the manifest first, writes the data,
then commits by renaming `slot-<k>.json.tmp` over `slot-<k>.json`. A process killed at any instant therefore
leaves either the old manifest with its untouched data, or no manifest, or the new manifest with every byte
written. Readers hold a shared flock on `slot-<k>.bin`, so nobody writes a slot that is being read.

A committed checkpoint found corrupt (a restore, a peer's fetch or a background check failed its checksums)
is condemned: `slot-<k>.corrupt` records its digest and the problem, so inventories report it as corrupt
and no recovery plan chooses it again. The record names the checkpoint it condemns, and the next write of
the slot removes it.

The same class serves the training process (write its checkpoints, read one back) and the worker agent
(stream the newest slot to peers, write a replica received from the network into its own store). A
SlotStore object is used by one thread at a time; separate objects and processes coordinate through the
file locks.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from worker_lib.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ShmCapacityError,
    SlotsOnDiskWarning,
)
from worker_lib.store.copy import default_threads
from worker_lib.store.faults import pause_point
from worker_lib.store.manifest import Manifest

OnBusy = Literal["skip", "wait"]

# A writer that finds every slot it may take held by readers touches this file; readers that can let go
# (a replication transfer, never a pin of the newest fully replicated checkpoint) do when it is fresh.
WANT_FILE = "want"
WANT_FRESH_S = 0.5

_READ_ATTEMPTS = 10
_EMPTY: NDArray[np.uint8] = np.empty(0, dtype=np.uint8)


def free_bytes(directory: Path) -> tuple[int, int]:
    """(free, total) bytes of the filesystem holding `directory`."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


# Filesystems whose files live in memory only. Slot files anywhere else (ext4, xfs, NFS, an overlay on disk)
# are pages of a file on storage: the kernel writes every save back to it, and its dirty-page tracking makes
# the first write to each page after a writeback take a fault.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_MOUNTINFO = Path("/proc/self/mountinfo")
_warned_mount_points: set[str] = set()  # one warning per filesystem and process, not one per store


def mounted_filesystem(path: Path, mountinfo: str) -> tuple[str, str] | None:
    """(mount point, filesystem type) of the mount that holds `path` (absolute, symlinks resolved), read
    from the text of /proc/self/mountinfo; None when no mount holds it."""
    held_by: tuple[str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if separator + 1 >= len(fields):
            continue
        # Spaces and other odd bytes in a mount point are octal escapes (\040).
        point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), fields[4])
        # A later line mounted at the same point hides the earlier ones.
        if path.is_relative_to(point) and (held_by is None or len(point) >= len(held_by[0])):
            held_by = (point, fields[separator + 1])
    return held_by


def storage_filesystem(directory: Path) -> tuple[str, str] | None:
    """(mount point, filesystem type) when `directory` is on a filesystem backed by storage, not memory;
    None when it is in memory, or when nothing says (not Linux)."""
    try:
        mountinfo = _MOUNTINFO.read_text()
    except OSError:
        return None
    held_by = mounted_filesystem(directory.resolve(), mountinfo)
    return None if held_by is None or held_by[1] in MEMORY_FILESYSTEMS else held_by


def warn_if_on_storage(directory: Path) -> None:
    """Warn (SlotsOnDiskWarning, once per filesystem) when `directory` is not on a memory filesystem."""
    held_by = storage_filesystem(directory)
    if held_by is None or held_by[0] in _warned_mount_points:
        return
    _warned_mount_points.add(held_by[0])
    warnings.warn(SlotsOnDiskWarning(str(directory), held_by[1], held_by[0]), stacklevel=3)


class _Slot:
    """One slot's paths, the descriptor that carries the writer's lock, and the shared mapping."""

    def __init__(self, directory: Path, index: int):
        self.index = index
        self.data_path = directory / f"slot-{index}.bin"
        self.manifest_path = directory / f"slot-{index}.json"
        self.condemned_path = directory / f"slot-{index}.corrupt"
        self.fd: int | None = None
        self.mapping: mmap.mmap | None = None
        self.array: NDArray[np.uint8] = _EMPTY
        # The last manifest read or written, keyed by the file's (inode, mtime, size): a save needs the
        # iterations of all slots and should not re-parse unchanged JSON every time.
        self.cached: tuple[tuple[int, int, int], Manifest] | None = None

    def open_fd(self) -> int:
        if self.fd is None:
            self.fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT, 0o600)
        return self.fd

    def size(self) -> int:
        if self.fd is None and not self.data_path.exists():
            return 0
        return os.fstat(self.open_fd()).st_size

    def map(self, size: int) -> None:
        """Map the first `size` bytes, populated up front so no copy ever takes a page fault.

        Populating is most of what mapping costs (about 75 ms of CPU per GiB of 4 KiB pages here: a fresh
        process restoring pays it before the first byte moves), so it is spread over every core rather than
        left to one kernel thread (MAP_POPULATE) or to faults during the copy."""
        old = self.mapping
        fd = self.open_fd()
        flags = mmap.MAP_SHARED
        if not _POPULATE_IN_THREADS:
            flags |= mmap.MAP_POPULATE
        self.mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(self.mapping, dtype=np.uint8)
        if old is not None:
            _close_mapping(old)
        if _POPULATE_IN_THREADS and size:
            _populate(self.array)

    def bytes(self, nbytes: int) -> NDArray[np.uint8]:
        """The first `nbytes` of the mapping, remapping when the file grew behind our back."""
        if nbytes == 0:
            return _EMPTY
        if self.array.size < nbytes:
            self.map(self.size())
        return self.array[:nbytes]

    def close(self) -> None:
        if self.mapping is not None:
            _close_mapping(self.mapping)
            self.mapping, self.array = None, _EMPTY
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# madvise(MADV_POPULATE_READ) (Linux 5.14): prefault a range of a mapping without changing it. On a shared
# writable tmpfs mapping the entries it installs are writable too (no dirty tracking), so a save's writes
# take no fault either; MADV_POPULATE_WRITE costs 2.4 times as much CPU here.
_MADV_POPULATE_READ = 22
_POPULATE_CHUNK = 64 << 20
_libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL: the threads populate in parallel
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_POPULATE_IN_THREADS = True  # cleared (MAP_POPULATE then) where the kernel does not know the advice


def _populate(array: NDArray[np.uint8]) -> None:
    global _POPULATE_IN_THREADS
    address, size = array.ctypes.data, array.size
    chunk = max(_POPULATE_CHUNK, -(-size // default_threads() // mmap.PAGESIZE) * mmap.PAGESIZE)
    ranges = [(lo, min(chunk, size - lo)) for lo in range(0, size, chunk)]
    failed: list[int] = []

    def populate(lo: int, length: int) -> None:
        if _libc.madvise(address + lo, length, _MADV_POPULATE_READ) != 0:
            failed.append(ctypes.get_errno())

    threads = [threading.Thread(target=populate, args=span, daemon=True) for span in ranges[1:]]
    for thread in threads:
        thread.start()
    populate(*ranges[0])
    for thread in threads:
        thread.join()
    if failed and set(failed) <= {errno.EINVAL}:
        # An older kernel: fault the pages in by reading one byte of each (MAP_POPULATE from now on).
        _POPULATE_IN_THREADS = False
        int(array[:: mmap.PAGESIZE].sum())
    elif failed:
        raise OSError(failed[0], f"populating a slot mapping: {os.strerror(failed[0])}")


def _close_mapping(mapping: mmap.mmap) -> None:
    # With views of it still alive (a reader's memoryview) it cannot close; it is unmapped when they are gone.
    with suppress(BufferError):
        mapping.close()


class SlotStore:
    def __init__(self, directory: str | os.PathLike[str], slots: int = 2, *, expect_memory: bool = True):
        """`slots`: at least this many; the store's owner may have made more (a worker agent creates the
        slot files of its local ranks before training starts, so a replication round can pin two of them
        while the training process still rotates over two others), and every slot present is used.
        `expect_memory`: warn (SlotsOnDiskWarning) when the directory is not on a memory filesystem; False
        for a store meant for storage (an export's scratch downloads)."""
        if slots < 2:
            raise ValueError(
                "a store needs at least 2 slots: one keeps the newest checkpoint while the next is written"
            )
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if expect_memory:
            warn_if_on_storage(self.directory)
        slots = max(slots, slot_files(self.directory))
        self._slots = [_Slot(self.directory, k) for k in range(slots)]
        self._want_path = self.directory / WANT_FILE
        self._wanting = False
        # The most data a checkpoint here may have (None: no bound). Set on stores whose sizes come from
        # someone else (a peer's replica): slots never grow beyond it.
        self.max_bytes: int | None = None
        # An iteration whose checkpoint a write keeps in place of the newest (see open_write): set on a
        # replica store by its holder, the job's aligned iteration (worker_lib.agent.replication).
        self.keep: int | None = None

    @property
    def slots(self) -> int:
        return len(self._slots)

    def mapping(self, index: int) -> tuple[int, int]:
        """The address and length of slot `index`'s shared mapping, (0, 0) before it is mapped: what a CUDA
        host registration of the slot pins (worker_lib.store.cuda.SlotRegistrations)."""
        array = self._slots[index].array
        return (int(array.__array_interface__["data"][0]), array.size) if array.size else (0, 0)

    def committed(self) -> list[Manifest]:
        """Manifests of the committed checkpoints, newest first."""
        return [manifest for _, manifest in self._committed()]

    @contextmanager
    def open_read(self, iteration: int | None = None) -> Iterator[tuple[Manifest, memoryview]]:
        """Hold the newest committed checkpoint (or exactly `iteration`) for reading.

        Gives its manifest and a read-only view of its data region, both stable while the context is open
        (a shared lock keeps writers out). Raises CheckpointNotFoundError when there is no such checkpoint.
        """
        for _ in range(_READ_ATTEMPTS):
            slot, chosen = self._choose(iteration)
            fd = os.open(slot.data_path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                # A writer may have taken the slot between our listing and the lock: read the manifest again.
                current = self._manifest(slot)
                if current != chosen:
                    continue
                yield current, slot.bytes(current.data_bytes).data.toreadonly()
                return
            finally:
                os.close(fd)  # releases the lock
        raise CheckpointError(f"{self.directory}: checkpoints kept changing while opening one for reading")

    def open_write(self, iteration: int, nbytes: int, on_busy: OnBusy = "skip") -> SlotWriter | None:
        """Take a slot for writing the checkpoint of `iteration` (`nbytes` of data).

        Never takes the slot holding the newest checkpoint older than `iteration`, nor the one holding the
        older checkpoint of iteration `self.keep`, which two slots keep in place of the newest; invalidates
        every checkpoint of `iteration` or later (a stale timeline after a rollback); prefers an empty slot,
        then the oldest. When every candidate is being read: returns None (`on_busy="skip"`) or waits
        ("wait"). Raises ShmCapacityError when the filesystem cannot hold the slots at the new size.
        """
        self._reserve(nbytes)
        older: dict[_Slot, int] = {}
        for slot in self._slots:
            try:
                manifest = self._manifest(slot)
            except CheckpointCorruptError:
                manifest = None  # an unreadable manifest is no checkpoint: the slot is free to overwrite
            if manifest is not None and manifest.iteration >= iteration:
                self._invalidate(slot)
            elif manifest is not None:
                older[slot] = manifest.iteration
        newest = max(older, key=older.__getitem__, default=None)
        kept = next((slot for slot, held in older.items() if held == self.keep), newest)
        protected = {newest, kept} if len(self._slots) > 2 else {kept}
        candidates = sorted(
            (slot for slot in self._slots if slot not in protected),
            key=lambda slot: (slot in older, older.get(slot, -1), slot.index),
        )
        chosen = self._lock_any(candidates, on_busy)
        if chosen is None:
            self._want()
            return None
        if self._wanting:
            self._wanting = False
            with suppress(FileNotFoundError):
                os.unlink(self._want_path)
        try:
            self._invalidate(chosen)
            pause_point("after-invalidate")
            return SlotWriter(chosen, iteration, chosen.bytes(nbytes).data)
        except BaseException:
            fcntl.flock(chosen.open_fd(), fcntl.LOCK_UN)
            raise

    def close(self) -> None:
        for slot in self._slots:
            slot.close()

    def writer_waiting(self, within_s: float = WANT_FRESH_S) -> bool:
        """Whether a writer found every slot it may take held by readers in the last `within_s` seconds: the
        training process needs a slot back, and a reader that can let go (a replication transfer) should."""
        try:
            return time.time() - os.stat(self._want_path).st_mtime < within_s
        except FileNotFoundError:
            return False

    def pin(self, iteration: int, digest: str | None = None) -> SlotPin | None:
        """Hold the committed checkpoint of `iteration` (with content `digest`, when given) with a shared
        lock until `SlotPin.release()`: no writer takes its slot meanwhile. None when it is not here."""
        for slot in self._slots:
            try:
                manifest = self._manifest(slot)
            except CheckpointCorruptError:
                continue
            if manifest is None or manifest.iteration != iteration:
                continue
            if digest is not None and manifest.digest != digest:
                continue
            fd = os.open(slot.data_path, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                if self._manifest(slot) == manifest:  # not replaced between the listing and the lock
                    return SlotPin(self, slot, manifest, fd)
            except (BlockingIOError, CheckpointCorruptError):
                pass
            os.close(fd)
            return None
        return None

    def condemn(self, manifest: Manifest, problem: str) -> bool:
        """Record that the committed checkpoint `manifest` failed its checksums (`problem` says how); False
        when no slot holds it any more (overwritten: nothing to record)."""
        record = json.dumps(
            {"iteration": manifest.iteration, "digest": manifest.digest, "problem": problem[:2000]}
        ).encode()
        for slot in self._slots:
            with suppress(CheckpointCorruptError):
                if self._manifest(slot) == manifest:
                    temporary = slot.condemned_path.with_name(f"{slot.condemned_path.name}.{os.getpid()}.tmp")
                    temporary.write_bytes(record)
                    os.replace(temporary, slot.condemned_path)
                    return True
        return False

    def condemned(self, manifest: Manifest) -> str | None:
        """Why the committed checkpoint `manifest` was condemned; None when it was not."""
        for slot in self._slots:
            try:
                record = json.loads(slot.condemned_path.read_bytes())
            except (FileNotFoundError, ValueError):
                continue
            if (
                isinstance(record, dict)
                and record.get("digest") == manifest.digest
                and record.get("iteration") == manifest.iteration
            ):
                return str(record.get("problem") or "failed its checksums")
        return None

    def _want(self) -> None:
        """Say (by the mtime of a marker file) that a writer is waiting for a slot readers hold."""
        self._wanting = True
        try:
            os.utime(self._want_path)
        except FileNotFoundError:
            with suppress(OSError):
                os.close(os.open(self._want_path, os.O_WRONLY | os.O_CREAT, 0o600))

    def _committed(self) -> list[tuple[_Slot, Manifest]]:
        found = [(slot, manifest) for slot in self._slots if (manifest := self._manifest(slot)) is not None]
        return sorted(found, key=lambda item: item[1].iteration, reverse=True)

    def _choose(self, iteration: int | None) -> tuple[_Slot, Manifest]:
        committed = self._committed()
        for slot, manifest in committed:
            if iteration is None or manifest.iteration == iteration:
                return slot, manifest
        have = ", ".join(str(manifest.iteration) for _, manifest in committed) or "none"
        wanted = "no checkpoint" if iteration is None else f"no checkpoint of iteration {iteration}"
        raise CheckpointNotFoundError(f"{self.directory}: {wanted} (committed iterations: {have})")

    def _manifest(self, slot: _Slot) -> Manifest | None:
        try:
            with open(slot.manifest_path, "rb") as file:
                stat = os.fstat(file.fileno())
                key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
                if slot.cached is not None and slot.cached[0] == key:
                    return slot.cached[1]
                data = file.read()
        except FileNotFoundError:
            return None
        try:
            manifest = Manifest.from_json(data)
        except ValueError as exc:
            raise CheckpointCorruptError(f"{slot.manifest_path}: {exc}") from exc
        slot.cached = (key, manifest)
        return manifest

    def _invalidate(self, slot: _Slot) -> None:
        for path in (slot.manifest_path, slot.condemned_path):
            with suppress(FileNotFoundError):
                os.unlink(path)

    def _lock_any(self, candidates: list[_Slot], on_busy: OnBusy) -> _Slot | None:
        for slot in candidates:
            try:
                fcntl.flock(slot.open_fd(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot
            except BlockingIOError:
                continue
        if on_busy == "skip":
            return None
        self._want()
        fcntl.flock(candidates[0].open_fd(), fcntl.LOCK_EX)
        return candidates[0]

    def _reserve(self, nbytes: int) -> None:
        """Size every slot for `nbytes` of data, checking first that the filesystem has room for all of them.

        Growing only allocates past the current end of a file, so it is safe while a slot is being read.
        """
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise CheckpointError(
                f"{self.directory}: a checkpoint of {nbytes} bytes exceeds this store's limit of "
                f"{self.max_bytes} bytes"
            )
        size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        short = [(slot, size - current) for slot in self._slots if (current := slot.size()) < size]
        if not short:
            return
        needed = sum(missing for _, missing in short)
        free, total = free_bytes(self.directory)
        if needed > free:
            raise ShmCapacityError(str(self.directory), needed, free, total)
        for slot, _ in short:
            try:
                os.posix_fallocate(slot.open_fd(), 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                free, total = free_bytes(self.directory)
                raise ShmCapacityError(str(self.directory), needed, free, total) from exc
            slot.map(size)


class SlotPin:
    """A committed checkpoint held with a shared lock (see SlotStore.pin) until released."""

    def __init__(self, store: SlotStore, slot: _Slot, manifest: Manifest, fd: int):
        self.store = store
        self.manifest = manifest
        self.slot = slot.index
        self._slot = slot
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def intact(self) -> bool:
        """Still the checkpoint pinned: a writer that rolled the store back (a checkpoint of this iteration
        or later of a new history) unlinks the manifest even of a held slot."""
        try:
            return self._fd is not None and self.store._manifest(self._slot) == self.manifest
        except CheckpointCorruptError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def slot_files(directory: Path) -> int:
    """How many consecutive slot files (slot-0.bin, slot-1.bin, ...) `directory` has."""
    count = 0
    while (directory / f"slot-{count}.bin").exists():
        count += 1
    return count


class SlotWriter:
    """A slot taken for writing: fill `buffer` (a writable memoryview of exactly the checkpoint's data
    bytes), then commit or abort."""

    def __init__(self, slot: _Slot, iteration: int, buffer: memoryview):
        self._slot = slot
        self.iteration = iteration
        self.buffer = buffer
        self._open = True

    @property
    def slot(self) -> int:
        return self._slot.index

    def commit(self, manifest: Manifest) -> None:
        """Make the checkpoint visible, atomically: write the manifest aside, then rename it into place."""
        if (manifest.iteration, manifest.data_bytes) != (self.iteration, self.buffer.nbytes):
            raise ValueError(
                f"manifest of iteration {manifest.iteration} with {manifest.data_bytes} bytes does not match "
                f"the slot opened for iteration {self.iteration} with {self.buffer.nbytes} bytes"
            )
        self._check_open()
        path = self._slot.manifest_path
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(manifest.to_json())
        pause_point("before-rename")
        os.rename(temporary, path)
        pause_point("after-rename")
        stat = os.stat(path)
        self._slot.cached = ((stat.st_ino, stat.st_mtime_ns, stat.st_size), manifest)
        self._release()

    def abort(self) -> None:
        """Give the slot up without committing; it stays empty."""
        self._check_open()
        self._release()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"slot {self.slot} was already committed or aborted")

    def _release(self) -> None:
        self._open = False
        self.buffer = _EMPTY.data
        fcntl.flock(self._slot.open_fd(), fcntl.LOCK_UN)
