"""/metrics renders its per-machine families itself (RowsFamily, for speed at 1,000 machines): the text
must be what prometheus_client's generate_latest writes for the same family, byte for byte, whatever the
label values hold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from services.root.metrics import RowsFamily

ROWS: list[tuple[list[str], float]] = [
    (["job-a", "0"], 0),
    (["job-a", "1"], 12),
    (['job "quoted"', "2"], 3.5),
    (["back\\slash", "3"], 12345678),  # Go's exponent form starts sooner than Python's
    (["new\nline", "4"], 1e-7),
    (["ünïcode", "5"], 2**53),
]


def reference(metric: Metric) -> str:
    class Snapshot:
        def collect(self) -> Iterator[Metric]:
            return iter([metric])

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry).decode()


@pytest.mark.parametrize("kind", ["counter", "gauge"])
@pytest.mark.parametrize("labels", [["job", "machine"], ["machine", "job"]])
def test_rows_render_as_generate_latest_does(kind: str, labels: list[str]) -> None:
    documentation = 'Help with a \\ backslash and a\nnewline and "quotes".'
    theirs_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    theirs = theirs_type("castor_example", documentation, labels=labels)
    ours = RowsFamily("castor_example", documentation, kind, labels)
    for values, value in ROWS:
        theirs.add_metric(values, value)
        ours.add(values, value)
    assert ours.render() == reference(theirs)
    parsed = next(iter(text_string_to_metric_families(ours.render())))
    assert [(s.labels, s.value) for s in parsed.samples] == [
        (dict(zip(labels, values, strict=True)), float(value)) for values, value in ROWS
    ]


def test_only_counters_and_gauges_are_rendered() -> None:
    with pytest.raises(ValueError, match="histogram"):
        RowsFamily("castor_example", "help", "histogram", ["job"])
