"""Effective training time ratio (ETTR) of a training run, simulated: the share of a period's wall-clock time
that moved training forward, for Castor and the GEMINI paper's baselines (Section 7.5, Figure 15).

Pure and deterministic: a seed fixes every draw; no I/O. Two models:

* **Event model** (Castor, `simulate_castor`). Machine failures arrive as a Poisson process (rate per
  machine per day, over wall-clock time, whatever the run is doing), each on a uniformly drawn machine,
  hardware with probability `hardware_fraction`. Training runs iterations of `iteration_s` stretched by
  the checkpoint overhead; every iteration's checkpoint is committed locally `local_commit_s` after the
  iteration ends and on its m-1 peers `replicate_s` later (a replication longer than an iteration makes
  the agents skip saves, so replicas come every ceil(replicate_s / iteration) iterations); every K-th
  iteration is uploaded to the persistent tier once committed locally, which takes N x checkpoint / remote
  bandwidth (uploads never overlap: K is raised to what the bandwidth sustains). A failure stops training on
  every machine (a global rollback). The recovery: detection (+ classification), replacement of
  hardware-failed machines (a standby if the pool has one, else a new launch; the pool refills by
  launching), restore of the newest iteration every rank has, as the recovery planner picks it (local
  memory, a peer's memory when a machine was replaced, or the persistent tier when a rank lost every holder,
  with the placement math of `placement.py`, or when the persistent tier's iteration is newer: then costed
  as the whole job's download), and restart warm-up. The rollback abandons the history after the restored
  iteration (an upload of it no longer counts). A failure during a recovery joins it: its machines are
  added to the failed set (so two failures of one placement group send the run to the persistent tier),
  and restore and warm-up start again once it is detected (and its machine replaced). Lost work is exactly
  the iterations since the restored checkpoint plus the partial iteration. ETTR = kept iterations x
  iteration time / period.
* **Flat model** (`simulate_flat`, the paper's artifact, `examples/SOSP_AE/AE_figures.ipynb`): every failure
  costs a flat wall-clock time (9 min GEMINI, 112 min Strawman, 26 min HighFreq), and checkpointing costs
  a fixed share of the period (HighFreq: 80 s of blocking `torch.save` every 560 s). The paper computes
  ratio = efficiency - cost x failures / period and clips at 0. Here the failures are drawn as in the event
  model and their costs are queued back to back when they overlap (the paper's linear accounting: each
  failure costs its full amount; a backlog that outgrows the period leaves nothing, which is the paper's
  clip at 0, Strawman from about 900 machines). The checkpoint share is subtracted from the whole period,
  as the paper does.

Interpretation choices (the paper's model is a closed formula; the simulation keeps it exactly):
the per-failure cost includes the work lost (the paper folds 1/(2f) into it), failures arrive over
wall-clock time, and Figure 15b applies 1.5 % of the machines per day.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from services.root.domain.placement import StrategyRequest, plan_placement

DAY_S = 86_400.0

SystemName = Literal["gemini", "strawman", "highfreq"]


@dataclass(frozen=True)
class FlatSystem:
    """A system as the paper's Figure 15 models it: a flat cost per failure and a no-failure efficiency."""

    name: str
    cost_per_failure_s: float
    efficiency: float  # share of the period left after checkpointing (no failures)


# The paper's constants (AE_figures.ipynb): day = 1440 min.
PAPER_SYSTEMS: dict[SystemName, FlatSystem] = {
    # ratio = 1 - 9 F / 1440
    "gemini": FlatSystem("GEMINI (paper)", 9 * 60.0, 1.0),
    # ratio = 1 - (2*8 + 90 + 6) F / 1440: t_ckpt = t_rtvl = 8 min, half of 3 h lost, 6 min restart
    "strawman": FlatSystem("Strawman (paper)", (2 * 8 + 90 + 6) * 60.0, 1.0),
    # ratio = 480 / (80 + 480) - (2.5 * 8 + 6) F / 1440: 80 s torch.save blocks every 560 s cycle
    "highfreq": FlatSystem("HighFreq (paper)", (2.5 * 8 + 6) * 60.0, 480.0 / 560.0),
}

# Figure 15 as the notes read it off the plots: (machines, failures per day) -> system -> ratio.
PAPER_FIGURE15: dict[tuple[int, float], dict[SystemName, float]] = {
    (16, 1.0): {"gemini": 0.994, "highfreq": 0.839, "strawman": 0.922},
    (16, 8.0): {"gemini": 0.950, "highfreq": 0.713, "strawman": 0.378},
    (200, 3.0): {"gemini": 0.981, "highfreq": 0.803, "strawman": 0.767},
    (1000, 15.0): {"gemini": 0.906, "highfreq": 0.586, "strawman": 0.0},
}


@dataclass(frozen=True)
class RecoveryCosts:
    """Castor's per-phase recovery costs, seconds, in the setting simulated (see `scaled_costs`)."""

    detect_software_s: float  # a process exit, reported by its agent
    detect_hardware_s: float  # a lost machine: detection and classification
    replace_standby_s: float  # a standby machine taking the failed rank
    replace_launch_s: float  # a newly launched machine taking the failed rank
    restore_local_s: float  # every rank restored from its own machine's memory
    restore_peer_s: float  # replacements fetch from a peer (the others restore locally)
    restore_persistent_fixed_s: float  # fixed part; the download (N x checkpoint / remote bw) is added
    warmup_software_s: float  # restart to the first iteration under way (that iteration is productive)
    warmup_hardware_s: float
    # A whole persistent restore as a job recorded it (download included, `costs_from_failures`): used as is,
    # in place of the fixed part plus the download; 0: not measured.
    restore_persistent_measured_s: float = 0.0


@dataclass(frozen=True)
class SimInputs:
    machines: int = 1000
    replicas: int = 2
    strategy: StrategyRequest = "auto"
    failures_per_machine_day: float = 0.015
    hardware_fraction: float = 0.0
    iteration_s: float = 62.0
    checkpoint_gb: float = 75.2  # per machine: 8 GPUs x 9.4 GB
    network_gbps: float = 100.0  # per machine, Gbit/s
    persist_every: int = 174  # K iterations (3 h at 62 s); 0: no persistent tier
    remote_gbps: float = 20.0  # aggregate bandwidth of the persistent tier, Gbit/s
    standby_machines: int = 1_000_000  # pool size; 0: every replacement is a new launch
    local_commit_s: float = 0.68  # local copy committed this long after the iteration ends
    checkpoint_overhead: float = 0.0003  # share of iteration time the checkpointing costs training
    persist_copy_s: float = 0.0  # training stall per persisted checkpoint
    period_days: float = 30.0
    seeds: int = 50
    first_seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.machines >= 1, "machines must be at least 1"),
            (1 <= self.replicas <= self.machines, "replicas must be between 1 and machines"),
            (self.failures_per_machine_day >= 0, "failure rate must not be negative"),
            (0.0 <= self.hardware_fraction <= 1.0, "hardware_fraction must be between 0 and 1"),
            (self.iteration_s > 0, "iteration_s must be positive"),
            (self.checkpoint_gb >= 0, "checkpoint_gb must not be negative"),
            (self.network_gbps > 0 and self.remote_gbps > 0, "bandwidths must be positive"),
            (self.persist_every >= 0, "persist_every must not be negative"),
            (self.standby_machines >= 0, "standby_machines must not be negative"),
            (self.checkpoint_overhead >= 0, "checkpoint_overhead must not be negative"),
            (self.period_days > 0, "period_days must be positive"),
            (self.seeds >= 1, "seeds must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def failures_per_day(self) -> float:
        return self.failures_per_machine_day * self.machines

    @property
    def replicate_s(self) -> float:
        """Time to send m-1 replicas of a machine's checkpoint over its network link."""
        return (self.replicas - 1) * self.checkpoint_gb * 8 / self.network_gbps

    @property
    def upload_s(self) -> float:
        """Time to write one checkpoint of the whole job to the persistent tier."""
        return self.machines * self.checkpoint_gb * 8 / self.remote_gbps

    @property
    def iteration_wall_s(self) -> float:
        return self.iteration_s * (1 + self.checkpoint_overhead)

    @property
    def effective_persist_every(self) -> int:
        """K raised to what the remote bandwidth sustains (one upload at a time); 0: no persistent tier."""
        if self.persist_every == 0:
            return 0
        return max(self.persist_every, math.ceil(self.upload_s / self.iteration_wall_s))


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # 5th percentile over seeds
    high: float  # 95th percentile over seeds

    def as_dict(self) -> dict[str, float]:
        return {"mean": round(self.mean, 4), "p5": round(self.low, 4), "p95": round(self.high, 4)}


WASTE_CAUSES = ("detection", "replacement", "restore", "warmup", "interrupted", "lost_work", "checkpointing")


@dataclass
class RunResult:
    ettr: float
    failures: int = 0
    recoveries: int = 0
    from_memory: int = 0
    from_persistent: int = 0
    waste_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WASTE_CAUSES, 0.0))


@dataclass(frozen=True)
class Summary:
    ettr: Interval
    failures_per_day: float
    recoveries: int
    memory_recovery_share: float  # recoveries served from CPU memory / all recoveries (1.0 when none)
    persistent_recoveries: int
    waste_share: dict[str, float]  # mean share of the period, by cause
    runs: int

    def as_dict(self) -> dict[str, object]:
        return {
            "ettr": self.ettr.as_dict(),
            "failures_per_day": round(self.failures_per_day, 4),
            "recoveries": self.recoveries,
            "memory_recovery_share": round(self.memory_recovery_share, 6),
            "persistent_recoveries": self.persistent_recoveries,
            "waste_share": {k: round(v, 6) for k, v in self.waste_share.items()},
            "runs": self.runs,
        }


@dataclass(frozen=True)
class Failure:
    at: float
    machine: int
    hardware: bool


def draw_failures(inputs: SimInputs, seed: int) -> list[Failure]:
    """Failures over the period: a Poisson process of rate N x rate per machine, uniform machines."""
    rng = random.Random(seed)
    rate = inputs.failures_per_day / DAY_S
    period = inputs.period_days * DAY_S
    failures: list[Failure] = []
    if rate <= 0:
        return failures
    t = rng.expovariate(rate)
    while t < period:
        machine = rng.randrange(inputs.machines)
        failures.append(Failure(t, machine, rng.random() < inputs.hardware_fraction))
        t += rng.expovariate(rate)
    return failures


def _interval(values: Sequence[float]) -> Interval:
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return Interval(sum(ordered) / len(ordered), pct(0.05), pct(0.95))


def _summarize(inputs: SimInputs, runs: list[RunResult]) -> Summary:
    period = inputs.period_days * DAY_S
    recoveries = sum(r.recoveries for r in runs)
    memory = sum(r.from_memory for r in runs)
    waste = {c: sum(r.waste_s[c] for r in runs) / len(runs) / period for c in WASTE_CAUSES}
    return Summary(
        ettr=_interval([r.ettr for r in runs]),
        failures_per_day=sum(r.failures for r in runs) / len(runs) / inputs.period_days,
        recoveries=recoveries,
        memory_recovery_share=memory / recoveries if recoveries else 1.0,
        persistent_recoveries=sum(r.from_persistent for r in runs),
        waste_share=waste,
        runs=len(runs),
    )


# -- the paper's flat model ---------------------------------------------------------------------------------


def run_flat(system: FlatSystem, inputs: SimInputs, seed: int) -> RunResult:
    period = inputs.period_days * DAY_S
    busy_until = 0.0
    down = 0.0
    failures = draw_failures(inputs, seed)
    for failure in failures:
        start = max(busy_until, failure.at)
        busy_until = start + system.cost_per_failure_s
        down += max(0.0, min(busy_until, period) - start)
    ettr = max(0.0, system.efficiency - down / period)
    result = RunResult(ettr, failures=len(failures), recoveries=len(failures), from_memory=len(failures))
    result.waste_s["lost_work"] = down
    result.waste_s["checkpointing"] = (1 - system.efficiency) * period
    return result


def simulate_flat(system: FlatSystem, inputs: SimInputs) -> Summary:
    seeds = range(inputs.first_seed, inputs.first_seed + inputs.seeds)
    return _summarize(inputs, [run_flat(system, inputs, seed) for seed in seeds])


# -- Castor: the event model --------------------------------------------------------------------------------


class _Pool:
    """Standby machines: each becomes available again (a launched replacement joins the pool) after use."""

    def __init__(self, size: int, launch_s: float, standby_s: float) -> None:
        self.size = size
        self.launch_s = launch_s
        self.standby_s = standby_s
        self.back_at: list[float] = []  # when the used standbys' refills are ready

    def replace(self, at: float) -> float:
        """A hardware-failed machine's replacement requested at `at`; returns when it takes the rank."""
        self.back_at = [t for t in self.back_at if t > at]
        if self.size == 0:
            return at + self.launch_s
        if len(self.back_at) < self.size:
            self.back_at.append(at + self.launch_s)
            return at + self.standby_s
        # The pool is empty: the earlier of a new launch and the next refill.
        first = min(self.back_at)
        self.back_at.remove(first)
        ready = min(at + self.launch_s, first + self.standby_s)
        self.back_at.append(ready + self.launch_s)
        return ready


def run_castor(
    inputs: SimInputs,
    costs: RecoveryCosts,
    seed: int,
    replicas: Replicas,
    failures: Sequence[Failure] | None = None,
) -> RunResult:
    """One run of the event model; `failures` replaces the seeded draw (tests)."""
    period = inputs.period_days * DAY_S
    it_wall = inputs.iteration_wall_s
    k_persist = inputs.effective_persist_every
    persist_stall = inputs.persist_copy_s / k_persist if k_persist else 0.0
    it_wall += persist_stall
    rep_every = max(1, math.ceil(inputs.replicate_s / it_wall))
    upload_s = inputs.upload_s
    restore_persistent = costs.restore_persistent_measured_s or (costs.restore_persistent_fixed_s + upload_s)
    pool = _Pool(inputs.standby_machines, costs.replace_launch_s, costs.replace_standby_s)
    if failures is None:
        failures = draw_failures(inputs, seed)
    result = RunResult(0.0, failures=len(failures))

    progress = 0  # iterations kept at the start of the current training segment
    persisted = 0  # newest iteration of the current history complete on the persistent tier (0: the start)
    seg_start = 0.0  # training (re)started here
    i = 0
    while i < len(failures):
        first = failures[i]
        # Training from seg_start to the failure.
        s = first.at - seg_start
        done = int(s // it_wall)
        partial = s - done * it_wall
        current = progress + done

        newest_local = _newest(progress, current, 1, seg_start, it_wall, inputs.local_commit_s, first.at)
        # A replica is sent once the local copy is committed.
        replica_delay = inputs.local_commit_s + inputs.replicate_s
        newest_replica = _newest(progress, current, rep_every, seg_start, it_wall, replica_delay, first.at)
        if k_persist:
            # Persist points are global multiples of K, uploaded once committed locally; an upload still
            # under way at the failure does not count (conservative: the surviving agents would finish it).
            top = (current // k_persist) * k_persist
            persist_delay = inputs.local_commit_s + upload_s
            while top > progress and seg_start + (top - progress) * it_wall + persist_delay > first.at:
                top -= k_persist
            if top > progress:
                persisted = max(persisted, top)

        # The recovery, with every failure that arrives before it completes.
        start = first.at
        hw_failed: set[int] = set()
        any_hw = False
        ready = start
        last_at = start
        last_detect = start
        j = i
        end = start
        while True:
            f = failures[j]
            detect = costs.detect_hardware_s if f.hardware else costs.detect_software_s
            detected = f.at + detect
            last_at, last_detect = f.at, detected
            if f.hardware:
                any_hw = True
                hw_failed.add(f.machine)
                ready = max(ready, pool.replace(detected))
            ready = max(ready, detected)
            # The newest iteration every rank has in memory (None: some rank lost every holder); the
            # planner takes the persistent tier's instead when it is newer.
            in_memory: int | None
            if replicas.lost(hw_failed):
                in_memory = None
            elif any_hw:
                in_memory = min(newest_replica, newest_local)
            else:
                in_memory = newest_local
            if in_memory is None or (k_persist and persisted > in_memory):
                tier = "persistent"
                restored = persisted if k_persist else 0
                restore = restore_persistent
            else:
                tier = "peer" if any_hw else "local"
                restored = in_memory
                restore = costs.restore_peer_s if any_hw else costs.restore_local_s
            warmup = costs.warmup_hardware_s if any_hw else costs.warmup_software_s
            end = ready + restore + warmup
            j += 1
            if j >= len(failures) or failures[j].at >= end:
                break
        result.recoveries += 1
        if tier == "persistent":
            result.from_persistent += 1
        else:
            result.from_memory += 1
        # The rollback abandons every iteration after the restored one, uploaded or not.
        persisted = min(persisted, restored)

        # Accounting (capped at the period's end).
        w = result.waste_s
        w["lost_work"] += (current - restored) * it_wall + partial
        clip = min(end, period)
        interrupted = max(0.0, min(last_at, clip) - start)
        detection = max(0.0, min(last_detect, clip) - min(last_at, clip))
        replacement = max(0.0, min(ready, clip) - min(last_detect, clip))
        restoring = max(0.0, min(ready + restore, clip) - min(ready, clip))
        warming = max(0.0, clip - min(ready + restore, clip))
        w["interrupted"] += interrupted
        w["detection"] += detection
        w["replacement"] += replacement
        w["restore"] += restoring
        w["warmup"] += warming

        progress, seg_start = restored, end
        i = j
        if seg_start >= period:
            break

    if seg_start < period:
        done = int((period - seg_start) // it_wall)
        progress += done
        result.waste_s["lost_work"] += (period - seg_start) - done * it_wall  # the unfinished iteration
    result.ettr = progress * inputs.iteration_s / period
    result.waste_s["checkpointing"] = progress * (it_wall - inputs.iteration_s)
    return result


def _newest(
    base: int, upto: int, every: int, seg_start: float, it_wall: float, delay: float, at: float
) -> int:
    """The newest iteration in (base, upto], a multiple of `every` after base, whose checkpoint was complete
    (`delay` after the iteration ended) by `at`; base itself if none."""
    top = base + ((upto - base) // every) * every
    while top > base and seg_start + (top - base) * it_wall + delay > at:
        top -= every
    return top


@dataclass(frozen=True)
class Replicas:
    """Who holds whose checkpoint, from the placement (`placement.py`): holders[r] are the machines holding
    rank r's checkpoint; held_by[m] the ranks whose checkpoint machine m holds (the only ones it can lose)."""

    holders: tuple[tuple[int, ...], ...]
    held_by: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, inputs: SimInputs) -> Replicas:
        placement = plan_placement(inputs.machines, inputs.replicas, inputs.strategy)
        holders = tuple(placement.holders(r) for r in range(inputs.machines))
        held: list[list[int]] = [[] for _ in range(inputs.machines)]
        for rank, hs in enumerate(holders):
            for h in hs:
                held[h].append(rank)
        return cls(holders, tuple(tuple(r) for r in held))

    def lost(self, failed: set[int]) -> bool:
        """Whether some rank lost every machine holding its checkpoint."""
        return any(all(h in failed for h in self.holders[r]) for m in failed for r in self.held_by[m])


def simulate_castor(inputs: SimInputs, costs: RecoveryCosts) -> Summary:
    replicas = Replicas.of(inputs)
    seeds = range(inputs.first_seed, inputs.first_seed + inputs.seeds)
    return _summarize(inputs, [run_castor(inputs, costs, seed, replicas) for seed in seeds])


# -- Castor's measured costs, scaled to a setting -----------------------------------------------------------

# What this project's benchmarks measured (README "Measured figures"): benchmarks/recovery.py (4 local
# machines, m = 2, ~50 MB of state per rank, 0.1 s iterations) and benchmarks/store.py (1 GiB).
MEASURED: dict[str, float] = {
    "software_detect_s": 0.096,  # a process exit, reported at once
    "software_classified_s": 0.0,  # phases_s: seconds after detection
    "software_restored_s": 0.85,
    "software_resumed_s": 2.557,
    "hardware_classified_s": 1.121,
    "hardware_replaced_s": 2.689,  # the local operator starting an agent: a standby taking the rank
    "hardware_restored_s": 3.593,
    "hardware_resumed_s": 7.12,
    "group_loss_replaced_s": 2.0,
    "group_loss_restored_s": 3.246,
    "etcd_detect_s": 1.19,  # a lost machine through etcd (1 s lease)
    "benchmark_iteration_s": 0.1,  # the recovery benchmark's iteration (a lower bound: its sleep)
    "restore_gbps": 12.41,  # GB/s, verify + restore into the model's tensors (store.py)
    "save_gbps": 13.85,  # GB/s, copy + checksums + commit (store.py)
    "stall_ms_per_gib": 1.91,  # training thread blocked per asynchronous save of 1 GiB (store.py)
}
# Not measured here: launching a new machine. The paper's Figure 14: 4-7 minutes for a p4d from the ASG.
PAPER_LAUNCH_S = 330.0


@dataclass(frozen=True)
class Setting:
    """The hardware and model a projection is for (defaults: the paper's GPT-2 100B on p4d)."""

    iteration_s: float = 62.0
    gb_per_gpu: float = 9.4
    gpus_per_machine: int = 8
    network_gbps: float = 100.0

    def __post_init__(self) -> None:
        # The costs divide by the iteration time and the link's bandwidth.
        if not (self.iteration_s > 0 and self.network_gbps > 0):
            raise ValueError("iteration_s and network_gbps must be positive")
        if self.gb_per_gpu < 0 or self.gpus_per_machine < 1:
            raise ValueError("gb_per_gpu must not be negative and gpus_per_machine must be at least 1")


def scaled_costs(
    setting: Setting, measured: dict[str, float] | None = None
) -> tuple[RecoveryCosts, dict[str, float]]:
    """Castor's measured per-phase costs moved to `setting`: the fixed parts (detection, classification,
    inventories, planning, process restart) as measured; the data-dependent parts re-derived from the
    measured rates: a local restore moves the machine's whole checkpoint at the measured restore rate (as if
    its GPUs restored one after another), a peer restore and each replication move it over the machine's
    network link, a local commit is one GPU's shard at the measured save rate, and the checkpoint overhead is
    the measured asynchronous-save stall per GiB times a GPU's shard, per iteration. Returns the costs and
    the input overrides (local_commit_s, checkpoint_overhead)."""
    m = MEASURED if measured is None else measured
    machine_gb = setting.gb_per_gpu * setting.gpus_per_machine
    peer_s = machine_gb * 8 / setting.network_gbps
    costs = RecoveryCosts(
        detect_software_s=m["software_detect_s"] + m["software_classified_s"],
        detect_hardware_s=m["etcd_detect_s"] + m["hardware_classified_s"],
        replace_standby_s=m["hardware_replaced_s"] - m["hardware_classified_s"],
        replace_launch_s=PAPER_LAUNCH_S,
        restore_local_s=m["software_restored_s"]
        - m["software_classified_s"]
        + machine_gb / m["restore_gbps"],
        restore_peer_s=m["hardware_restored_s"] - m["hardware_replaced_s"] + peer_s,
        restore_persistent_fixed_s=m["group_loss_restored_s"] - m["group_loss_replaced_s"],
        warmup_software_s=max(
            0.0, m["software_resumed_s"] - m["software_restored_s"] - m["benchmark_iteration_s"]
        ),
        warmup_hardware_s=max(
            0.0, m["hardware_resumed_s"] - m["hardware_restored_s"] - m["benchmark_iteration_s"]
        ),
    )
    stall_s = m["stall_ms_per_gib"] / 1000 * setting.gb_per_gpu / (2**30 / 1e9)
    overrides = {
        "local_commit_s": setting.gb_per_gpu / m["save_gbps"],
        "checkpoint_overhead": stall_s / setting.iteration_s,
    }
    return costs, overrides


def castor_inputs(setting: Setting, **changes: Any) -> tuple[SimInputs, RecoveryCosts]:
    """SimInputs for Castor in `setting` with its scaled measured costs; `changes` override any input."""
    costs, overrides = scaled_costs(setting)
    base = SimInputs(
        iteration_s=setting.iteration_s,
        checkpoint_gb=setting.gb_per_gpu * setting.gpus_per_machine,
        network_gbps=setting.network_gbps,
        local_commit_s=overrides["local_commit_s"],
        checkpoint_overhead=overrides["checkpoint_overhead"],
    )
    return replace(base, **changes), costs


@dataclass(frozen=True)
class PhaseRecord:
    """One recorded failure's phases (seconds), as a real job's failure events give them."""

    kind: str  # software | hardware | unknown
    tier: str | None  # local | peer | persistent | None
    phases: dict[str, float]  # detect, classify, replace, restore, resume


def costs_from_failures(
    records: Sequence[PhaseRecord], iteration_s: float, fallback: RecoveryCosts
) -> tuple[RecoveryCosts, dict[str, int]]:
    """Per-phase medians of a job's recorded failures as recovery costs (a phase never observed keeps the
    fallback's value). The resume phase ends with the first iteration after the restore, which is kept
    work: warm-up = resume - one iteration. A recorded persistent restore includes its download, so it feeds
    `restore_persistent_measured_s` (the job's whole restore), not the fixed part. Returns the costs and how
    many failures fed each cost."""

    def median(values: list[float]) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    def pick(kind: str | None, tier: str | None, *names: str) -> list[float]:
        return [
            sum(r.phases.get(n, 0.0) for n in names)
            for r in records
            if (kind is None or r.kind == kind) and (tier is None or r.tier == tier) and names[0] in r.phases
        ]

    samples = {
        "detect_software_s": pick("software", None, "detect", "classify"),
        "detect_hardware_s": pick("hardware", None, "detect", "classify"),
        "replace_standby_s": pick("hardware", None, "replace"),
        "restore_local_s": pick(None, "local", "restore"),
        "restore_peer_s": pick(None, "peer", "restore"),
        "restore_persistent_measured_s": pick(None, "persistent", "restore"),
        "warmup_software_s": [max(0.0, v - iteration_s) for v in pick("software", None, "resume")],
        "warmup_hardware_s": [max(0.0, v - iteration_s) for v in pick("hardware", None, "resume")],
    }
    values = {name: median(vals) for name, vals in samples.items()}
    costs = replace(fallback, **{k: v for k, v in values.items() if v is not None})
    return costs, {k: len(v) for k, v in samples.items()}


# -- what to choose -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    persist_every: int
    ettr_by_replicas: dict[int, float]
    host_memory_gb: float  # per machine: m replicas x 2 versions of a machine's checkpoint
    reasons: tuple[str, ...]


def recommend(
    inputs: SimInputs, costs: RecoveryCosts, *, max_replicas: int = 4, tolerance: float = 0.0005
) -> Recommendation:
    """m: the smallest number of replicas whose simulated ETTR is within `tolerance` of the best m
    (1..max_replicas, same failure draws), as each replica costs host memory and network. Replicas only
    matter for hardware failures: inputs without any are judged with half of the failures hardware. K: the
    smallest K the persistent tier's bandwidth sustains, as Castor's uploads run off the training path and a
    smaller K loses less when a whole placement group is lost."""
    judged = inputs if inputs.hardware_fraction > 0 else replace(inputs, hardware_fraction=0.5)
    by_m: dict[int, float] = {}
    for m in range(1, min(max_replicas, inputs.machines) + 1):
        by_m[m] = simulate_castor(replace(judged, replicas=m), costs).ettr.mean
    best = max(by_m.values())
    m_choice = min(m for m, v in by_m.items() if v >= best - tolerance)
    k_choice = replace(inputs, replicas=m_choice, persist_every=1).effective_persist_every
    mix = "" if judged is inputs else " (judged with half of the failures hardware: the inputs have none)"
    reasons = (
        f"m={m_choice}: the smallest m within {tolerance} of the best simulated ETTR ({best:.4f}){mix}",
        f"K={k_choice}: one upload of {inputs.upload_s:.0f} s at {inputs.remote_gbps:g} Gbit/s per "
        f"{k_choice} iterations of {inputs.iteration_wall_s:.1f} s (the persistent tier's limit)",
    )
    return Recommendation(m_choice, k_choice, by_m, m_choice * 2 * inputs.checkpoint_gb, reasons)


def paper_setting(machines: int, failures_per_day: float, **changes: Any) -> SimInputs:
    """Figure 15's setting: `failures_per_day` over the whole cluster of `machines`."""
    return replace(
        SimInputs(machines=machines, failures_per_machine_day=failures_per_day / machines), **changes
    )


def reproduce_figure15(seeds: int = 50) -> dict[tuple[int, float], dict[SystemName, float]]:
    """The paper's Figure 15 points, simulated with the paper's flat model and constants."""
    out: dict[tuple[int, float], dict[SystemName, float]] = {}
    for n, f in PAPER_FIGURE15:
        inputs = paper_setting(n, f, seeds=seeds)
        out[(n, f)] = {
            name: simulate_flat(system, inputs).ettr.mean for name, system in PAPER_SYSTEMS.items()
        }
    return out
