"""Errors raised by worker_lib.

Every error derives from `CheckpointError`, so training code can catch the whole family at once.
"""

from __future__ import annotations

from collections.abc import Sequence

_GIB = 1 << 30


class CheckpointError(Exception):
    """Base class of every checkpoint error."""


class CheckpointNotFoundError(CheckpointError):
    """The requested checkpoint is not in the store."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's bytes do not match its checksums; no byte of a bad stripe was loaded, nor any optimizer.

    `tensors` names the tensors (key paths) whose bytes overlap a bad stripe, `ranges` the bad byte ranges.
    """

    def __init__(self, message: str, *, tensors: Sequence[str] = (), ranges: Sequence[tuple[int, int]] = ()):
        super().__init__(message)
        self.tensors = list(tensors)
        self.ranges = list(ranges)


class SlotsOnDiskWarning(UserWarning):
    """A checkpoint directory is on a filesystem backed by storage (ext4, xfs, NFS, ...), not memory."""

    def __init__(self, directory: str, filesystem: str, mount_point: str):
        self.directory = directory
        self.filesystem = filesystem
        self.mount_point = mount_point
        super().__init__(
            f"{directory} is on {filesystem} (mounted at {mount_point}), not in memory: the kernel writes "
            "every checkpoint saved there back to its storage, and that writeback competes with training "
            "for cores and memory bandwidth at every save. Put the checkpoints on /dev/shm "
            "or another tmpfs: Checkpointer() without a directory, or CASTOR_SHM_DIR."
        )

    def __reduce__(self) -> tuple[type[SlotsOnDiskWarning], tuple[str, str, str]]:
        return type(self), (self.directory, self.filesystem, self.mount_point)


class ShmCapacityError(CheckpointError):
    """The shared-memory filesystem is too small for the checkpoint slots."""

    def __init__(self, directory: str, needed: int, free: int, total: int):
        self.directory = directory
        self.needed = needed
        self.free = free
        self.total = total
        # Suggest a size that fits what is already there plus the slots, in whole GiB, with 1 GiB to spare.
        suggested_gib = -(-(total - free + needed) // _GIB) + 1
        super().__init__(
            f"{directory}: the checkpoint slots need {needed:,} more bytes ({needed / _GIB:.2f} GiB) "
            f"but only {free:,} bytes ({free / _GIB:.2f} GiB) are free on its filesystem. "
            f"Give shared memory at least {suggested_gib} GiB: "
            f"Docker `docker run --shm-size={suggested_gib}g`; "
            f"Kubernetes: mount an emptyDir volume with `medium: Memory` and `sizeLimit: {suggested_gib}Gi` "
            f"at /dev/shm; on a host: `mount -o remount,size={suggested_gib}G /dev/shm`. "
            "Or point CASTOR_SHM_DIR at a larger tmpfs."
        )

    def __reduce__(self) -> tuple[type[ShmCapacityError], tuple[str, int, int, int]]:
        # Rebuilt from its fields, not its message, when it crosses a process boundary.
        return type(self), (self.directory, self.needed, self.free, self.total)
