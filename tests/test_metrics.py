"""The metrics an operator watches and the Grafana dashboard generated from them."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from ray_graceful.metrics import (
    DEFINITIONS,
    MEMORY_HELD_BYTES,
    RELEASE_SECONDS,
    SAVED_BYTES,
    SAVES,
    TEARDOWNS,
    WARM_RESTARTS,
    Kind,
    Metrics,
)
from ray_graceful.tools.cli import main
from ray_graceful.tools.dashboard import dashboard, queries

pytestmark = pytest.mark.unit

SERIES = re.compile(r"\b(ray_[a-z_]+)\b(?!=)")  # a series, not a label (ray_io_cluster=~)


def _scraped_names(metrics: Metrics) -> set[str]:
    """What Prometheus scrapes of each metric Ray was given: Ray's exporter prefixes "ray_",
    a counter gets "_total", a histogram "_bucket", "_sum" and "_count"."""
    from ray.util.metrics import Counter, Histogram

    names = set()
    for made in metrics.made.values():
        base = f"ray_{made._name}"
        if isinstance(made, Counter):
            names.add(f"{base}_total")
        elif isinstance(made, Histogram):
            names.update(f"{base}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(base)
    return names


def test_every_panel_names_a_metric_the_coordinator_exports():
    """A panel whose query names a metric nothing exports shows "No data" forever."""
    scraped = _scraped_names(Metrics())
    panels = dashboard()["panels"]
    named = {name for p in panels for t in p["targets"] for name in SERIES.findall(t["expr"])}
    assert named and named <= scraped, sorted(named - scraped)
    shown = {spec.name for spec in DEFINITIONS if any(spec.name in n for n in named)}
    assert shown == {spec.name for spec in DEFINITIONS}, "a metric no panel shows"
    titles = " ".join(p["title"].lower() for p in panels)
    for wanted in ("cycles", "release", "outcome", "saves", "bytes", "memory", "warm", "node"):
        assert wanted in titles, wanted


def test_the_dashboard_has_the_shape_of_rays_own(tmp_path, capsys):
    path = tmp_path / "ray_graceful.json"
    assert main(["dashboard", "-o", str(path)]) == 0
    written = json.loads(path.read_text())
    assert written == dashboard()
    assert written["templating"]["list"][0]["name"] == "datasource"
    assert all(p["datasource"] == "${datasource}" for p in written["panels"])
    cells = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in written["panels"]}
    assert len(cells) == len(written["panels"]), "two panels drawn on one another"
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as refused:  # checked before anything is written
        main(["dashboard", "-o", str(tmp_path / "a-file" / "x.json")])
    assert refused.value.code == 2
    assert "is not a directory" in capsys.readouterr().err


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def inc(self, value, tags=None):
        self.calls.append(("inc", value, tags))

    def set(self, value, tags=None):
        self.calls.append(("set", value, tags))

    def observe(self, value, tags=None):
        self.calls.append(("observe", value, tags))


def test_a_concluded_cycle_is_counted_in_each_metric_it_touches():
    metrics = Metrics.__new__(Metrics)
    metrics.made = {spec.name: _Recorder() for spec in DEFINITIONS}
    phase = {"name": "release_peers", "status": "ran", "started_s": 0.25, "duration_s": 0.05}
    record = {"tier": "memory", "bytes": 1000, "holders": ["n1", "n2"]}
    outcome = SimpleNamespace(
        result="committed",
        notices=[{"received_at": 100.0}],
        reports=[
            {"started_at": 100.5, "phases": [phase], "saved": [record]},
            {"started_at": 100.2, "phases": [phase], "saved": [{"tier": "disk", "bytes": 7}]},
        ],
        timings={"last_report": 1.0, "outcome": 1.5},
        committed={"step": 12},
        warm={"result": "rejoining"},
    )
    metrics.outcome(outcome)

    def calls(spec):
        return metrics.made[spec.name].calls

    assert calls(TEARDOWNS) == [("inc", 1, {"result": "committed"})]
    assert calls(RELEASE_SECONDS) == [("observe", pytest.approx(0.8), None)]
    assert calls(SAVES) == [("inc", 1, {"tier": "memory"}), ("inc", 1, {"tier": "disk"})]
    assert calls(SAVED_BYTES) == [("inc", 1000, {"tier": "memory"}), ("inc", 7, {"tier": "disk"})]
    assert calls(MEMORY_HELD_BYTES) == [("set", 2000, None)]  # two keepers hold it
    assert calls(WARM_RESTARTS) == [("inc", 1, {"result": "rejoining"})]


def test_every_query_keeps_to_the_chosen_session_and_counters_count_per_interval():
    """Ray's own dashboards pick a session and a cluster; a raw counter total falls to 0
    whenever the coordinator restarts, so counters show their increase."""
    board = dashboard()
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "SessionName", "Cluster"]
    for spec in DEFINITIONS:
        for expr, _legend in queries(spec):
            assert 'SessionName=~"$SessionName"' in expr, expr
            if spec.kind is Kind.COUNTER:
                assert "increase(" in expr or "rate(" in expr, expr


def test_the_metrics_extra_brings_the_exporter_and_the_docs_say_to_install_it():
    """With the declared dependencies alone (``ray[train]``) no agent exports the metrics."""
    import pathlib
    from importlib.metadata import metadata

    requires = metadata("ray-graceful").get_all("Requires-Dist") or []
    assert any(r.startswith("ray[default]") and 'extra == "metrics"' in r for r in requires), (
        requires
    )
    docs = pathlib.Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
    assert 'pip install "ray-graceful[metrics]"' in docs.read_text()
