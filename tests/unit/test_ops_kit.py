"""The operations kit (ops/): every metric the Grafana dashboard and the Prometheus alert rules query is one
the root service exports, and both files are well formed.

The exported names come from a real /metrics: the app (SQLite in a temp dir) renders it, and the
exposition's `# TYPE` lines name every family, labelled ones without samples included. A PromQL query names
a family's series: a counter's `_total`, a histogram's `_bucket`, `_sum` and `_count`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from services.root.app import create_app
from services.root.settings import Settings

OPS = Path(__file__).resolve().parents[2] / "ops"
ALERTS = OPS / "prometheus" / "alerts.yml"
DASHBOARD = OPS / "grafana" / "castor.json"

# The alerts the README promises (issue 15): replication stalled, suspect machines, recoveries failing,
# persistent tier behind.
REQUIRED_ALERTS = {
    "CastorReplicationStalled",
    "CastorSuspectMachines",
    "CastorRecoveriesFailing",
    "CastorPersistentTierBehind",
}

PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "offset", "inf", "nan",
}  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every series name /metrics can expose, per the families' types."""
    settings = Settings(
        state_dir=tmp_path_factory.mktemp("ops-kit"), etcd_endpoints=[], cloud="local", s3_bucket=None
    )
    with TestClient(create_app(settings)) as client:
        response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert "castor_database_up 1.0" in response.text, "the families read from the database are missing"
    names: set[str] = set()
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            suffixes = {
                "counter": ["_total", "_created"],
                "histogram": ["_bucket", "_sum", "_count", "_created"],
                "summary": ["_sum", "_count", "_created"],
            }.get(kind, [])
            if kind == "counter":  # the TYPE line names it with or without _total (client versions)
                name = name.removesuffix("_total")
            names.update([name, *(name + s for s in suffixes)])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels and durations left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings: label values, regexes
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    names = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word, rest = match.group(), text[match.end() :].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue  # a function (rate, histogram_quantile, max, ...) or a keyword
        if re.fullmatch(r"\d+[smhdwy]", word) or text[max(0, match.start() - 1)].isdigit():
            continue
        names.add(word)
    return names


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every templating query of the dashboard."""
    document = json.loads(DASHBOARD.read_text())
    for panel in document["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in document["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert match, variable["definition"]
            yield f"variable {variable['name']}", match.group(1)


def test_the_parser_finds_metrics_and_only_metrics() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, phase) (rate(castor_recovery_phase_seconds_bucket{job=~"a|b"}'
        "[5m]))) > 3 * max by (job) (castor_job_persist_every) and on(job) castor_leader offset 5m"
    )
    assert metric_names(expr) == {
        "castor_recovery_phase_seconds_bucket",
        "castor_job_persist_every",
        "castor_leader",
    }


def test_every_alert_rule_queries_exported_metrics(exported: set[str]) -> None:
    rules = alert_rules()
    assert {rule["alert"] for rule in rules} >= REQUIRED_ALERTS
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")"), rule["alert"]
        used = metric_names(expr)
        # Queries inside the annotations' templates too ({{ with query "..." }}).
        for template in re.findall(r'query "([^"]+)"', json.dumps(rule["annotations"]).replace('\\"', '"')):
            used |= metric_names(template)
        assert used, f"{rule['alert']} queries no metric"
        assert used <= exported, (
            f"{rule['alert']} queries metrics /metrics does not export: {used - exported}"
        )


def test_every_dashboard_query_uses_exported_metrics(exported: set[str]) -> None:
    document = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in document["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in document["panels"]:
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} has no query"
    queried: set[str] = set()
    for where, expr in dashboard_queries():
        used = metric_names(expr)
        assert used, f"{where} queries no metric"
        assert used <= exported, f"{where} queries metrics /metrics does not export: {used - exported}"
        queried |= used
    # The dashboard covers the replication and persistent-tier series the alerts rely on.
    for rule in alert_rules():
        assert metric_names(rule["expr"]) & queried, f"no panel shows what {rule['alert']} watches"
