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
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class Holding:
    rank: int
    iteration: int
    tier: Tier
    digest: str
    data_bytes: int
    committed_at: float
    verified: bool | None  # None: not checked this time
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


def manifest_generation(manifest: Manifest) -> int:
    value = manifest.meta.get("generation", 1)
    return value if isinstance(value, int) and value >= 1 else 1


class Holdings:
    def __init__(self, root: str | Path, replica_bytes_max: Callable[[int], int | None] | None = None):
        """`replica_bytes_max(rank)`: the largest checkpoint of `rank` this machine stores for a peer
        (None: unbounded); the data plane refuses larger ones and replica slots never grow beyond it."""
        self.root = Path(root)
        self.replica_bytes_max: Callable[[int], int | None] = replica_bytes_max or (lambda rank: None)
        self._stores: dict[tuple[Tier, int], SlotStore] = {}
        self._lock = threading.Lock()
        self._engine: CopyEngine | None = None

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

    def has_local(self, rank: int, iteration: int, digest: str | None = None) -> bool:
        """Whether `rank`'s own store holds a committed `iteration` (with content `digest`, when given)."""
        return any(
            m.iteration == iteration and (digest is None or m.digest == digest)
            for m in self.local_store(rank).committed()
        )

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
        that content counts (the same iteration number of another history does not)."""
        tiers: list[Tier] = ["local", "replica"] if tier == "any" else [tier]
        if iteration is None and tier == "any":
            newest = [(m.iteration, t) for t in tiers if (m := self.newest(t, rank)) is not None]
            tiers = [t for _, t in sorted(newest, key=lambda found: -found[0])] or tiers
        with ExitStack() as stack:
            for candidate in tiers:
                if not self.directory(candidate, rank).is_dir():
                    continue
                try:
                    opened = stack.enter_context(self._store(candidate, rank).open_read(iteration))
                except CheckpointNotFoundError:
                    continue
                if digest is None or opened[0].digest == digest:
                    break
                stack.close()  # another history's checkpoint of that iteration: let it go, look further
            else:
                wanted = "any checkpoint" if iteration is None else f"iteration {iteration}"
                if digest is not None:
                    wanted += f" with digest {digest}"
                raise CheckpointNotFoundError(f"this machine holds no {wanted} of rank {rank} ({tier})")
            yield opened

    def inventory(self, verify_checksums: bool = False) -> list[Holding]:
        """Every committed checkpoint held here; with `verify_checksums`, each one's bytes are checked."""
        found = []
        tiers: tuple[Tier, ...] = ("local", "replica")
        for tier in tiers:
            for rank in self.ranks(tier):
                try:
                    manifests = self._store(tier, rank).committed()
                except CheckpointError:
                    continue
                found += [self._holding(tier, rank, manifest, verify_checksums) for manifest in manifests]
        return found

    def _holding(self, tier: Tier, rank: int, manifest: Manifest, check: bool) -> Holding:
        verified: bool | None = None
        problem = None
        if check:
            try:
                with self._store(tier, rank).open_read(manifest.iteration) as (current, data):
                    verify(current, data, self._copy_engine())
                verified = True
            except CheckpointNotFoundError:
                verified, problem = False, "overwritten while being checked"
            except CheckpointError as exc:
                verified, problem = False, str(exc)
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

    def _copy_engine(self) -> CopyEngine:
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
