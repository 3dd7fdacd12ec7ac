"""domain.summaries: a heartbeat summary keeps only what its machine can hold."""

from __future__ import annotations

from services.root.domain.summaries import confined_to_machine


def test_a_machine_keeps_its_own_ranks_commits_and_other_machines_replicas() -> None:
    summary = {
        "local": {"2": 10, "3": 11, "4": 99, "1": 99},
        "restored": {"3": 5, "9": 99},
        "newest_at_restore": {"2": 6},
        "stalled_s": {"2": 0.5, "0": 99.0},
        "save_calls": {"3": 4},
        "replicas": {"0": 9, "2": 99, "5": 8, "8": 99},
        "committed": 21,
    }
    # Machine 1 of 4, 2 processes each: it runs ranks 2 and 3 of 8.
    confined, dropped = confined_to_machine(summary, 1, 2, 8)
    assert confined == {
        "local": {"2": 10, "3": 11},
        "restored": {"3": 5},
        "newest_at_restore": {"2": 6},
        "stalled_s": {"2": 0.5},
        "save_calls": {"3": 4},
        "replicas": {"0": 9, "5": 8},
        "committed": 21,
    }
    assert dropped == [0, 1, 2, 4, 8, 9]
    assert summary["local"] == {"2": 10, "3": 11, "4": 99, "1": 99}, "the caller's summary is not changed"


def test_a_summary_within_its_machine_is_returned_whole() -> None:
    summary = {"local": {"0": 3}, "replicas": {"1": 2}, "session": "s"}
    assert confined_to_machine(summary, 0, 1, 2) == (summary, [])
    assert confined_to_machine({}, 0, 1, 2) == ({}, [])
