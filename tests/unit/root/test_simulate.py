"""The ETTR simulator: the paper's Figure 15 reproduced, Castor's projection, and the model's invariants."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.root.domain.simulate import (
    PAPER_FIGURE15,
    PAPER_SYSTEMS,
    Failure,
    PhaseRecord,
    RecoveryCosts,
    Replicas,
    Setting,
    SimInputs,
    castor_inputs,
    costs_from_failures,
    draw_failures,
    paper_setting,
    recommend,
    reproduce_figure15,
    run_castor,
    simulate_castor,
    simulate_flat,
)

FIGURE15 = [(n, f, system, value) for (n, f), row in PAPER_FIGURE15.items() for system, value in row.items()]


@pytest.fixture(scope="module")
def reproduced() -> dict[tuple[int, float], dict[str, float]]:
    return reproduce_figure15(seeds=50)  # type: ignore[return-value]


@pytest.mark.parametrize(("machines", "failures_per_day", "system", "paper"), FIGURE15)
def test_reproduces_figure_15_within_001(
    reproduced: dict[tuple[int, float], dict[str, float]],
    machines: int,
    failures_per_day: float,
    system: str,
    paper: float,
) -> None:
    """16 machines at 1 and 8 failures a day; 200 and 1,000 machines at 1.5 % a day; all three systems."""
    assert reproduced[(machines, failures_per_day)][system] == pytest.approx(paper, abs=0.01)


def test_flat_model_is_the_papers_formula_when_failures_do_not_pile_up() -> None:
    inputs = paper_setting(16, 8.0, seeds=20)
    runs = simulate_flat(PAPER_SYSTEMS["highfreq"], inputs)
    # 480/560 - 26 min x failures / period, with the failures actually drawn
    expected = 480 / 560 - 26 * 60 * runs.failures_per_day / 86_400
    assert runs.ettr.mean == pytest.approx(expected, abs=0.002)


def test_strawman_backlog_outgrows_the_period_at_1000_machines() -> None:
    """112 min per failure at 15 failures a day is more than a day of downtime: nothing is left (the clip)."""
    inputs = paper_setting(1000, 15.0, seeds=10)
    assert simulate_flat(PAPER_SYSTEMS["strawman"], inputs).ettr.high < 0.03


@pytest.fixture(scope="module")
def castor_1000() -> tuple[SimInputs, RecoveryCosts]:
    return castor_inputs(Setting(), machines=1000, failures_per_machine_day=0.015, seeds=20)


def test_castor_projection_meets_the_target(castor_1000: tuple[SimInputs, RecoveryCosts]) -> None:
    inputs, costs = castor_1000
    software = simulate_castor(inputs, costs)
    mixed = simulate_castor(replace(inputs, hardware_fraction=0.5), costs)
    assert software.ettr.mean >= 0.99
    assert software.ettr.mean > simulate_flat(PAPER_SYSTEMS["gemini"], inputs).ettr.mean
    assert 0.98 < mixed.ettr.mean <= software.ettr.mean
    assert software.memory_recovery_share == 1.0  # software failures always restore from local memory


def test_no_failures_leaves_only_the_checkpoint_overhead() -> None:
    for overhead in (0.0, 0.01, 0.1):
        inputs, costs = castor_inputs(
            Setting(), machines=64, failures_per_machine_day=0.0, checkpoint_overhead=overhead, seeds=3
        )
        summary = simulate_castor(inputs, costs)
        assert summary.recoveries == 0
        assert summary.ettr.mean == pytest.approx(
            1 / (1 + overhead), abs=1e-4
        )  # up to one unfinished iteration
        assert summary.waste_share["checkpointing"] == pytest.approx(overhead / (1 + overhead), abs=1e-4)
    for system in PAPER_SYSTEMS.values():
        assert simulate_flat(system, paper_setting(16, 0.0, seeds=2)).ettr.mean == pytest.approx(
            system.efficiency
        )


@pytest.mark.parametrize("hardware_fraction", [0.0, 0.5, 1.0])
def test_ettr_falls_monotonically_with_the_failure_rate(hardware_fraction: float) -> None:
    means = []
    for rate in (0.0, 0.005, 0.015, 0.05, 0.15, 0.5):
        inputs, costs = castor_inputs(
            Setting(),
            machines=200,
            failures_per_machine_day=rate,
            hardware_fraction=hardware_fraction,
            seeds=10,
        )
        means.append(simulate_castor(inputs, costs).ettr.mean)
    assert means == sorted(means, reverse=True) and len(set(means)) == len(means)
    for system in PAPER_SYSTEMS.values():
        flat = [simulate_flat(system, paper_setting(16, f, seeds=10)).ettr.mean for f in (0.0, 1.0, 4.0, 8.0)]
        assert flat == sorted(flat, reverse=True)


def test_more_replicas_never_lower_recovery_from_memory() -> None:
    # Hardware failures only, slow replacements: overlapping failures hit whole placement groups.
    shares = []
    for m in (1, 2, 3, 4):
        inputs, costs = castor_inputs(
            Setting(),
            machines=16,
            replicas=m,
            failures_per_machine_day=2.0,
            hardware_fraction=1.0,
            standby_machines=0,
            seeds=20,
        )
        shares.append(simulate_castor(inputs, costs).memory_recovery_share)
    assert shares[0] == 0.0, "m=1: a lost machine's checkpoint is nowhere else"
    assert 0.0 < shares[1] < 1.0, "m=2: some pairs are lost together"
    assert shares == sorted(shares)


def test_a_lost_group_goes_to_the_persistent_tier_with_its_real_cost() -> None:
    inputs, costs = castor_inputs(
        Setting(), machines=16, persist_every=100, failures_per_machine_day=0.0, seeds=1
    )
    replicas = Replicas.of(inputs)
    assert replicas.lost({0, 1}) and not replicas.lost({0, 2}) and not replicas.lost({1, 2})

    at = 43_200.0  # machine 0 and its group peer 1 fail (hardware) 10 s apart, 12 h into the run
    result = run_castor(inputs, costs, 0, replicas, [Failure(at, 0, True), Failure(at + 10, 1, True)])
    from_peer = run_castor(inputs, costs, 0, replicas, [Failure(at, 0, True), Failure(at + 10, 2, True)])
    assert result.from_persistent == 1 and from_peer.from_memory == 1
    # The lost group costs the download of the whole job's checkpoint and the work since the newest upload.
    assert result.waste_s["restore"] == pytest.approx(costs.restore_persistent_fixed_s + inputs.upload_s)
    assert result.waste_s["lost_work"] > 60 * inputs.iteration_s
    assert from_peer.waste_s["lost_work"] < 2 * inputs.iteration_s
    assert result.ettr < from_peer.ettr


def test_deterministic_given_a_seed() -> None:
    inputs, costs = castor_inputs(
        Setting(), machines=100, failures_per_machine_day=0.05, hardware_fraction=0.5, seeds=5
    )
    assert simulate_castor(inputs, costs) == simulate_castor(inputs, costs)
    assert draw_failures(inputs, 1) != draw_failures(inputs, 2)


def test_costs_from_recorded_failures_are_per_phase_medians() -> None:
    records = [
        PhaseRecord("software", "local", {"detect": 0.0, "classify": 0.1, "restore": 1.0, "resume": 3.0}),
        PhaseRecord("software", "local", {"detect": 0.0, "classify": 0.3, "restore": 2.0, "resume": 5.0}),
        PhaseRecord("software", "local", {"detect": 0.0, "classify": 0.2, "restore": 9.0, "resume": 4.0}),
        PhaseRecord(
            "hardware",
            "peer",
            {"detect": 1.0, "classify": 1.0, "replace": 7.0, "restore": 4.0, "resume": 6.0},
        ),
    ]
    _inputs, fallback = castor_inputs(Setting())
    costs, counts = costs_from_failures(records, iteration_s=1.0, fallback=fallback)
    assert costs.detect_software_s == pytest.approx(0.2)
    assert costs.restore_local_s == 2.0
    assert costs.warmup_software_s == 3.0  # median resume 4 s, less the first (kept) iteration
    assert costs.detect_hardware_s == 2.0 and costs.replace_standby_s == 7.0 and costs.restore_peer_s == 4.0
    assert costs.restore_persistent_fixed_s == fallback.restore_persistent_fixed_s  # never observed
    assert counts["restore_local_s"] == 3 and counts["restore_persistent_fixed_s"] == 0


def test_recommends_two_replicas_and_the_smallest_sustainable_k(
    castor_1000: tuple[SimInputs, RecoveryCosts],
) -> None:
    inputs, costs = castor_1000
    advice = recommend(replace(inputs, hardware_fraction=0.5, seeds=5), costs)
    assert advice.replicas == 2  # m=1 sends every hardware failure to an 8-hour download
    assert advice.ettr_by_replicas[1] < 0.5 < advice.ettr_by_replicas[2]
    assert advice.persist_every * inputs.iteration_wall_s >= inputs.upload_s
    assert (advice.persist_every - 1) * inputs.iteration_wall_s < inputs.upload_s


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="replicas"):
        SimInputs(machines=4, replicas=5)
    with pytest.raises(ValueError, match="hardware_fraction"):
        SimInputs(hardware_fraction=1.5)
