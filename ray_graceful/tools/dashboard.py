"""The Grafana dashboard for ray_graceful's metrics, generated from their definitions.

``ray-graceful dashboard -o ray_graceful_grafana_dashboard.json`` writes it in the shape of
Ray's own dashboards (``ray/dashboard/modules/metrics/dashboards``: a ``datasource`` template
variable, a 24-column grid of two panels a row), so it loads beside them: put it in the folder
Grafana provisions Ray's from (``<ray temp dir>/session_latest/metrics/grafana/dashboards``), or
import it in Grafana's UI. Every query names a metric of ``ray_graceful/metrics.py`` by the name
Prometheus scrapes; a panel cannot name anything else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import __version__
from ..metrics import (
    COMMITTED_STEP,
    DURABLE_FAILURES,
    DURABLE_STEP,
    MEMORY_HELD_BYTES,
    NODE_AGENT_POLLS,
    NOTICES,
    OUTCOME_SECONDS,
    REJECTED,
    RELEASE_SECONDS,
    SAVED_BYTES,
    SAVES,
    TEARDOWN_SECONDS,
    TEARDOWNS,
    WARM_RESTARTS,
    Kind,
    MetricDef,
)

UID = "rayGracefulDashboard"


@dataclass(frozen=True)
class PanelSpec:
    """One panel: what it shows, its unit, and the metrics it queries (``queries``)."""

    title: str
    description: str
    unit: str
    metrics: tuple[MetricDef, ...]


PANELS = (
    PanelSpec(
        "Termination cycles, by result",
        "Cycles concluded since the job began.",
        "short",
        (TEARDOWNS,),
    ),
    PanelSpec(
        "Notices, by source",
        "Eviction notices accepted, and those rejected.",
        "short",
        (NOTICES, REJECTED),
    ),
    PanelSpec(
        "Release time",
        "From a cycle's first notice to every rank released from its collectives (p50, p99).",
        "s",
        (RELEASE_SECONDS,),
    ),
    PanelSpec(
        "Teardown and outcome time",
        "From a cycle's first notice to its last report and to its outcome (p50, p99).",
        "s",
        (TEARDOWN_SECONDS, OUTCOME_SECONDS),
    ),
    PanelSpec(
        "Emergency saves, by tier",
        "Shards saved to disk or handed to the memory tier.",
        "short",
        (SAVES,),
    ),
    PanelSpec(
        "Bytes saved, by tier", "Bytes of the shards saved, by tier.", "bytes", (SAVED_BYTES,)
    ),
    PanelSpec(
        "Memory tier: bytes held",
        "What the keepers hold for the last checkpoint "
        "committed in memory (every replica counted).",
        "bytes",
        (MEMORY_HELD_BYTES,),
    ),
    PanelSpec(
        "Committed step",
        "Step of the last committed emergency checkpoint.",
        "none",
        (COMMITTED_STEP,),
    ),
    PanelSpec(
        "Durable step, and failed disk copies",
        "Step of the newest checkpoint the memory tier wrote to disk; disk copies that failed "
        "every try (no durable step since).",
        "none",
        (DURABLE_STEP, DURABLE_FAILURES),
    ),
    PanelSpec(
        "Warm restarts, by decision",
        "Rejoining: survivors and spares re-form the group "
        "in place; cold: why not, in the outcome.",
        "short",
        (WARM_RESTARTS,),
    ),
    PanelSpec(
        "Node agents' polls",
        "Long polls of node agents the coordinator served, per second.",
        "reqps",
        (NODE_AGENT_POLLS,),
    ),
)


# Every query keeps to the session and cluster picked above the panels, as Ray's own
# dashboards do (Ray's exporter tags each series with its SessionName; KubeRay adds
# ray_io_cluster). A series without ray_io_cluster still matches "All" (".*").
SELECTED = 'SessionName=~"$SessionName",ray_io_cluster=~"$Cluster"'


def queries(spec: MetricDef) -> list[tuple[str, str]]:
    """(PromQL, legend) for one metric: counters as their increase per interval, by their tags
    (a raw total jumps to 0 whenever the coordinator restarts); gauges as their value;
    histograms as their p50 and p99."""
    by = f" by ({', '.join(spec.tags)})" if spec.tags else ""
    legend = " ".join(f"{{{{{tag}}}}}" for tag in spec.tags) or spec.name
    if spec.kind is Kind.HISTOGRAM:
        bucket = f"{spec.exported}_bucket{{{SELECTED}}}"
        return [
            (
                f"histogram_quantile({q}, sum(rate({bucket}[$__rate_interval])) by (le))",
                f"{spec.name} p{round(q * 100)}",
            )
            for q in (0.5, 0.99)
        ]
    series = f"{spec.exported}{{{SELECTED}}}"
    if spec is NODE_AGENT_POLLS:
        return [(f"sum(rate({series}[$__rate_interval]))", "polls/s")]
    if spec.kind is Kind.COUNTER:
        return [(f"sum(increase({series}[$__rate_interval])){by}", legend)]
    return [(f"max({series})", spec.name)]


def _label_variable(name: str, label: str, description: str) -> dict[str, Any]:
    """A variable over one label of Ray's series, "All" by default (as Ray's dashboards)."""
    query = f"label_values(ray_node_network_receive_speed, {label})"
    return {
        "name": name,
        "type": "query",
        "description": description,
        "datasource": "${datasource}",
        "definition": query,
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 2,
        "hide": 0,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 2,
    }


def panel(index: int, spec: PanelSpec) -> dict[str, Any]:
    targets = [
        {"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i), "interval": ""}
        for i, (expr, legend) in enumerate(q for m in spec.metrics for q in queries(m))
    ]
    return {
        "id": index + 1,
        "title": spec.title,
        "description": spec.description,
        "type": "timeseries",
        "datasource": "${datasource}",
        "gridPos": {"x": 12 * (index % 2), "y": 8 * (index // 2), "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": spec.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": targets,
    }


def dashboard() -> dict[str, Any]:
    """The whole dashboard, as Grafana's JSON model."""
    return {
        "title": "ray_graceful",
        "uid": UID,
        "description": f"ray_graceful {__version__}: evictions, checkpoints, warm restarts",
        "version": 1,
        "schemaVersion": 27,
        "style": "dark",
        "editable": True,
        "graphTooltip": 1,
        "refresh": False,
        "time": {"from": "now-30m", "to": "now"},
        "tags": ["ray", "ray_graceful"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "description": "The Prometheus that scrapes Ray's metrics.",
                    "query": "prometheus",
                    "refresh": 1,
                    "hide": 0,
                    "includeAll": False,
                    "multi": False,
                    "current": {"selected": False},
                },
                _label_variable(
                    "SessionName", "SessionName", "The Ray session (one per cluster start)."
                ),
                _label_variable("Cluster", "ray_io_cluster", "The cluster (KubeRay's label)."),
            ]
        },
        "annotations": {"list": []},
        "panels": [panel(i, spec) for i, spec in enumerate(PANELS)],
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
