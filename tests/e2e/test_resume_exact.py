"""Exact resumption of an epoch loop over a DataLoader (the README's "Resuming exactly"): after a fault in
the middle of an epoch (a killed training process, a lost machine, a lost placement group), Castor's
recovery resumes the same model, optimizer, data order and random draws as a run that was never
interrupted, bit for bit, to the last iteration."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import REPO, LocalCluster, read_events, wait_until
from tests.e2e.exact_runs import check_same_as_reference, uninterrupted_run
from tests.e2e.recovery_checks import (
    check_consistent_restore,
    check_event,
    kill_training_process,
    machine_loss_bound,
    newest_iteration,
    recovered_events,
    replicated_iteration,
)

pytestmark = pytest.mark.slow

WORKLOAD = REPO / "tests" / "e2e" / "workloads" / "train_epochs.py"
WORLD = 4
EPOCHS, SAMPLES, BATCH = 3, 512, 16
BATCHES = SAMPLES // WORLD // BATCH  # per epoch and rank: 8


def command(log_dir: Path, sleep: float) -> list[str]:
    return [
        sys.executable,
        str(WORKLOAD),
        f"--epochs={EPOCHS}",
        f"--samples={SAMPLES}",
        f"--batch-size={BATCH}",
        f"--sleep={sleep}",
        f"--log-dir={log_dir}",
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """One uninterrupted run for every fault."""
    log_dir = tmp_path_factory.mktemp("reference")
    return uninterrupted_run(command(log_dir, sleep=0), WORLD, log_dir)


# fault -> (machines lost, failure kind, slowest tier, iterations that may be lost)
FAULTS = {
    "process_kill": ((), "software", "local", 1),
    "machine_loss": ((2,), "hardware", "peer", 1),
    "group_loss": ((2, 3), "hardware", "persistent", None),  # back to the newest persisted iteration
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_dataloader_epoch_loop_resumes_bit_exact_after_a_fault_mid_epoch(
    cluster: LocalCluster, tmp_path: Path, fault: str, reference: dict[int, list[dict[str, Any]]]
) -> None:
    lost, kind, tier, max_lost = FAULTS[fault]

    logs = tmp_path / "logs"
    # A long heartbeat timeout for the process kill: on a host saturated by 4 machines' training, a late
    # heartbeat must not turn its software failure into a machine loss.
    cluster.start_root(heartbeat_timeout_s="6" if lost else "15")
    # Persisted every 4 iterations: iterations 8 and 12 are inside the second epoch.
    cluster.launch_job(command(logs, sleep=0.3), machines=WORLD, replicas=2, persist_every=4)
    # The fault strikes in the middle of the second epoch (batches 2..5 of 8).
    wait_until(
        lambda: (n := newest_iteration(logs)) >= BATCHES and 2 <= n % BATCHES <= 5,
        120,
        "the middle of an epoch",
        0.02,
    )
    replicated = replicated_iteration(cluster)
    if lost:
        machines = [cluster.root_machine(rank) for rank in lost]
        for machine in machines:
            cluster.kill_machine(machine)
    else:
        kill_training_process(logs, rank=1)
    reached = newest_iteration(logs)
    events = recovered_events(cluster, max(1, len(lost)))
    for event in events:
        check_event(event, kind=kind, tier=tier, replaced=bool(lost))
    if tier == "peer":
        max_lost = machine_loss_bound(reached, replicated)
    restored = check_consistent_restore(logs, WORLD, reached, max_lost=max_lost)
    assert restored % BATCHES != BATCHES - 1, "resumed inside an epoch, not at its end"
    cluster.wait_for_job("completed")

    events = read_events(logs)
    check_same_as_reference(events, reference, EPOCHS * BATCHES)
    for rank in range(WORLD):
        resumed = [e for e in events[rank] if e["event"] == "iteration" and e["iteration"] == restored + 1]
        assert resumed and resumed[-1]["epoch"] == restored // BATCHES
