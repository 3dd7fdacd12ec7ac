"""`castor simulate`: project a cluster's effective training time ratio (ETTR) with the simulator of
services/root/domain/simulate.py, for Castor and the GEMINI paper's baselines, and say which m and K to use.

Inputs come from flags, a YAML file (--config; the flag names with underscores as keys, and `costs:` with
RecoveryCosts fields), a preset, or a real job's recorded failures (--from-job: the per-phase medians).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, fields, replace
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from services.root.domain import simulate as sim

SWEEP_KEYS = (
    "machines",
    "failure_rate",
    "failures_per_day",
    "replicas",
    "hardware_fraction",
    "persist_every",
)
# Flag name -> (SimInputs field or Setting field, type)
INPUT_FLAGS: dict[str, tuple[str, type]] = {
    "machines": ("machines", int),
    "replicas": ("replicas", int),
    "strategy": ("strategy", str),
    "failure_rate": ("failures_per_machine_day", float),
    "hardware_fraction": ("hardware_fraction", float),
    "persist_every": ("persist_every", int),
    "remote_gbps": ("remote_gbps", float),
    "standby": ("standby_machines", int),
    "checkpoint_overhead": ("checkpoint_overhead", float),
    "days": ("period_days", float),
    "seeds": ("seeds", int),
}
SETTING_FLAGS: dict[str, tuple[str, type]] = {
    "iteration_s": ("iteration_s", float),
    "gb_per_gpu": ("gb_per_gpu", float),
    "gpus_per_machine": ("gpus_per_machine", int),
    "network_gbps": ("network_gbps", float),
}
COST_FIELDS = tuple(f.name for f in fields(sim.RecoveryCosts))
PRESETS = {
    # The paper's Figure 15 setting: GPT-2 100B on p4d (62 s iterations, 9.4 GB per GPU, 8 GPUs, 100 Gbit/s,
    # 20 Gbit/s to the persistent tier), 1.5 % of the machines failing a day, software failures.
    "gemini-paper": {"failure_rate": 0.015, "hardware_fraction": 0.0, "sweep": "machines=16,200,1000"},
}


class SimulateError(Exception):
    pass


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "simulate",
        help="project ETTR for Castor and the paper's baselines; recommend m and K",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from a preset (gemini-paper: Figure 15)")
    p.add_argument("--config", type=Path, metavar="FILE.yaml", help="inputs from a YAML file (flags win)")
    p.add_argument("--from-job", metavar="JOB", help="Castor's costs: per-phase medians of JOB's failures")
    p.add_argument("--machines", type=int, help="machines N (default 1000)")
    p.add_argument("--replicas", type=int, help="replicas m, the local copy included (default 2)")
    p.add_argument("--strategy", choices=["auto", "group", "mixed", "ring"], help="placement (default auto)")
    p.add_argument("--failure-rate", type=float, metavar="R", help="failures per machine per day (0.015)")
    p.add_argument("--failures-per-day", type=float, metavar="F", help="failures a day over the cluster")
    p.add_argument("--hardware-fraction", type=float, metavar="H", help="share of hardware failures (0)")
    p.add_argument("--iteration-s", type=float, metavar="S", help="iteration time (62)")
    p.add_argument("--gb-per-gpu", type=float, metavar="GB", help="checkpoint per GPU (9.4)")
    p.add_argument("--gpus-per-machine", type=int, metavar="G", help="GPUs per machine (8)")
    p.add_argument("--network-gbps", type=float, metavar="GBIT", help="machine network, Gbit/s (100)")
    p.add_argument("--persist-every", type=int, metavar="K", help="persistent checkpoint every K iterations")
    p.add_argument("--remote-gbps", type=float, metavar="GBIT", help="persistent tier, Gbit/s aggregate (20)")
    p.add_argument("--standby", type=int, metavar="N", help="standby machines (default: enough; 0: none)")
    p.add_argument("--replace-standby-s", type=float, metavar="S", help="a standby taking a rank")
    p.add_argument("--replace-launch-s", type=float, metavar="S", help="a new machine taking a rank (330)")
    p.add_argument("--checkpoint-overhead", type=float, metavar="X", help="share of iteration time")
    p.add_argument("--days", type=float, help="period simulated (30)")
    p.add_argument("--seeds", type=int, help="runs per point (50)")
    p.add_argument("--sweep", metavar="KEY=V1,V2", help=f"one of {', '.join(SWEEP_KEYS)}")
    p.add_argument("--plot", type=Path, metavar="FILE.svg", help="write an SVG chart of the sweep")
    p.add_argument("--json", action="store_true", help="print the results as JSON (last line)")
    p.add_argument("--root", metavar="URL", help="root service URL for --from-job [CASTOR_ROOT_URL]")
    p.add_argument("--token", help="admin token for --from-job [CASTOR_ADMIN_TOKEN]")
    p.add_argument("--request-timeout", type=float, default=10.0, metavar="S", help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


# -- inputs -------------------------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """Preset, then the YAML file, then flags (the later wins)."""
    values: dict[str, Any] = {}
    if args.preset:
        values.update(PRESETS[args.preset])
    if args.config:
        try:
            loaded = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SimulateError(f"cannot read {args.config}: {exc}") from None
        if not isinstance(loaded, dict):
            raise SimulateError(f"{args.config}: expected a mapping of inputs")
        known = {
            *INPUT_FLAGS,
            *SETTING_FLAGS,
            "failures_per_day",
            "sweep",
            "costs",
            "replace_standby_s",
            "replace_launch_s",
        }
        unknown = sorted(str(k) for k in loaded if str(k).replace("-", "_") not in known)
        if unknown:
            raise SimulateError(
                f"{args.config}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
    for key, value in vars(args).items():
        if value is not None and key not in (
            "preset",
            "config",
            "from_job",
            "plot",
            "json",
            "root",
            "token",
            "request_timeout",
            "handler",
            "command",
        ):
            values[key] = value
    return values


def build(
    values: dict[str, Any], costs_override: sim.RecoveryCosts | None = None
) -> tuple[sim.SimInputs, sim.RecoveryCosts, sim.Setting]:
    """SimInputs, costs and setting from the merged values."""
    try:  # a value of the wrong kind (a config file's "1,000") or out of range is a usage error
        setting_kw = {
            name: kind(values[flag]) for flag, (name, kind) in SETTING_FLAGS.items() if flag in values
        }
        setting = sim.Setting(**setting_kw)
        input_kw: dict[str, Any] = {
            name: kind(values[flag]) for flag, (name, kind) in INPUT_FLAGS.items() if flag in values
        }
        if "failures_per_day" in values:
            machines = int(input_kw.get("machines", sim.SimInputs.machines))
            if machines < 1:
                raise ValueError("machines must be at least 1")
            input_kw["failures_per_machine_day"] = float(values["failures_per_day"]) / machines
        inputs, costs = sim.castor_inputs(setting, **input_kw)
    except (TypeError, ValueError) as exc:
        raise SimulateError(str(exc)) from None
    if costs_override is not None:
        costs = costs_override
    cost_kw = dict(values.get("costs") or {})
    for key in ("replace_standby_s", "replace_launch_s"):
        if key in values:
            cost_kw[key] = values[key]
    unknown = sorted(set(cost_kw) - set(COST_FIELDS))
    if unknown:
        raise SimulateError(f"unknown costs {', '.join(unknown)}; known: {', '.join(COST_FIELDS)}")
    costs = replace(costs, **{k: float(v) for k, v in cost_kw.items()})
    return inputs, costs, setting


def _sweep(values: dict[str, Any]) -> tuple[str, list[float]]:
    spec = values.get("sweep") or "machines=16,200,1000"
    key, _, raw = str(spec).partition("=")
    key = key.strip().replace("-", "_")
    if key not in SWEEP_KEYS or not raw:
        raise SimulateError(
            f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}; got {spec!r}"
        )
    try:
        points = [float(v) for v in raw.split(",") if v.strip()]
    except ValueError:
        raise SimulateError(f"--sweep {spec!r}: values must be numbers") from None
    if not points:
        raise SimulateError(f"--sweep {spec!r}: no values")
    return key, points


def _point(values: dict[str, Any], key: str, value: float) -> dict[str, Any]:
    point = dict(values)
    # A swept failure rate replaces the other way of giving it.
    if key == "failure_rate":
        point.pop("failures_per_day", None)
    if key == "failures_per_day":
        point.pop("failure_rate", None)
    point[key] = int(value) if key in ("machines", "replicas", "persist_every") else value
    return point


# -- --from-job ---------------------------------------------------------------------------------------------


def _event(failure: dict[str, Any]) -> SimpleNamespace:
    def when(name: str) -> datetime | None:
        raw = failure.get(name)
        if not raw:
            return None
        parsed = datetime.fromisoformat(str(raw))
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)

    return SimpleNamespace(
        kind=failure.get("kind", "unknown"),
        detected_at=when("detected_at"),
        classified_at=when("classified_at"),
        replaced_at=when("replaced_at"),
        restored_at=when("restored_at"),
        resumed_at=when("resumed_at"),
        details=failure.get("details") or {},
    )


def records_from_failures(failures: list[dict[str, Any]]) -> list[sim.PhaseRecord]:
    """Recovered failures (training resumed) as per-phase durations, through the pages' phase rules."""
    from services.root.domain.phases import phases

    records = []
    for failure in failures:
        if failure.get("state") != "recovered" or not failure.get("resumed_at"):
            continue
        event = _event(failure)
        measured = {p.name: p.seconds for p in phases(event, finished=True)}
        records.append(sim.PhaseRecord(str(failure.get("kind")), failure.get("tier"), measured))
    return records


def _job_costs(
    args: argparse.Namespace, fallback: sim.RecoveryCosts
) -> tuple[sim.RecoveryCosts, dict[str, Any]]:
    from services.cli.client import CliClient, resolve_connection, resolve_job

    connection = resolve_connection(args.root, args.token)
    with CliClient(connection, timeout=args.request_timeout) as client:
        job = resolve_job(client, args.from_job)
        failures = client.document(client.api.failures(job["id"]))
    return job_costs(job, failures, fallback)


def job_costs(
    job: dict[str, Any], failures: list[dict[str, Any]], fallback: sim.RecoveryCosts
) -> tuple[sim.RecoveryCosts, dict[str, Any]]:
    """Recovery costs from a job's API resource and its failures (the API's JSON)."""
    records = records_from_failures(failures)
    if not records:
        raise SimulateError(f"job {job['name']} has no recovered failures to take costs from")
    per_minute = job.get("checkpoints_per_minute")
    iteration_s = 60.0 / per_minute if per_minute else 0.0
    costs, counts = sim.costs_from_failures(records, iteration_s, fallback)
    source = {
        "job": job["name"],
        "failures_used": len(records),
        "samples": counts,
        "iteration_s": round(iteration_s, 3),
    }
    return costs, source


# -- output -------------------------------------------------------------------------------------------------


def _row(inputs: sim.SimInputs, costs: sim.RecoveryCosts) -> dict[str, Any]:
    castor = sim.simulate_castor(inputs, costs)
    row: dict[str, Any] = {
        "machines": inputs.machines,
        "replicas": inputs.replicas,
        "failures_per_day": round(inputs.failures_per_day, 4),
        "hardware_fraction": inputs.hardware_fraction,
        "persist_every": inputs.effective_persist_every,
        "castor": castor.as_dict(),
    }
    for name, system in sim.PAPER_SYSTEMS.items():
        row[name] = sim.simulate_flat(system, inputs).ettr.as_dict()
    return row


def _projection(costs: sim.RecoveryCosts, setting: sim.Setting, seeds: int) -> dict[str, float]:
    """The issue's headline numbers in the paper's Figure 15b setting (1,000 machines, 1.5 % a day)."""
    base, _ = sim.castor_inputs(setting, machines=1000, failures_per_machine_day=0.015, seeds=seeds)
    paper = sim.simulate_flat(sim.PAPER_SYSTEMS["gemini"], base).ettr.mean
    software = sim.simulate_castor(base, costs).ettr.mean
    mixed = sim.simulate_castor(replace(base, hardware_fraction=0.5), costs).ettr.mean
    return {
        "paper_gemini_1000": round(paper, 4),
        "castor_1000": round(software, 4),
        "castor_1000_mixed": round(mixed, 4),
    }


def _fmt(cell: dict[str, float]) -> str:
    return f"{cell['mean']:.4f} [{cell['p5']:.3f}-{cell['p95']:.3f}]"


def render_table(key: str, rows: list[dict[str, Any]]) -> str:
    headers = [
        "N",
        "m",
        "failures/day",
        "K",
        "Castor (90% interval)",
        "mem. recovery",
        "GEMINI (paper)",
        "HighFreq (paper)",
        "Strawman (paper)",
    ]
    body = [
        [
            str(r["machines"]),
            str(r["replicas"]),
            f"{r['failures_per_day']:g}",
            str(r["persist_every"]),
            _fmt(r["castor"]["ettr"]),
            f"{r['castor']['memory_recovery_share']:.4f}",
            f"{r['gemini']['mean']:.4f}",
            f"{r['highfreq']['mean']:.4f}",
            f"{r['strawman']['mean']:.4f}",
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


SERIES = (
    ("castor", "Castor (measured costs)", "#1f6feb"),
    ("gemini", "GEMINI (paper)", "#2da44e"),
    ("highfreq", "HighFreq (paper)", "#bf8700"),
    ("strawman", "Strawman (paper)", "#cf222e"),
)


def render_svg(key: str, rows: list[dict[str, Any]], title: str) -> str:
    """A line chart of ETTR over the sweep: one line per system (Castor with its 90% band)."""
    width, height, left, right, top, bottom = 720, 420, 64, 200, 40, 56
    xs = [float(_x_value(key, r)) for r in rows]
    x_lo, x_hi = min(xs), max(xs)
    span = (x_hi - x_lo) or 1.0

    def px(x: float) -> float:
        return (
            left + (x - x_lo) / span * (width - left - right) if len(xs) > 1 else (left + width - right) / 2
        )

    def py(y: float) -> float:
        return top + (1 - max(0.0, min(1.0, y))) * (height - top - bottom)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f"<title>{_esc(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="14" font-weight="bold">{_esc(title)}</text>',
    ]
    for tick in range(11):
        y = tick / 10
        out.append(
            f'<line x1="{left}" y1="{py(y):.1f}" x2="{width - right}" y2="{py(y):.1f}" stroke="#ddd"/>'
        )
        out.append(f'<text x="{left - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
    for x, r in zip(xs, rows, strict=True):
        out.append(
            f'<text x="{px(x):.1f}" y="{height - bottom + 18}" text-anchor="middle">{_esc(_x_label(key, r))}'
            "</text>"
        )
    out.append(
        f'<text x="{(left + width - right) / 2:.1f}" y="{height - 12}" text-anchor="middle">'
        f"{_esc(_axis_name(key))}</text>"
    )
    out.append(
        f'<text x="16" y="{(top + height - bottom) / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 16 {(top + height - bottom) / 2:.1f})">ETTR</text>'
    )
    band = [f"{px(x):.1f},{py(r['castor']['ettr']['p95']):.1f}" for x, r in zip(xs, rows, strict=True)]
    band += [
        f"{px(x):.1f},{py(r['castor']['ettr']['p5']):.1f}"
        for x, r in reversed(list(zip(xs, rows, strict=True)))
    ]
    out.append(f'<polygon points="{" ".join(band)}" fill="#1f6feb" fill-opacity="0.15" stroke="none"/>')
    for i, (name, label, color) in enumerate(SERIES):
        values = [r[name]["ettr"]["mean"] if name == "castor" else r[name]["mean"] for r in rows]
        points = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, values, strict=True))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [
            f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3" fill="{color}"/>'
            for x, v in zip(xs, values, strict=True)
        ]
        ly = top + 10 + 20 * i
        out.append(
            f'<line x1="{width - right + 16}" y1="{ly}" x2="{width - right + 36}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{width - right + 42}" y="{ly + 4}">{_esc(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _x_value(key: str, row: dict[str, Any]) -> float:
    return float(
        {
            "machines": row["machines"],
            "replicas": row["replicas"],
            "persist_every": row["persist_every"],
            "hardware_fraction": row["hardware_fraction"],
        }.get(key, row["failures_per_day"])
    )


def _x_label(key: str, row: dict[str, Any]) -> str:
    value = _x_value(key, row)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _axis_name(key: str) -> str:
    return {
        "machines": "machines",
        "replicas": "replicas m",
        "persist_every": "K (iterations)",
        "hardware_fraction": "share of hardware failures",
    }.get(key, "failures a day (cluster)")


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except SimulateError as exc:
        print(f"castor simulate: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the --from-job client's errors (CliError) and the like
        from services.cli.client import CliError

        if isinstance(exc, CliError):
            print(f"castor: error: {exc}", file=sys.stderr)
            return exc.exit_code
        raise


def _run(args: argparse.Namespace) -> int:
    values = _config(args)
    inputs, costs, setting = build(values)
    source: dict[str, Any] = {"costs": "measured (README, benchmarks/recovery.py and store.py), scaled"}
    if args.from_job:
        job_costs, source = _job_costs(args, costs)
        inputs, costs, setting = build(values, job_costs)
        source["costs"] = "per-phase medians of the job's recovered failures"
    key, points = _sweep(values)
    rows = []
    for value in points:
        point_inputs, _, _ = build(_point(values, key, value), costs)
        rows.append(_row(point_inputs, costs))
    advice = sim.recommend(inputs, costs)
    figure15: list[dict[str, Any]] = [
        {
            "machines": n,
            "failures_per_day": f,
            "simulated": {k: round(v, 4) for k, v in got.items()},
            "paper": dict(sim.PAPER_FIGURE15[(n, f)]),
        }
        for (n, f), got in sim.reproduce_figure15(seeds=50).items()
    ]
    document: dict[str, Any] = {
        **_projection(costs, setting, inputs.seeds),
        "inputs": {
            **{k: _clean(v) for k, v in asdict(inputs).items()},
            **asdict(setting),
            "sweep": f"{key}={','.join(f'{p:g}' for p in points)}",
        },
        "costs": {k: round(v, 4) for k, v in asdict(costs).items()},
        "source": source,
        "rows": rows,
        "figure15": figure15,
        "recommended": {
            "replicas": advice.replicas,
            "persist_every": advice.persist_every,
            "ettr_by_replicas": {str(m): round(v, 4) for m, v in advice.ettr_by_replicas.items()},
            "host_memory_gb_per_machine": round(advice.host_memory_gb, 1),
            "reasons": list(advice.reasons),
        },
    }
    if args.plot:
        title = f"ETTR over {inputs.period_days:g} days, {inputs.seeds} runs a point"
        try:
            args.plot.write_text(render_svg(key, rows, title))
        except OSError as exc:
            raise SimulateError(f"cannot write {args.plot}: {exc}") from None
    if args.json:
        print(json.dumps(document, separators=(",", ":")))
        return 0
    print(render_table(key, rows))
    print()
    print("Figure 15 reproduced with the paper's model and constants (simulated / paper):")
    for point in figure15:
        got, paper = point["simulated"], point["paper"]
        print(
            f"  {point['machines']:>4} machines, {point['failures_per_day']:>4g} failures/day: "
            + ", ".join(f"{name} {got[name]:.3f} / {paper[name]:.3f}" for name in sim.PAPER_SYSTEMS)
        )
    print(
        f"Paper setting, 1,000 machines, 1.5 %/day: GEMINI {document['paper_gemini_1000']:.4f}, Castor "
        f"{document['castor_1000']:.4f} (software), {document['castor_1000_mixed']:.4f} "
        "(half hardware, standby)"
    )
    print(f"Recommended: m = {advice.replicas}, K = {advice.persist_every}")
    for reason in advice.reasons:
        print(f"  {reason}")
    print(
        "Costs (s): "
        + ", ".join(
            f"{k} {v:.3g}"
            for k, v in asdict(costs).items()
            if v or k != "restore_persistent_measured_s"  # shown only when a job's record set it
        )
        + f"  [{source['costs']}]"
    )
    if args.plot:
        print(f"Chart: {args.plot}")
    return 0
