"""Verification of a checkpoint's bytes against its manifest, before anything is loaded from it."""

from __future__ import annotations

import numpy as np

from worker_lib.errors import CheckpointCorruptError
from worker_lib.store.copy import CopyEngine
from worker_lib.store.manifest import Manifest, content_digest

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


def verify(manifest: Manifest, data: memoryview | np.ndarray, engine: CopyEngine) -> None:
    """Check every stripe checksum of `data` (the slot's data region); raise CheckpointCorruptError naming
    the tensors whose bytes overlap a bad stripe."""
    what = f"checkpoint of iteration {manifest.iteration}"
    region = np.frombuffer(data, dtype=np.uint8)
    if region.size < manifest.data_bytes:
        raise CheckpointCorruptError(
            f"{what}: {region.size} data bytes, the manifest says {manifest.data_bytes}"
        )
    check_structure(manifest)

    actual = engine.hash(region, [(s.start, s.end) for s in manifest.stripes])
    bad = [(s.start, s.end) for s, digest in zip(manifest.stripes, actual, strict=True) if digest != s.digest]
    if not bad:
        return
    names = [
        entry.key
        for entry in manifest.tensors
        if entry.nbytes
        and any(entry.offset < end and start < entry.offset + entry.nbytes for start, end in bad)
    ]
    listed = ", ".join(names[:_NAMED]) + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")
    raise CheckpointCorruptError(
        f"{what} is corrupt: {len(bad)} of {len(manifest.stripes)} stripes do not match their "
        f"{manifest.checksum} checksum (bytes {bad[0][0]}..{bad[0][1]}"
        f"{' and more' if len(bad) > 1 else ''}); affected tensors: {listed or 'none (alignment padding)'}",
        tensors=names,
        ranges=bad,
    )
