"""The striped copy engine: copies tensor bytes to or from a slot on every core, checksumming as it goes.

A plan cuts the data region into stripes (~2 MiB: the unit of checksumming, and of work handed to a thread,
one queue across all tensors so small tensors never serialise) and each stripe into pieces (<= 256 KiB).
A save copies a piece and hashes it from the slot right away, while it is still in the core's L2 cache; a
restore hashes a stripe of the slot (reading it from memory into cache), compares it with the manifest,
and only then copies it out, from cache: either way the checksum reads cached bytes, not memory, so it
costs a few per cent of the copy instead of a second pass. numpy's copyto, torch's copy_ and xxh3 all
release the GIL, so the threads run in parallel. Plans are built once per layout and reused: a
steady-state save allocates nothing large.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xxhash
from numpy.typing import NDArray

from worker_lib.store.faults import pause_point

# 2 MiB: a restore hashes a stripe before copying it out, so a stripe per copy thread must stay in cache
# between the two (1 GiB restored in 81 ms here with 2 MiB stripes, 89 ms with 8 MiB; saves the same).
STRIPE_BYTES = 2 << 20
# A piece and its source fit in L2 (512 KiB per core here: lscpu's 1 MiB is over 2 instances; 1-2 MiB on
# current server cores), so the hash that follows the copy reads cache; fewer, larger pieces would only save
# Python calls (about a microsecond each, a few thousand per GiB). Smaller ones were no better here: 64 and
# 128 KiB pieces cost as much CPU per save as 256 KiB (docs/store.md, "Sharded states").
PIECE_BYTES = 256 << 10
# True: a save hashes a stripe's contiguous sources first, then copies them from cache. One thread alone
# gains from it (13.4 GB/s per stripe against 12.0 for a plain memmove), but with every core copying, the
# hash's reads from memory compete with the copies' and it lost here: 1 GiB saved in 86 ms against 74 ms
# copying each 256 KiB piece, then hashing it from the slot while it is in L2 (the default).
HASH_SOURCES_FIRST = False
# One rank's copy rarely gains beyond this many threads: memory bandwidth, not cores, is then the limit.
MAX_THREADS = 16
# A precompiled copy of at most this many bytes (compile_save, compile_checked) is a memoryview slice
# assignment, a memcpy under the GIL (0.1 us of Python per call here) instead of np.copyto (0.6 us), which
# releases the GIL: a few microseconds of memcpy hold other threads up no longer than the call itself. Most
# of an FSDP2 decoder's 600 shards per rank are norms and biases of a few kB.
SMALL_COPY_BYTES = 32 << 10
# A save hashes the bytes it copied after at most this many bytes of small pieces, rather than after each:
# fewer Python calls, and the bytes are still in L2.
HASH_BATCH_BYTES = 64 << 10

Bytes = NDArray[np.uint8]

_ZEROS = bytes(64)  # alignment padding: fewer than 64 bytes after a tensor
_ZEROS_VIEW = memoryview(_ZEROS)

# Same-size integer dtypes: copying through them moves bits without any dtype-specific kernel (some dtypes,
# like int4, have none) and without casting.
_BIT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def default_threads() -> int:
    """Every core this process may run on (its affinity mask, which launchers narrow per rank), up to
    MAX_THREADS: a single thread copies at a fraction of what the memory system moves."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_THREADS))


class Transfer(Protocol):
    def copy(self, lo: int, hi: int) -> None:
        """Copy bytes [lo, hi) of the tensor (a multiple of its row size for row transfers)."""


@dataclass(frozen=True, slots=True)
class FlatTransfer:
    """Contiguous bytes on both sides: numpy copyto, the fastest copy available from Python."""

    src: Bytes
    dst: Bytes

    def copy(self, lo: int, hi: int) -> None:
        np.copyto(self.dst[lo:hi], self.src[lo:hi])


@dataclass(frozen=True, slots=True)
class RowTransfer:
    """A strided tensor on one side: torch copy_ of whole rows (slices along dim 0)."""

    src: torch.Tensor
    dst: torch.Tensor
    row_bytes: int

    def copy(self, lo: int, hi: int) -> None:
        if self.dst.dim() == 0:
            self.dst.copy_(self.src)
        else:
            self.dst[lo // self.row_bytes : hi // self.row_bytes].copy_(
                self.src[lo // self.row_bytes : hi // self.row_bytes]
            )


def row_transfer(src: torch.Tensor, dst: torch.Tensor) -> RowTransfer:
    """A row transfer between two tensors of one shape; a bit copy when they share a dtype."""
    bit_dtype = _BIT_DTYPES.get(src.dtype.itemsize)
    if src.dtype == dst.dtype and bit_dtype is not None and not has_lazy_bits(src) and not has_lazy_bits(dst):
        src, dst = src.view(bit_dtype), dst.view(bit_dtype)
    return RowTransfer(src, dst, row_bytes(dst.shape, dst.element_size()))


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one slice along dim 0 (of the whole tensor when 0-dim): the unit of a row transfer."""
    numel = 1
    for size in shape[1:]:
        numel *= size
    return max(numel * itemsize, 1)


def has_lazy_bits(tensor: torch.Tensor) -> bool:
    # A conjugate or negative view's raw bits differ from its values: only copy_ resolves them.
    return tensor.is_conj() or tensor.is_neg()


def flat_bytes(tensor: torch.Tensor) -> Bytes:
    """The bytes of a contiguous CPU tensor as a uint8 numpy view (any dtype, 0-dim included).

    numpy reshapes and reinterprets: torch's reshape and view(uint8) cost 5-10 us per tensor here, numpy's
    a fraction of a microsecond, and a restore into an FSDP2 model takes a view of each of ~600 targets."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    try:
        array = tensor.numpy()
    except TypeError:  # a dtype numpy does not have (bfloat16, float8, ...): torch reinterprets it
        bits: Bytes = tensor.reshape(-1).view(torch.uint8).numpy()
        return bits
    flat: Bytes = array.reshape(-1).view(np.uint8)
    return flat


@dataclass(frozen=True, slots=True)
class Extent:
    """A tensor's place in the data region: `nbytes` at `offset`, zero padding up to `end`."""

    offset: int
    nbytes: int
    row_bytes: int  # pieces split only at multiples of this
    end: int


@dataclass(frozen=True, slots=True)
class Piece:
    transfer: int
    lo: int
    hi: int
    at: int  # position of byte `lo` in the data region
    pad: int  # zero padding bytes right after the piece (only after the tensor's last piece)


@dataclass(frozen=True, slots=True)
class StripePlan:
    start: int
    end: int
    pieces: tuple[Piece, ...]
    runs: tuple[Piece, ...] = ()  # the pieces merged where one continues the other: fewer Python calls

    @staticmethod
    def of(start: int, end: int, pieces: Sequence[Piece]) -> StripePlan:
        runs: list[Piece] = []
        for piece in pieces:
            last = runs[-1] if runs else None
            if last is not None and last.transfer == piece.transfer and last.hi == piece.lo and not last.pad:
                runs[-1] = Piece(last.transfer, last.lo, piece.hi, last.at, piece.pad)
            else:
                runs.append(piece)
        return StripePlan(start, end, tuple(pieces), tuple(runs))


def plan_stripes(
    extents: Sequence[Extent],
    data_bytes: int,
    stripe_bytes: int = STRIPE_BYTES,
    piece_bytes: int = PIECE_BYTES,
) -> tuple[StripePlan, ...]:
    """Cut [0, data_bytes) into stripes of about `stripe_bytes`, boundaries only where a piece may start.

    A row longer than a stripe makes a longer stripe: its bytes can only be copied by one torch call.
    """
    stripes: list[StripePlan] = []
    pieces: list[Piece] = []
    start = 0
    for index, extent in enumerate(extents):
        lo = 0
        while lo < extent.nbytes:
            at = extent.offset + lo
            room = start + stripe_bytes - at
            if pieces and (room <= 0 or room < extent.row_bytes):
                stripes.append(StripePlan.of(start, at, pieces))
                pieces, start, room = [], at, stripe_bytes
            take = min(extent.nbytes - lo, room, piece_bytes)
            take = max(take - take % extent.row_bytes, extent.row_bytes)
            hi = lo + take
            pad = extent.end - extent.offset - extent.nbytes if hi == extent.nbytes else 0
            pieces.append(Piece(index, lo, hi, at, pad))
            lo = hi
    if start < data_bytes or pieces:
        stripes.append(StripePlan.of(start, data_bytes, pieces))
    return tuple(stripes)


@dataclass(frozen=True, slots=True)
class CheckedGroup:
    """Stripes [first, last) of a checkpoint, checked together, and the pieces copied out of them once every
    one matched its checksum. A group is one stripe, unless a row of a strided target straddles a stripe
    boundary (a row is copied by one torch call): then the stripes it touches form one group."""

    first: int
    last: int
    pieces: tuple[Piece, ...]


def plan_checked(
    extents: Sequence[Extent], stripes: Sequence[tuple[int, int]], piece_bytes: int = STRIPE_BYTES
) -> tuple[CheckedGroup, ...]:
    """Cut the extents (positions in a checkpoint's data region, sorted by offset, inside [0, data end))
    into pieces that never cross a boundary of `stripes` (the manifest's, which cover the region in order)
    unless a row must, and group them by stripe.

    Memoised: planning 1 GiB of 162 tensors takes about 2 ms of the calling thread, while every copy
    thread waits, and a restore of the same state into the same structure plans the same groups again."""
    return _plan_checked(tuple(extents), tuple((start, end) for start, end in stripes), piece_bytes)


@functools.lru_cache(maxsize=8)
def _plan_checked(
    extents: tuple[Extent, ...], stripes: tuple[tuple[int, int], ...], piece_bytes: int
) -> tuple[CheckedGroup, ...]:
    starts = [start for start, _ in stripes]
    joined = [False] * len(stripes)  # joined[k]: stripe k is checked together with stripe k + 1
    placed: list[tuple[int, Piece]] = []
    for index, extent in enumerate(extents):
        lo = 0
        while lo < extent.nbytes:
            at = extent.offset + lo
            first = bisect.bisect_right(starts, at) - 1
            take = min(extent.nbytes - lo, piece_bytes, stripes[first][1] - at)
            take = max(take - take % extent.row_bytes, extent.row_bytes)
            last = bisect.bisect_right(starts, at + take - 1) - 1
            for k in range(first, last):
                joined[k] = True
            placed.append((first, Piece(index, lo, lo + take, at, 0)))
            lo += take
    group_of: list[int] = []
    bounds: list[int] = []
    for k in range(len(stripes)):
        if k == 0 or not joined[k - 1]:
            bounds.append(k)
        group_of.append(len(bounds) - 1)
    pieces: list[list[Piece]] = [[] for _ in bounds]
    for first, piece in placed:
        pieces[group_of[first]].append(piece)
    ends = [*bounds[1:], len(stripes)] if bounds else []
    return tuple(
        CheckedGroup(first, last, tuple(group))
        for first, last, group in zip(bounds, ends, pieces, strict=True)
    )


# A piece's copy, ready to run: a function and its arguments (np.copyto and the piece's two views, for flat
# bytes; the transfer's copy and the piece's bounds otherwise).
Op = tuple[Callable[..., object], tuple[object, ...]]


@dataclass(frozen=True, slots=True)
class LandedTransfer:
    """Bytes already in the slot: a device copy wrote them there (worker_lib.store.cuda.DirectCopies) and
    the save only hashes them."""

    def copy(self, lo: int, hi: int) -> None:
        return None


def _nothing() -> None:
    return None


def piece_op(transfer: Transfer, lo: int, hi: int) -> Op:
    if type(transfer) is LandedTransfer:
        return _nothing, ()
    # FlatTransfer.copy's own work, unless it was replaced (tests hold or fail copies through it).
    if type(transfer) is FlatTransfer and FlatTransfer.copy is _FLAT_COPY:
        if hi - lo <= SMALL_COPY_BYTES:
            return operator.setitem, (transfer.dst[lo:hi].data, _ALL, transfer.src[lo:hi].data)
        return np.copyto, (transfer.dst[lo:hi], transfer.src[lo:hi])
    return transfer.copy, (lo, hi)


_ALL = slice(None)


_FLAT_COPY = FlatTransfer.copy


@dataclass(frozen=True, slots=True)
class SaveStripe:
    """A stripe of a save, compiled for one set of transfers and one slot: batches of consecutive pieces,
    each its pieces' copies, the slot's padding after them with as many zero bytes (those that have any),
    and the bytes to hash once they are copied; then the bytes left to hash."""

    batches: tuple[tuple[tuple[Op, ...], tuple[tuple[memoryview, memoryview], ...], memoryview], ...]
    tail: memoryview


def compile_save(
    stripes: Sequence[StripePlan], transfers: Sequence[Transfer], slot: Bytes
) -> list[SaveStripe]:
    """What CopyEngine.copy does for each piece of each stripe, with every view made once: a save into the
    same slot from the same sources runs it again (about 3 us less per piece, 2000 pieces per GB). Pieces
    follow one another in the slot, so consecutive ones are hashed together, up to HASH_BATCH_BYTES (a
    piece at least as large is hashed on its own, right after its copy, as before)."""
    compiled: list[SaveStripe] = []
    for stripe in stripes:
        batches: list[tuple[tuple[Op, ...], tuple[tuple[memoryview, memoryview], ...], memoryview]] = []
        ops: list[Op] = []
        pads: list[tuple[memoryview, memoryview]] = []
        hashed = stripe.start
        end = stripe.start
        for piece in stripe.pieces:
            end = piece.at + piece.hi - piece.lo
            ops.append(piece_op(transfers[piece.transfer], piece.lo, piece.hi))
            if piece.pad:
                pads.append((slot[end : end + piece.pad].data, _ZEROS_VIEW[: piece.pad]))
            end += piece.pad
            if end - hashed >= HASH_BATCH_BYTES:
                batches.append((tuple(ops), tuple(pads), slot[hashed:end].data))
                ops, pads, hashed = [], [], end
        if ops:
            batches.append((tuple(ops), tuple(pads), slot[hashed:end].data))
            hashed = end
        compiled.append(SaveStripe(tuple(batches), slot[hashed : stripe.end].data))
    return compiled


def compile_checked(groups: Sequence[CheckedGroup], transfers: Sequence[Transfer]) -> list[tuple[Op, ...]]:
    """The copies of each group of a restore (see CopyEngine.check_copy), with every view made once."""
    return [tuple(piece_op(transfers[p.transfer], p.lo, p.hi) for p in group.pieces) for group in groups]


class CopyEngine:
    """A small pool of threads that executes stripe plans and hashes byte ranges."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="castor-copy")

    def copy(
        self,
        stripes: Sequence[StripePlan],
        transfers: Sequence[Transfer],
        slot: Bytes | None = None,
        compiled: Sequence[SaveStripe] | None = None,
        workers: int | None = None,
    ) -> list[str]:
        """Run every piece of every stripe, on at most `workers` threads (default: all of the engine's).

        With `slot` (a save: the transfers write into it) also zero the alignment padding and return each
        stripe's xxh3_64 hex digest, computed piece by piece right after the piece is copied. `compiled`:
        the same, made by compile_save for these stripes, transfers and slot.
        """
        digests = [""] * len(stripes)

        def run_stripe(i: int) -> None:
            stripe = stripes[i]
            if compiled is not None and not HASH_SOURCES_FIRST:
                if i == len(stripes) // 2:
                    pause_point("mid-copy")
                hasher = xxhash.xxh3_64()
                update = hasher.update
                for ops, pads, written in compiled[i].batches:
                    for copy, args in ops:
                        copy(*args)
                    for pad, zeros in pads:
                        pad[:] = zeros
                    update(written)
                update(compiled[i].tail)
                digests[i] = hasher.hexdigest()
                return
            if slot is None:
                for piece in stripe.pieces:
                    transfers[piece.transfer].copy(piece.lo, piece.hi)
                return
            if i == len(stripes) // 2:
                pause_point("mid-copy")
            if HASH_SOURCES_FIRST and all(type(transfers[r.transfer]) is FlatTransfer for r in stripe.runs):
                digests[i] = hash_then_copy(stripe)
                return
            # A strided source: its bytes exist in slot order only once copied, so each piece is hashed
            # from the slot right after its copy, while it is in L2.
            hasher = xxhash.xxh3_64()
            hashed = stripe.start
            for piece in stripe.pieces:
                transfers[piece.transfer].copy(piece.lo, piece.hi)
                end = piece.at + piece.hi - piece.lo
                if piece.pad:
                    slot[end : end + piece.pad] = 0
                hasher.update(slot[hashed : end + piece.pad].data)
                hashed = end + piece.pad
            hasher.update(slot[hashed : stripe.end].data)
            digests[i] = hasher.hexdigest()

        def hash_then_copy(stripe: StripePlan) -> str:
            """Hash the stripe's bytes from their sources, in slot order (streaming them into cache at the
            hash's speed), then copy them from cache: cheaper than a copy alone from memory. The digest
            is of the bytes meant for the slot; a restore checks the slot against it."""
            assert slot is not None
            hasher = xxhash.xxh3_64()
            hashed = stripe.start
            for run in stripe.runs:
                if run.at > hashed:  # bytes no tensor writes (none in a planned layout): as they are
                    hasher.update(slot[hashed : run.at].data)
                source = transfers[run.transfer]
                assert isinstance(source, FlatTransfer)
                hasher.update(source.src[run.lo : run.hi].data)
                if run.pad:
                    hasher.update(_ZEROS[: run.pad])
                hashed = run.at + run.hi - run.lo + run.pad
            if hashed < stripe.end:
                hasher.update(slot[hashed : stripe.end].data)
            for run in stripe.runs:
                transfers[run.transfer].copy(run.lo, run.hi)
                if run.pad:
                    end = run.at + run.hi - run.lo
                    slot[end : end + run.pad] = 0
            return hasher.hexdigest()

        self._run(len(stripes), run_stripe, workers)
        return digests

    def check_copy(
        self,
        groups: Sequence[CheckedGroup],
        transfers: Sequence[Transfer],
        data: Bytes,
        stripes: Sequence[tuple[int, int, str]],
        compiled: Sequence[tuple[Op, ...]] | None = None,
    ) -> list[int]:
        """A restore: for each group, hash its stripes of `data` (start, end, expected xxh3_64 hex digest)
        and, when all match, copy its pieces out while the stripes are still in cache (`compiled`: those
        copies, made by compile_checked for these groups and transfers).

        Returns the indices of the stripes that did not match. Their bytes are never copied; once one is
        found nothing more is copied, but every stripe is still checked, so the error can name them all.
        """
        bad: list[int] = []
        corrupt = threading.Event()

        def run_group(i: int) -> None:
            group = groups[i]
            matched = True
            for k in range(group.first, group.last):
                start, end, expected = stripes[k]
                if xxhash.xxh3_64_hexdigest(data[start:end].data) != expected:
                    bad.append(k)  # list.append is atomic under the GIL
                    matched = False
            if not matched:
                corrupt.set()
            if corrupt.is_set():
                return
            if compiled is not None:
                for copy, args in compiled[i]:
                    copy(*args)
                return
            for piece in group.pieces:
                transfers[piece.transfer].copy(piece.lo, piece.hi)

        self._run(len(groups), run_group)
        return sorted(bad)

    def hash(self, data: Bytes, ranges: Sequence[tuple[int, int]]) -> list[str]:
        """xxh3_64 hex digests of data[start:end] for each range."""
        digests = [""] * len(ranges)

        def hash_range(i: int) -> None:
            start, end = ranges[i]
            digests[i] = xxhash.xxh3_64_hexdigest(data[start:end].data)

        self._run(len(ranges), hash_range)
        return digests

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run(self, count: int, task: Callable[[int], None], workers: int | None = None) -> None:
        """Call task(0..count-1) on up to `workers` threads (default: all), each taking the next index when
        done with one."""
        cursor = itertools.count()  # next() on a count is atomic under the GIL
        failed = threading.Event()

        def worker() -> None:
            try:
                while not failed.is_set() and (i := next(cursor)) < count:
                    task(i)
            except BaseException:
                failed.set()
                raise

        # The calling thread is one of the workers: it would only wait otherwise, and one thread fewer is
        # woken through the pool's queue (a wake-up costs tens of microseconds, more on a loaded machine).
        threads = self.threads if workers is None else max(1, min(workers, self.threads))
        futures = [self._pool.submit(worker) for _ in range(min(threads, count) - 1)]
        error: BaseException | None = None
        try:
            worker()
        except BaseException as raised:
            error = raised
        # Wait for every thread before raising: a thread still writing into a slot after the caller gave the
        # slot up could tear the next checkpoint written there.
        wait_all(futures)
        if error is not None:
            raise error
        for future in futures:
            future.result()
