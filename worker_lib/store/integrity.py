"""Verification of a checkpoint's bytes against its manifest, before anything is loaded from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from worker_lib.errors import CheckpointCorruptError
from worker_lib.store.manifest import Manifest, content_digest

if TYPE_CHECKING:
    # Only a type here: copy imports torch, and the root service reaches this module (through the
    # persistent tier) without torch (tests/unit/test_import_boundary.py).
    from worker_lib.store.copy import CopyEngine

_NAMED = 10  # tensors named in an error message; the exception carries them all


def check_structure(manifest: Manifest) -> None:
    """The manifest is self-consistent: its stripes cover the data region exactly, in order, and its
    content digest is the digest of their checksums. Checked before trusting any of its checksums."""
    what = f"checkpoint of iteration {manifest.iteration}"
    covered = 0
    for stripe in manifest.stripes:
        if stripe.start != covered or stripe.end < stripe.start:
            break
        covered = stripe.end
    if covered != manifest.data_bytes:
        raise CheckpointCorruptError(f"{what}: its stripes do not cover the data region")
    if content_digest(s.digest for s in manifest.stripes) != manifest.digest:
        raise CheckpointCorruptError(f"{what}: the manifest's digest does not match its stripe checksums")


def check_region(manifest: Manifest, data_size: int) -> None:
    """Before reading a checkpoint's bytes: the data region is as large as the manifest says, the manifest is
    self-consistent, and every tensor lies inside the region. Raises CheckpointCorruptError."""
    what = f"checkpoint of iteration {manifest.iteration}"
    if data_size < manifest.data_bytes:
        raise CheckpointCorruptError(
            f"{what}: {data_size} data bytes, the manifest says {manifest.data_bytes}"
        )
    check_structure(manifest)
    for entry in manifest.tensors:
        if entry.offset < 0 or entry.nbytes < 0 or entry.offset + entry.nbytes > manifest.data_bytes:
            raise CheckpointCorruptError(f"{what}: {entry.key} lies outside the data region")


def verify(manifest: Manifest, data: memoryview | np.ndarray, engine: CopyEngine) -> None:
    """Check every stripe checksum of `data` (the slot's data region); raise CheckpointCorruptError naming
    the tensors whose bytes overlap a bad stripe."""
    region = np.frombuffer(data, dtype=np.uint8)
    check_region(manifest, region.size)
    actual = engine.hash(region, [(s.start, s.end) for s in manifest.stripes])
    expected = [stripe.digest for stripe in manifest.stripes]
    bad = [k for k, (want, got) in enumerate(zip(expected, actual, strict=True)) if want != got]
    if bad:
        raise corrupt_error(manifest, bad)


def corrupt_error(manifest: Manifest, bad: list[int], *, copied: bool = False) -> CheckpointCorruptError:
    """The error for the stripes `bad` (indices) of `manifest` that did not match their checksums, naming
    the tensors whose bytes overlap them. `copied`: verified stripes were already copied out (a restore
    checks and copies stripe by stripe), which the message says."""
    what = f"checkpoint of iteration {manifest.iteration}"
    ranges = [(manifest.stripes[k].start, manifest.stripes[k].end) for k in bad]
    names = [
        entry.key
        for entry in manifest.tensors
        if entry.nbytes
        and any(entry.offset < end and start < entry.offset + entry.nbytes for start, end in ranges)
    ]
    listed = ", ".join(names[:_NAMED]) + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")
    note = (
        "; no byte of a bad stripe was copied, but targets filled from stripes verified before it hold "
        "this checkpoint's bytes: restore another checkpoint into them or reinitialise them"
        if copied
        else ""
    )
    return CheckpointCorruptError(
        f"{what} is corrupt: {len(bad)} of {len(manifest.stripes)} stripes do not match their "
        f"{manifest.checksum} checksum (bytes {ranges[0][0]}..{ranges[0][1]}"
        f"{' and more' if len(bad) > 1 else ''}); affected tensors: {listed or 'none (alignment padding)'}"
        f"{note}",
        tensors=names,
        ranges=ranges,
    )
