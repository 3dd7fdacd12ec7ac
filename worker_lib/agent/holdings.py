"""What one machine holds in shared memory: its own ranks' checkpoints ("local", written by its training
processes) and the replicas its placement-group peers pushed to it ("replica").

Layout under the agent's shared-memory root:
    local/rank-<global rank>/slot-<k>.{bin,json}      (the training process's CASTOR_SHM_DIR)
    replicas/rank-<global rank>/slot-<k>.{bin,json}
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from worker_lib.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    ShmCapacityError,
)
from worker_lib.store.copy import CopyEngine
from worker_lib.store.integrity import verify
from worker_lib.store.manifest import Manifest
from worker_lib.store.slots import SlotStore, free_bytes

Tier = Literal["local", "replica"]
SLOTS = 2  # what a store has unless its writer made more
LOCAL_SLOTS = 4  # what the agent makes for each local rank (see local_slots)
LOCAL_SLOTS_ENV = "CASTOR_LOCAL_SLOTS"
_RANK_DIR = re.compile(r"^rank-(\d+)$")
_SLOT_FILE = re.compile(r"^slot-(\d+)\.bin$")
OVERWRITTEN = "overwritten while being checked"  # not held any more: no problem of its bytes


@dataclass(frozen=True)
class Holding:
    rank: int
    iteration: int
    tier: Tier
    digest: str
    data_bytes: int
    committed_at: float
    verified: bool | None  # None: not checked yet (the restore that reads it checks every stripe)
    generation: int = 1  # the recovery-plan generation whose training made it (from the manifest)
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def local_slots() -> int:
    """Slots of each local rank's store: $CASTOR_LOCAL_SLOTS, default LOCAL_SLOTS. Four let a replication
    round pin the newest fully replicated checkpoint and the one in flight while the training process
    rotates over the other two; with three a transfer must finish within about an iteration or the
    training process takes its slot back; with two nothing is pinned."""
    value = os.environ.get(LOCAL_SLOTS_ENV, "").strip()
    if not value:
        return LOCAL_SLOTS
    try:
        slots = int(value)
    except ValueError:
        raise ValueError(f"{LOCAL_SLOTS_ENV}={value!r}: expected a number of slots (2 or more)") from None
    if slots < 2:
        raise ValueError(f"{LOCAL_SLOTS_ENV}={value!r}: a store needs at least 2 slots")
    return slots


def rank_capacity(root: Path, ranks: int, configured: int | None = None, extra_slots: int = 0) -> int:
    """The most bytes one rank's checkpoint may take on this machine, decided once the placement says how
    many ranks it keeps (`ranks`: its own plus those it holds replicas of, SLOTS slots each).

    `configured` (the job's, or $CASTOR_REPLICA_BYTES_MAX): checked up front against the free shared memory
    (ShmCapacityError when the slots would not fit), so the machine fails at start with a clear message
    instead of SIGBUS or a refused replica later. Without it: an equal share of the shared memory free now
    (plus what this machine's slots already take), so a peer's replicas can never take the share of this
    machine's own ranks, whatever sizes its manifests claim."""
    # `extra_slots`: slots beyond SLOTS per rank (each local rank's store has local_slots()).
    root.mkdir(parents=True, exist_ok=True)
    used = sum(f.stat().st_blocks * 512 for f in root.rglob("slot-*.bin") if f.is_file())
    free, total = free_bytes(root)
    slots = SLOTS * ranks + extra_slots
    if configured is not None:
        needed = configured * slots - used
        if needed > free:
            raise ShmCapacityError(str(root), needed, free, total)
        return configured
    return (free + used) // max(1, slots)


def _checked_key(tier: Tier, rank: int, iteration: int, digest: str) -> tuple[str, int, int, str]:
    return (tier, rank, iteration, digest)


def manifest_generation(manifest: Manifest) -> int:
    value = manifest.meta.get("generation", 1)
    return value if isinstance(value, int) and value >= 1 else 1


Version = tuple[int, int]  # (plan generation, iteration): after a rollback an iteration number recurs


def version(manifest: Manifest) -> Version:
    return manifest_generation(manifest), manifest.iteration


def abandoned(checkpoint: Version, rolled_back: Version | None) -> bool:
    """Whether `checkpoint` belongs to the history a recovery abandoned when it restored `rolled_back`
    ((plan generation, iteration)): made in an earlier generation, past the restored iteration."""
    return rolled_back is not None and checkpoint[0] < rolled_back[0] and checkpoint[1] > rolled_back[1]


class Holdings:
    def __init__(self, root: str | Path, replica_bytes_max: Callable[[int], int | None] | None = None):
        """`replica_bytes_max(rank)`: the largest checkpoint of `rank` this machine stores for a peer
        (None: unbounded); the data plane refuses larger ones and replica slots never grow beyond it."""
        self.root = Path(root)
        self.replica_bytes_max: Callable[[int], int | None] = replica_bytes_max or (lambda rank: None)
        self._stores: dict[tuple[Tier, int], SlotStore] = {}
        self._lock = threading.Lock()
        self._engine: CopyEngine | None = None
        # Copies whose bytes a check here found intact: (tier, rank, iteration, digest).
        self._intact: set[tuple[str, int, int, str]] = set()

    def directory(self, tier: Tier, rank: int) -> Path:
        return self.root / ("local" if tier == "local" else "replicas") / f"rank-{rank}"

    def local_store(self, rank: int) -> SlotStore:
        return self._store("local", rank)

    def replica_store(self, rank: int) -> SlotStore:
        return self._store("replica", rank)

    def _store(self, tier: Tier, rank: int) -> SlotStore:
        directory = self.directory(tier, rank)
        # The writer decides the number of slots; follow what is on disk (at least two).
        slots = max(2, len([f for f in directory.glob("slot-*.bin") if _SLOT_FILE.match(f.name)]))
        with self._lock:
            store = self._stores.get((tier, rank))
            if store is None or store.slots != slots:
                if store is not None:
                    store.close()
                store = self._stores[(tier, rank)] = SlotStore(directory, slots=slots)
            if tier == "replica":
                store.max_bytes = self.replica_bytes_max(rank)
            return store

    def prepare_local(self, ranks: list[int], slots: int) -> None:
        """Create the slot files of each local rank's store (empty: sized by the first save), so the
        training process's store has `slots` of them (a SlotStore uses every slot file present)."""
        for rank in ranks:
            directory = self.directory("local", rank)
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for index in range(slots):
                path = directory / f"slot-{index}.bin"
                if not path.exists():
                    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))

    def ranks(self, tier: Tier) -> list[int]:
        base = self.root / ("local" if tier == "local" else "replicas")
        if not base.is_dir():
            return []
        return sorted(int(m.group(1)) for d in base.iterdir() if (m := _RANK_DIR.match(d.name)))

    def newest(self, tier: Tier, rank: int) -> Manifest | None:
        if not self.directory(tier, rank).is_dir():
            return None
        try:
            committed = self._store(tier, rank).committed()
        except CheckpointCorruptError:
            return None
        return committed[0] if committed else None

    def local_copy_problem(self, rank: int, iteration: int, digest: str | None = None) -> str | None:
        """Why `rank`'s own store cannot give its committed `iteration` (with content `digest`, when given)
        to a restore: not held, or found corrupt; None when it can."""
        store = self.local_store(rank)
        for manifest in store.committed():
            if manifest.iteration == iteration and (digest is None or manifest.digest == digest):
                problem = store.condemned(manifest)
                return (
                    None
                    if problem is None
                    else f"rank {rank}'s iteration {iteration} here is corrupt: {problem}"
                )
        return f"rank {rank} no longer holds iteration {iteration} (digest {digest}) locally"

    @contextmanager
    def open_read(
        self,
        rank: int,
        iteration: int | None = None,
        tier: Tier | Literal["any"] = "any",
        digest: str | None = None,
    ) -> Iterator[tuple[Manifest, memoryview]]:
        """A checkpoint of `rank` held here, locked for reading: the local copy first, then a replica
        (with no iteration given and tier "any": the newer of the two). With `digest`, only a copy with
        that content counts (the same iteration number of another history does not). A copy found corrupt
        is never opened: CheckpointCorruptError says why, when no other copy matched."""
        tiers: list[Tier] = ["local", "replica"] if tier == "any" else [tier]
        if iteration is None and tier == "any":
            newest = [(m.iteration, t) for t in tiers if (m := self.newest(t, rank)) is not None]
            tiers = [t for _, t in sorted(newest, key=lambda found: -found[0])] or tiers
        condemned = None
        with ExitStack() as stack:
            for candidate in tiers:
                if not self.directory(candidate, rank).is_dir():
                    continue
                store = self._store(candidate, rank)
                try:
                    opened = stack.enter_context(store.open_read(iteration))
                except CheckpointNotFoundError:
                    continue
                wanted_copy = digest is None or opened[0].digest == digest
                if wanted_copy and (condemned := store.condemned(opened[0])) is None:
                    break
                stack.close()  # another history's checkpoint of that iteration, or a corrupt one: go on
            else:
                wanted = "any checkpoint" if iteration is None else f"iteration {iteration}"
                if digest is not None:
                    wanted += f" with digest {digest}"
                if condemned is not None:
                    raise CheckpointCorruptError(f"rank {rank}'s {wanted} here is corrupt: {condemned}")
                raise CheckpointNotFoundError(f"this machine holds no {wanted} of rank {rank} ({tier})")
            yield opened

    def inventory(self, verify_checksums: bool = False) -> list[Holding]:
        """Every committed checkpoint held here. Without `verify_checksums` no byte is read, so a recovery's
        report costs nothing however much is held: a copy counts as verified once a check here passed
        (`check`, `check_unverified`), as corrupt once it was condemned, and as unknown (None) otherwise,
        for the restore verifies every stripe it reads anyway and condemns a corrupt copy. With it, every
        copy not yet known is checked now."""
        found = []
        tiers: tuple[Tier, ...] = ("local", "replica")
        for tier in tiers:
            for rank in self.ranks(tier):
                store = self._store(tier, rank)
                try:
                    manifests = store.committed()
                except CheckpointError:
                    continue
                found += [
                    self._holding(tier, rank, store, manifest, verify_checksums) for manifest in manifests
                ]
        with self._lock:  # forget the checks of checkpoints no longer held
            self._intact.intersection_update(
                _checked_key(h.tier, h.rank, h.iteration, h.digest) for h in found
            )
        return found

    def check(self, tier: Tier, rank: int, manifest: Manifest) -> str | None:
        """Verify the bytes of one committed checkpoint held here; None when intact (remembered), else the
        problem. A corrupt one is condemned (SlotStore.condemn): no later inventory offers it again."""
        store = self._store(tier, rank)
        try:
            with store.open_read(manifest.iteration) as (current, data):
                if current.digest != manifest.digest:
                    return OVERWRITTEN
                verify(current, data, self.copy_engine())
        except CheckpointNotFoundError:
            return OVERWRITTEN
        except CheckpointCorruptError as exc:
            store.condemn(manifest, str(exc))
            return str(exc)
        except CheckpointError as exc:
            return str(exc)
        with self._lock:
            self._intact.add(_checked_key(tier, rank, manifest.iteration, manifest.digest))
        return None

    def check_copy(self, rank: int, iteration: int | None, digest: str) -> str | None:
        """`check` of the copy of `rank`'s `iteration` (any, when None) with content `digest`, whichever
        tier holds it."""
        tiers: tuple[Tier, ...] = ("local", "replica")
        for tier in tiers:
            if not self.directory(tier, rank).is_dir():
                continue
            manifest = self._committed_manifest(tier, rank, iteration, digest)
            if manifest is not None:
                return self.check(tier, rank, manifest)
        what = "checkpoint" if iteration is None else f"iteration {iteration}"
        return f"this machine holds no {what} of rank {rank} with digest {digest}"

    def check_unverified(self, stop: threading.Event | None = None) -> list[Holding]:
        """Check every copy not yet known to be intact or corrupt, newest iteration first (the copies a
        recovery most likely reads), until `stop` is set; returns the copies found corrupt."""
        unknown = sorted(
            (h for h in self.inventory() if h.verified is None), key=lambda h: (-h.iteration, h.tier, h.rank)
        )
        corrupt = []
        for holding in unknown:
            if stop is not None and stop.is_set():
                break
            manifest = self._committed_manifest(holding.tier, holding.rank, holding.iteration, holding.digest)
            problem = None if manifest is None else self.check(holding.tier, holding.rank, manifest)
            if problem is not None and problem != OVERWRITTEN:
                corrupt.append(replace(holding, verified=False, problem=problem))
        return corrupt

    def _committed_manifest(
        self, tier: Tier, rank: int, iteration: int | None, digest: str
    ) -> Manifest | None:
        try:
            committed = self._store(tier, rank).committed()
        except CheckpointError:
            return None
        return next((m for m in committed if iteration in (None, m.iteration) and m.digest == digest), None)

    def _holding(self, tier: Tier, rank: int, store: SlotStore, manifest: Manifest, check: bool) -> Holding:
        problem = store.condemned(manifest)
        verified: bool | None = False if problem is not None else None
        if verified is None:
            with self._lock:
                known = _checked_key(tier, rank, manifest.iteration, manifest.digest) in self._intact
            if known:
                verified = True
            elif check:
                problem = self.check(tier, rank, manifest)
                verified = problem is None
        return Holding(
            rank=rank,
            iteration=manifest.iteration,
            tier=tier,
            digest=manifest.digest,
            data_bytes=manifest.data_bytes,
            committed_at=manifest.committed_at,
            verified=verified,
            generation=manifest_generation(manifest),
            problem=problem,
        )

    def summary(self) -> dict[str, dict[int, int]]:
        """Newest committed iteration per rank, per tier: what heartbeats carry."""
        out: dict[str, dict[int, int]] = {"local": {}, "replicas": {}}
        for tier, key in (("local", "local"), ("replica", "replicas")):
            for rank in self.ranks(tier):  # type: ignore[arg-type]
                newest = self.newest(tier, rank)  # type: ignore[arg-type]
                if newest is not None:
                    out[key][rank] = newest.iteration
        return out

    def copy_engine(self) -> CopyEngine:
        with self._lock:  # inventories can run on two threads at once; one pool is enough
            if self._engine is None:
                self._engine = CopyEngine()
            return self._engine

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    def remove(self) -> None:
        """Free the machine's shared memory (the job finished)."""
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)
