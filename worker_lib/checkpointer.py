"""Checkpointer: the checkpoint API that training code calls every iteration.

The API lives here; the fences that keep a background copy consistent with training (the optimizer-step
wait, the buffer snapshot, a save waiting for a slot a reader holds) in `worker_lib.fences`, and what a
training process and its worker agent say to each other (the environment contract and the notify
datagrams) in `worker_lib.agent_ipc`. Their names stay importable from here.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_lib.agent_ipc import (
    FRESH_START,
    GENERATION_ENV,
    NOTIFY_ENV,
    RESTORE_ITERATION_ENV,
    SHM_DIR_ENV,
    AgentNotifier,
    Event,
    default_directory,
    manifest_meta,
)
from worker_lib.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from worker_lib.fences import (
    BUSY_WAIT_LIMIT_S,
    HOST_SNAPSHOT_BYTES,
    BufferSnapshot,
    HostSnapshot,
    SteppedOptimizers,
    fence_optimizer_steps,
    open_when_free,
)
from worker_lib.restore import RestorePlans, load_state, restore_state
from worker_lib.sharded import RESHARD_HINT, ShardingMismatchError
from worker_lib.store.copy import CopyEngine, SaveStripe, Transfer, compile_save
from worker_lib.store.cuda import (
    DeviceFence,
    DirectCopies,
    IssuedCopies,
    Marks,
    PinnedStager,
    direct_copies_enabled,
    mark_devices,
    needs_host_wait,
)
from worker_lib.store.layout import (
    Layout,
    Signature,
    blob_source,
    plan,
    save_transfers,
    signature,
    storage_addresses,
)
from worker_lib.store.manifest import JsonValue, Manifest, Stripe, content_digest
from worker_lib.store.slots import OnBusy, SlotStore, SlotWriter
from worker_lib.store.tree import FlatState, FlattenMemo, flatten, has_extra_state, tree_json

__all__ = [
    "BUSY_WAIT_LIMIT_S",
    "GENERATION_ENV",
    "NOTIFY_ENV",
    "NOT_DISTRIBUTED",
    "RESTORE_ITERATION_ENV",
    "SHM_DIR_ENV",
    "Checkpointer",
    "CheckpointerStats",
    "Restored",
    "default_directory",
    "newest_common_iteration",
]


class Restored:
    """A checkpoint read back: its iteration, the state as saved, and the manifest's meta (rank, ...).

    A restore into the very state this process saved (see Checkpointer.restore) has nothing left to do once
    the bytes are in place: its `state` (the same tensors, in the saved structure) is then decoded the first
    time it is read, not inside restore()."""

    __slots__ = ("_decode", "_lock", "_state", "iteration", "meta")

    def __init__(
        self,
        iteration: int,
        state: Any = None,
        meta: dict[str, JsonValue] | None = None,
        *,
        decode: Callable[[], Any] | None = None,
    ):
        self.iteration = iteration
        self.meta: dict[str, JsonValue] = {} if meta is None else meta
        self._state = state
        self._decode = decode
        self._lock = threading.Lock() if decode is not None else None

    @property
    def state(self) -> Any:
        if self._lock is not None:
            with self._lock:
                if self._decode is not None:
                    self._state, self._decode = self._decode(), None
        return self._state

    def __repr__(self) -> str:
        return f"Restored(iteration={self.iteration!r}, meta={self.meta!r})"

    def load_into(self, target: Any) -> None:
        """Load the state into modules, optimizers and tensors: see `load_state`."""
        load_state(self.state, target)


@dataclass(frozen=True)
class CheckpointerStats:
    saves_committed: int = 0
    saves_skipped: int = 0  # a reader held the slot until training needed the state back (on_busy="skip")
    last_save_s: float = 0.0  # how long the last save() call blocked its caller
    last_wait_s: float = 0.0  # how long the last wait() that found a copy running blocked (async mode)
    last_copy_s: float = 0.0  # copy + checksums + commit of the last committed checkpoint
    last_bytes: int = 0
    total_bytes: int = 0
    # What checkpointing cost the training thread, cumulative: seconds it was blocked inside Castor (whole
    # save() calls, and waits for a copy at the optimizer step and in wait()), over
    # `save_calls` calls of save(). The agent reports both in its heartbeats; the root charges them to the
    # job's ETTR as checkpoint stalls. Cores a background copy takes from compute are not in it.
    stalled_s: float = 0.0
    save_calls: int = 0
    # GPU jobs: bytes of the last save copied from the device straight into the slot (no pinned staging),
    # and optimizer steps that waited for a save's copies on the device instead of blocking the host.
    last_direct_bytes: int = 0
    steps_fenced_on_device: int = 0
    staging_bytes: int = 0  # pinned host memory held for device tensors that cannot go to the slot directly


class Checkpointer:
    """Per-iteration checkpoints of a training state into shared memory that outlives the process.

    `save(iteration, state)` copies the state's tensors into the older of (at least) two slots and commits
    it atomically, so a crash at any instant leaves the previous checkpoint intact. By default the copy runs
    in background threads: save() returns at once and the copy is finished before the next optimizer step,
    the next save, restore, or wait(). The buffers of modules saved as objects (BatchNorm statistics, which
    forward changes in place; masks, RoPE tables) are small and captured inside save(), so no forward waits.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        slots: int = 2,
        blocking: bool = False,
        on_busy: OnBusy = "skip",
        threads: int | None = None,
    ):
        if on_busy not in ("skip", "wait"):
            raise ValueError(f"on_busy must be 'skip' or 'wait', not {on_busy!r}")
        self.directory = Path(directory if directory is not None else default_directory())
        self._store = SlotStore(self.directory, slots)
        self._engine = CopyEngine(threads)
        self._stager = PinnedStager()
        self._direct: DirectCopies | None = None  # made at the first save of a device tensor
        self._host_snapshot = HostSnapshot()
        # The pending save's device copies, when the optimizer step may wait for them on the device alone.
        self._issued: IssuedCopies | None = None
        self._blocking = blocking
        self._on_busy: OnBusy = on_busy
        self._rank = int(os.environ.get("RANK", "0"))
        self._meta = manifest_meta(self._rank)  # rank, world size, recovery-plan generation
        self._notifier = AgentNotifier.from_environment(self._rank, self.directory)
        self._layout: tuple[Signature, Layout] | None = None  # the last layout and what it was planned for
        # Per slot, the last save's transfers and what they were made for (see _transfers_for).
        self._transfers: dict[
            int, tuple[Layout, tuple[int, ...], list[Transfer], list[SaveStripe] | None]
        ] = {}
        self._memo = FlattenMemo()  # the last save's encoding of the state's tensor dicts (see flatten)
        self._restore_plans = RestorePlans()  # the copies of the last restores into the saved state
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="castor-save")
        self._pending: Future[None] | None = None
        self._give_up: threading.Event | None = None  # set: the pending save stops waiting for its slot
        self._stats = CheckpointerStats()
        self._stats_lock = threading.Lock()
        # save() and every wait for the pending save, one at a time: dcp.async_save calls save() from DCP's
        # thread while the training thread's optimizer step may be waiting for the previous copy, and that
        # save, seeing nothing pending, took the slot the copy was still writing.
        self._serial = threading.RLock()
        self._stepped = SteppedOptimizers()  # noted by the step hook (see _save_detached)
        self._step_hook = fence_optimizer_steps(self)
        self._buffers = BufferSnapshot()
        self._closed = False

    @property
    def stats(self) -> CheckpointerStats:
        with self._stats_lock:
            return self._stats

    def save(self, iteration: int, state: Any) -> bool:
        """Checkpoint `state` as iteration `iteration`.

        Returns False when the save was skipped because a reader (the agent streaming the slot to a peer)
        held the slot it needs (`on_busy="skip"`, blocking mode). In the default asynchronous mode such a
        save keeps trying in the background until training needs the state again (the next optimizer step
        or save), and is skipped only then: it returns True and the skip shows in `stats.saves_skipped`.
        """
        with self._serial:
            return self._save(iteration, state)

    def _save_detached(
        self, iteration: int, state: Any, *, fresh: Sequence[torch.Tensor] = (), commit: bool = False
    ) -> bool:
        """save() of a state of detached tensors, without the modules and optimizers they come from (a DCP
        state dict, see worker_lib.dcp): nothing says which tensors are buffers, which forward changes in
        place. So every tensor that is no parameter or state of an optimizer seen stepping (whose steps wait
        for the copy) is snapshotted inside this call, as the buffers of a module are; where those come to
        more than half of the state (no optimizer has stepped yet), the save waits for its copy instead.
        `fresh`: tensors of `state` never snapshotted: made for this save (nothing else holds them), or
        parameters of the models saved (they change only in optimizer steps, which wait, or never).

        `commit`: return only once the checkpoint is committed (or skipped), whatever the mode; for a save
        of a staged copy from another thread (dcp.async_save), which needs no snapshot, and whose caller
        must not reuse the staged tensors before the copy has read them. The wait is not counted as a stall
        of training."""
        with self._serial:
            if not commit:
                return self._save(iteration, state, detached=fresh)
            saved = self._save(iteration, state)
            self._wait()
            return saved

    def _save(self, iteration: int, state: Any, *, detached: Sequence[torch.Tensor] | None = None) -> bool:
        """save(); `detached` (not None): a state of detached tensors, those given fresh (see
        _save_detached)."""
        self._check_open()
        if type(iteration) is not int or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, not {iteration!r}")
        started = time.perf_counter()
        self._settle()
        flat = flatten(state, self._memo)
        # The previous copy is finished (settled above): the side buffers can take this save's values. A
        # blocking save copies everything before it returns and needs no snapshot.
        tensors, storages = flat.tensors, storage_addresses(flat.tensors)
        blocking = self._blocking
        if not blocking:
            also: Sequence[int] = flat.group_tensors
            if detached is not None:
                unprotected = self._stepped.unprotected(tensors, storages, detached)
                if unprotected is None:
                    blocking = True  # this save copies everything before it returns
                else:
                    also = sorted({*also, *unprotected})
            if not blocking:
                tensors, storages = self._buffers.capture(tensors, flat.modules, storages, also)
        layout = self._layout_for(tensors, flat.keys, storages)
        writer = self._store.open_write(iteration, layout.data_bytes, self._on_busy)
        if writer is None and blocking:
            self._skipped(iteration)
            self._save_returned(started)
            return False
        try:
            sources, marks, direct, host_pending = self._sources(layout, tensors, blocking)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        issued = None
        if writer is None:
            self._give_up = threading.Event()
            write = partial(
                self._write_when_free, iteration, layout, flat.tree, sources, marks, self._give_up
            )
        else:
            if not blocking and not needs_host_wait(device_only=direct, host_pending=host_pending):
                issued = IssuedCopies()
            write = partial(self._write, writer, layout, flat.tree, sources, marks, direct, issued)
        if blocking:
            write()
        else:
            self._pending = self._background.submit(write)
            self._issued = issued
        self._save_returned(started)
        return True

    def _sources(
        self, layout: Layout, tensors: Sequence[torch.Tensor], blocking: bool
    ) -> tuple[list[torch.Tensor], Marks, bool, bool]:
        """What the background thread copies each blob from; the marks of the device tensors among them
        (their copies are queued by the background thread, after the marks); whether they go straight into
        the slot (unless CASTOR_CUDA_DIRECT=0); and whether the background thread still reads host tensors
        of the live state (then the optimizer step waits for the whole save on the host). With direct
        copies a GPU job's few host tensors (AdamW's `step` counters) are snapshotted here instead."""
        sources = [blob_source(blob, tensors) for blob in layout.blobs]
        marks = mark_devices(sources)
        direct = bool(marks) and direct_copies_enabled()
        if not direct or blocking:
            return sources, marks, direct, True
        live = [i for i, source in enumerate(sources) if not source.is_cuda]
        if sum(layout.blobs[i].nbytes for i in live) > HOST_SNAPSHOT_BYTES:
            return sources, marks, direct, True
        return self._host_snapshot.capture(sources, live), marks, direct, False

    def _copy_from_devices(
        self, writer: SlotWriter, layout: Layout, sources: list[torch.Tensor], marks: Marks, direct: bool
    ) -> tuple[list[torch.Tensor], frozenset[int], DeviceFence]:
        """Background: queue the copies of the device tensors among `sources`, straight into the slot where
        they can go (DirectCopies: the blobs `landed`), else into pinned memory (`sources` then holds the
        staged host copies); the fence says when they have run."""
        landed: frozenset[int] = frozenset()
        fence = DeviceFence()
        if direct:
            if self._direct is None:
                self._direct = DirectCopies()
            landed, fence = self._direct.queue(
                writer.slot,
                self._store.mapping(writer.slot),
                writer.buffer,
                [(blob.offset, blob.nbytes) for blob in layout.blobs],
                sources,
                marks,
            )
            sources = [_LANDED if i in landed else source for i, source in enumerate(sources)]
        staged, staged_fence = self._stager.stage(sources, marks)
        if self._stager.staging_bytes != self.stats.staging_bytes:
            self._update(staging_bytes=self._stager.staging_bytes)
        return staged, landed, fence + staged_fence

    def _save_returned(self, started: float) -> None:
        blocked = time.perf_counter() - started
        with self._stats_lock:
            stats = self._stats
            self._stats = replace(
                stats,
                last_save_s=blocked,
                stalled_s=stats.stalled_s + blocked,
                save_calls=stats.save_calls + 1,
            )

    def wait(self) -> None:
        """Block until the last save is committed; raises CheckpointError if it failed.

        Call it before changing saved tensors in place anywhere but in an optimizer step. A save whose slot
        a reader holds is waited for too, up to BUSY_WAIT_LIMIT_S, then skipped. The time it blocks counts
        in `stats.stalled_s`.
        """
        started = time.perf_counter()
        try:
            self._wait()
        finally:
            self._stalled(started)

    def _fence(self) -> None:
        """Training needs the saved state back (an optimizer step): settle, and count the time it blocks in
        `stats.stalled_s`."""
        if self._pending is None and self._give_up is None:
            return  # the common case: the copy finished during forward and backward
        started = time.perf_counter()
        try:
            with self._serial:
                # Every copy reading the live state runs on the device: once the background thread has
                # queued them (it does so first), the step's stream waits for them there and the host goes
                # on; checksums and commit finish in the background.
                fence = self._issued.wait() if self._issued is not None else None
                if fence is not None:
                    fence.order_device()
                    self._update(steps_fenced_on_device=self.stats.steps_fenced_on_device + 1)
                else:
                    self._settle()
        finally:
            self._stalled(started)

    def _stalled(self, started: float) -> None:
        blocked = time.perf_counter() - started
        with self._stats_lock:
            self._stats = replace(self._stats, stalled_s=self._stats.stalled_s + blocked)

    def _wait(self) -> None:
        """wait() without the stall accounting: for save(), which counts its whole call, and for restore
        and close, which are not training."""
        with self._serial:  # a save from another thread waits until the pending one is done
            pending, self._pending, self._give_up = self._pending, None, None
            self._issued = None
            if pending is None:
                return
            started = time.perf_counter()
            try:
                pending.result()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"saving a checkpoint failed: {exc!r}") from exc
            finally:
                self._update(last_wait_s=time.perf_counter() - started)

    def _settle(self) -> None:
        """Training needs the saved state again: wait for the last save's copy, but give up a save that is
        still waiting for its slot (skipping it) rather than hold training up for a reader."""
        if self._give_up is not None:
            self._give_up.set()
        self._wait()

    def restore(self, into: Any = None, iteration: int | None = None) -> Restored | None:
        """Read back the newest committed checkpoint, or exactly `iteration`; None when there is none.

        Without `iteration`, $CASTOR_RESTORE_ITERATION (set by the recovery plan for every rank) decides:
        that iteration exactly, or `none` for a fresh start. Without a plan, when torch.distributed is
        initialized, the ranks agree on the newest iteration every one of them holds (a rank killed between
        two commits must not resume alone from another iteration); when there is none and a rank holds
        checkpoints saved by another world size (a job restarted with more ranks), every rank raises
        ShardingMismatchError rather than start fresh over them. Every checksum is verified before
        anything is loaded: a corrupt checkpoint raises CheckpointCorruptError and is never replaced by an
        older one.
        `into` (like the saved state, e.g. {"model": model, "optimizer": optimizer}) receives the tensors
        in place; optimizers get load_state_dict.
        """
        self._check_open()
        self._wait_agreeing(iteration is None)
        restored = self._restore(into, iteration)
        self._notify_restored(FRESH_START if restored is None else restored.iteration)
        return restored

    def _notify_restored(self, iteration: int) -> None:
        """Tell the agent what this process restored (FRESH_START: nothing) and the newest iteration it held:
        its heartbeats carry both, and where torchrun relaunches training (embedded mode) the root takes the
        iterations the relaunch rolled back from them."""
        if not self._notifier.takes("restored"):
            return  # the newest iteration held is read only for the agent
        committed = self._store.committed()  # newest first
        newest = committed[0].iteration if committed else FRESH_START
        stats = self.stats
        self._notifier.notify(
            "restored", iteration, None, stalled_s=stats.stalled_s, save_calls=stats.save_calls, newest=newest
        )

    def _wait_agreeing(self, agreeing: bool) -> None:
        """_wait() before choosing the iteration to read. `agreeing`: the ranks agree on it next (a
        collective, unless the recovery plan names it): where this rank's last save failed, it still takes
        part before it raises, or the other ranks would wait in the agreement until the group's timeout."""
        try:
            self._wait()
        except CheckpointError:
            if agreeing and not os.environ.get(RESTORE_ITERATION_ENV, "").strip():
                with suppress(CheckpointError):  # the save's failure is the one to report
                    newest_common_iteration(*held_iterations(self._store.committed()))
            raise

    def _restore(self, into: Any, iteration: int | None) -> Restored | None:
        if iteration is None:
            planned = os.environ.get(RESTORE_ITERATION_ENV, "").strip()
            if planned.lower() == "none":
                return None
            if planned:
                try:
                    iteration = int(planned)
                except ValueError:
                    raise ValueError(
                        f"{RESTORE_ITERATION_ENV}={planned!r}: expected an iteration number or 'none'"
                    ) from None
            else:
                agreed = newest_common_iteration(*held_iterations(self._store.committed()))
                if agreed is None:
                    return None  # no iteration that every rank holds: all start fresh together
                if agreed is not NOT_DISTRIBUTED:
                    iteration = int(agreed)
        try:
            with self._store.open_read(iteration) as (manifest, data):
                # Verifies every stripe before copying it out (one pass over the bytes, see restore.py).
                matched = self._matched(manifest, into)
                try:
                    decode = restore_state(manifest, data, into, self._engine, matched, self._restore_plans)
                except CheckpointCorruptError as exc:
                    # Recorded with the slot: the machine's next inventory reports this copy as corrupt,
                    # so the next recovery plan reads the iteration from another copy.
                    self._store.condemn(manifest, str(exc))
                    raise
        except CheckpointNotFoundError:
            if iteration is None:
                return None
            raise
        return Restored(manifest.iteration, meta=manifest.meta, decode=decode)

    def close(self, *, finished: bool = True) -> None:
        """Finish the pending save and release threads, hooks and mappings (the checkpoints stay).

        `finished` tells the machine's Castor services that this rank's training ended cleanly (in the
        embedded mode the job completes once every rank said so); leaving a `with` block through an
        exception passes False.
        """
        if self._closed:
            return
        try:
            self._wait()
            if finished:
                newest = self._store.committed()
                self._notify("finished", newest[0].iteration if newest else -1, None)
        finally:
            self._closed = True
            self._step_hook.remove()
            self._buffers.release()
            self._host_snapshot.release()
            self._background.shutdown()
            self._transfers.clear()  # their views of the slots, before the mappings close
            if self._direct is not None:
                self._direct.close()  # its views and CUDA host registrations too
            self._restore_plans.clear()
            self._memo.clear()
            self._engine.close()
            self._store.close()
            self._notifier.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self.close(finished=exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)))

    def _matched(self, manifest: Manifest, into: Any) -> FlatState | None:
        """`into` flattened, when it is exactly what this process last saved with the checkpoint's layout:
        the same tree (structure, plain values, sharding specs: every check a restore makes of its targets
        compares fields of it) and tensors whose layout signature (dtypes, shapes, strides, shared storages)
        is the one the checkpoint was written with. restore_state then skips matching target by target.
        None otherwise (and for anything the save codec refuses): the targets are matched one by one."""
        layout = self._layout
        if into is None or layout is None or layout[1].entries is not manifest.tensors:
            return None
        try:
            flat = flatten(into, self._memo)
        except Exception:  # the matching target by target names what is wrong
            return None
        if flat.detached_outside_modules or flat.tree != manifest.tree:
            return None
        if any(map(has_extra_state, flat.modules)):  # its extra state goes through set_extra_state
            return None
        if signature(flat.tensors, flat.keys) != layout[0]:
            return None
        return flat

    def _layout_for(
        self, tensors: Sequence[torch.Tensor], keys: Sequence[str], storages: list[int]
    ) -> Layout:
        current = signature(tensors, keys, storages)
        if self._layout is None or self._layout[0] != current:
            self._layout = (current, plan(tensors, keys))
        return self._layout[1]

    def _write_when_free(
        self,
        iteration: int,
        layout: Layout,
        tree: JsonValue,
        sources: list[torch.Tensor],
        marks: Marks,
        give_up: threading.Event,
    ) -> None:
        """Background: wait for a reader to let go of the slot, then write; skip when training needs the
        state back first (`give_up`) or the reader holds on for longer than BUSY_WAIT_LIMIT_S."""
        writer = open_when_free(self._store, iteration, layout.data_bytes, give_up)
        if writer is None:
            self._skipped(iteration)
            return
        self._write(writer, layout, tree, sources, marks, False, None)

    def _transfers_for(
        self,
        index: int,
        layout: Layout,
        sources: list[torch.Tensor],
        landed: frozenset[int],
        slot: np.ndarray[Any, Any],
    ) -> tuple[list[Transfer], list[SaveStripe] | None]:
        """The copies of a save into slot `index`: those of the last save into it when the layout, the
        slot's memory and every source's address are the same (a steady-state save: building them is a
        few numpy and torch views per tensor, about 10 us each, 6 ms for the 600 tensors of an FSDP2
        decoder's shards), and from the second such save on, each piece's copy and checksum compiled
        (compile_save: a few us less per piece). The cached views keep their tensors and the mapping
        alive, so an address seen again is the same memory, not a reuse; close() drops them."""
        key = (
            slot.__array_interface__["data"][0],
            slot.size,
            landed,
            *(source.data_ptr() for source in sources),
        )
        cached = self._transfers.get(index)
        if cached is not None and cached[0] is layout and cached[1] == key:
            transfers, compiled = cached[2], cached[3]
            if compiled is None:
                compiled = compile_save(layout.stripes, transfers, slot)
                self._transfers[index] = (layout, key, transfers, compiled)
            return transfers, compiled
        self._transfers.pop(index, None)  # the old views go before the new ones are made
        transfers = save_transfers(layout, sources, slot, landed)
        self._transfers[index] = (layout, key, transfers, None)
        return transfers, None

    def _skipped(self, iteration: int) -> None:
        with self._stats_lock:
            self._stats = replace(self._stats, saves_skipped=self._stats.saves_skipped + 1)
        self._notify("skip", iteration, None)

    def _write(
        self,
        writer: SlotWriter,
        layout: Layout,
        tree: JsonValue,
        sources: list[torch.Tensor],
        marks: Marks,
        direct: bool,
        issued: IssuedCopies | None,
    ) -> None:
        started = time.perf_counter()
        landed: frozenset[int] = frozenset()
        try:
            if marks:
                try:
                    sources, landed, fence = self._copy_from_devices(writer, layout, sources, marks, direct)
                except BaseException:
                    if issued is not None:
                        issued.publish(None)  # the step waits for this save on the host, and gets the error
                    raise
                if issued is not None:
                    issued.publish(fence)
                fence.landed()
            slot = np.frombuffer(writer.buffer, dtype=np.uint8)
            transfers, compiled = self._transfers_for(writer.slot, layout, sources, landed, slot)
            # A save the optimizer step waits for on the device runs beside training's next step, whose
            # kernels the training thread launches from Python: every copy thread takes the interpreter lock
            # between its hashes, and with as many threads as cores the launches fell behind the GPU (an
            # H200 host, 16 cores, a 4 GB state: +67 % per iteration with 16 threads, +28 % with 8).
            workers = fenced_save_threads(self._engine.threads) if issued is not None else None
            digests = self._engine.copy(layout.stripes, transfers, slot, compiled, workers=workers)
            manifest = Manifest(
                iteration=writer.iteration,
                data_bytes=layout.data_bytes,
                tensors=layout.entries,
                stripes=tuple(
                    Stripe(s.start, s.end, d) for s, d in zip(layout.stripes, digests, strict=True)
                ),
                digest=content_digest(digests),
                tree=tree,
                meta=self._meta,
                committed_at=time.time(),
                tree_json=tree_json(tree, self._memo),
            )
            writer.commit(manifest)
        except BaseException:
            writer.abort()
            raise
        stats = self.stats
        self._update(
            saves_committed=stats.saves_committed + 1,
            last_direct_bytes=sum(layout.blobs[i].nbytes for i in landed),
            last_copy_s=time.perf_counter() - started,
            last_bytes=layout.data_bytes,
            total_bytes=stats.total_bytes + layout.data_bytes,
        )
        self._notify("commit", writer.iteration, writer.slot)

    def _notify(self, event: Event, iteration: int, slot: int | None) -> None:
        """Tell the worker agent, if there is one, that a checkpoint was committed (or a save skipped, or
        this rank finished); never blocks nor fails (see AgentNotifier)."""
        stats = self.stats
        self._notifier.notify(event, iteration, slot, stalled_s=stats.stalled_s, save_calls=stats.save_calls)

    def _update(self, **changes: Any) -> None:
        with self._stats_lock:
            self._stats = replace(self._stats, **changes)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("the Checkpointer is closed")


NOT_DISTRIBUTED = -1


# What the background thread is given for a blob copied from the device straight into the slot.
_LANDED = torch.empty(0, dtype=torch.uint8)


def held_iterations(manifests: Sequence[Manifest]) -> tuple[list[int], list[int | None]]:
    """The iterations of `manifests` and the world size each was saved with (None: not recorded), as
    newest_common_iteration takes them."""
    sizes = [m.meta.get("world_size") for m in manifests]
    return [m.iteration for m in manifests], [s if type(s) is int else None for s in sizes]


def fenced_save_threads(threads: int) -> int:
    """How many of the copy engine's `threads` hash a save that runs beside training (the step fenced on
    the device): half, leaving cores to the training thread and its device threads."""
    return max(1, threads // 2)


def newest_common_iteration(held: list[int], world_sizes: Sequence[int | None] = ()) -> int | None:
    """The newest iteration held by every rank of the default process group (None: there is none), or
    NOT_DISTRIBUTED when torch.distributed is not initialized or has one rank.

    `world_sizes`: the world size each of `held` was saved with (None: not recorded). Where no iteration is
    common and some rank holds checkpoints saved by another world size (a job restarted with more ranks:
    the new ones hold nothing), starting fresh would overwrite them: every rank raises ShardingMismatchError
    instead (each decides on the same gathered lists, so none is left waiting in a collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return NOT_DISTRIBUTED
    world = dist.get_world_size()
    sizes: list[int | None] = list(world_sizes) or [None] * len(held)
    gathered: list[list[tuple[int, int | None]] | None] = [None] * world
    dist.all_gather_object(gathered, list(zip(held, sizes, strict=True)))
    per_rank = [pairs or [] for pairs in gathered]
    common = set.intersection(*({it for it, _ in pairs} for pairs in per_rank))
    if common:
        return max(common)
    other = [
        (rank, size, it)
        for rank, pairs in enumerate(per_rank)
        for it, size in pairs
        if size is not None and size != world
    ]
    if other:
        rank, size, _ = other[0]
        iterations = sorted({it for r, s, it in other if (r, s) == (rank, size)})
        raise ShardingMismatchError(
            f"no checkpoint is held by all {world} ranks, and rank {rank} holds iterations {iterations} "
            f"saved by {size} ranks: restore with {size} ranks, or start fresh deliberately "
            f"({RESTORE_ITERATION_ENV}=none) rather than overwrite them. {RESHARD_HINT}"
        )
    return None
