"""`castor simulate` in-process: the JSON document, the table, the SVG chart, YAML inputs and bad input."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from services.cli import main
from services.cli.simulate import records_from_failures

FAST = ["--seeds", "4", "--days", "10"]
SVG = "{http://www.w3.org/2000/svg}"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_last_line_and_svg(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    chart = tmp_path / "ettr.svg"
    code, out, _ = run(capsys, "--preset", "gemini-paper", "--json", "--plot", str(chart), *FAST)
    assert code == 0
    document = json.loads(out.strip().splitlines()[-1])
    assert document["paper_gemini_1000"] == pytest.approx(0.906, abs=0.01)
    assert document["castor_1000"] >= 0.99
    assert 0.98 < document["castor_1000_mixed"] <= document["castor_1000"]
    assert document["inputs"]["iteration_s"] == 62.0 and document["inputs"]["gb_per_gpu"] == 9.4
    assert document["inputs"]["sweep"] == "machines=16,200,1000"
    assert [row["machines"] for row in document["rows"]] == [16, 200, 1000]
    assert all(abs(p["simulated"]["gemini"] - p["paper"]["gemini"]) <= 0.01 for p in document["figure15"])
    assert document["recommended"]["replicas"] == 2

    root = ET.parse(chart).getroot()  # well-formed XML
    assert root.tag == f"{SVG}svg"
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 4  # Castor, GEMINI, HighFreq, Strawman
    assert all(len(line.get("points", "").split()) == 3 for line in lines)  # one point per sweep value
    assert "Castor (measured costs)" in chart.read_text()


def test_table_over_a_failure_rate_sweep(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--machines", "16", "--sweep", "failures_per_day=1,8", *FAST)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["N", "m", "failures/day"]
    assert lines[1].split()[:3] == ["16", "2", "1"] and lines[2].split()[:3] == ["16", "2", "8"]
    assert "Recommended: m = 2, K = " in out


def test_yaml_config_and_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text(
        "machines: 64\nreplicas: 3\nfailure_rate: 0.05\nhardware_fraction: 0.5\n"
        "costs:\n  restore_peer_s: 30\n  warmup_hardware_s: 120\n"
    )
    code, out, _ = run(
        capsys, "--config", str(config), "--replicas", "2", "--sweep", "machines=64", "--json", *FAST
    )
    assert code == 0
    document = json.loads(out.strip().splitlines()[-1])
    assert document["inputs"]["machines"] == 64 and document["inputs"]["replicas"] == 2  # the flag wins
    assert document["costs"]["restore_peer_s"] == 30 and document["costs"]["warmup_hardware_s"] == 120
    assert document["rows"][0]["hardware_fraction"] == 0.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep", "colour=1,2"], "--sweep takes KEY=V1,V2"),
        (["--sweep", "machines=a"], "values must be numbers"),
        (["--machines", "4", "--replicas", "5"], "replicas must be between 1 and machines"),
        (["--hardware-fraction", "2"], "hardware_fraction must be between 0 and 1"),
        # Before, tracebacks (ZeroDivisionError).
        (["--network-gbps", "0"], "network_gbps must be positive"),
        (["--iteration-s", "0"], "iteration_s and network_gbps must be positive"),
        (["--machines", "0", "--failures-per-day", "5"], "machines must be at least 1"),
    ],
)
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, _, err = run(capsys, *args, *FAST)
    assert code == 2 and message in err and err.count("\n") == 1


def test_bad_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("machines: 16\ncolour: blue\n")
    code, _, err = run(capsys, "--config", str(config))
    assert code == 2 and "unknown keys colour" in err
    config.write_text('machines: "1,000"\n')  # before, a traceback (ValueError from int())
    code, _, err = run(capsys, "--config", str(config))
    assert code == 2 and "1,000" in err and err.count("\n") == 1


def test_recorded_failures_become_phase_records() -> None:
    failures = [
        {
            "kind": "hardware",
            "state": "recovered",
            "tier": "peer",
            "detected_at": "2026-01-01T00:00:02+00:00",
            "classified_at": "2026-01-01T00:00:03+00:00",
            "replaced_at": "2026-01-01T00:00:10+00:00",
            "restored_at": "2026-01-01T00:00:12+00:00",
            "resumed_at": "2026-01-01T00:00:15+00:00",
            "details": {"last_heartbeat_at": "2026-01-01T00:00:00+00:00"},
        },
        {"kind": "software", "state": "recovering", "tier": None, "detected_at": "2026-01-01T00:00:00+00:00"},
    ]
    records = records_from_failures(failures)
    assert len(records) == 1  # only recovered failures have every phase
    assert records[0].phases == {
        "detect": 2.0,
        "classify": 1.0,
        "replace": 7.0,
        "restore": 2.0,
        "resume": 3.0,
    }
    assert records[0].tier == "peer"


def test_jobs_show_ettr_line() -> None:
    from services.cli.jobs import ettr_text

    ettr = {
        "ettr": 0.94,
        "wall_s": 1000.0,
        "productive_s": 940.0,
        "detection_s": 3.0,
        "replacement_s": 30.0,
        "restore_s": 5.0,
        "warmup_s": 10.0,
        "lost_iterations_s": 12.0,
        "checkpoint_overhead_s": None,
        "iteration_s": 4.0,
    }
    text = ettr_text(ettr)
    assert text.startswith("0.9400 of ")
    assert "replacement 30" in text and "lost iterations 12" in text and "stalls not measured" in text
    measured = ettr_text({**ettr, "checkpoint_overhead_s": 2.5})
    assert "checkpoint stalls 2.5 s" in measured and "not measured" not in measured
    assert ettr_text(None) == "-" and ettr_text({**ettr, "ettr": None}) == "-"
