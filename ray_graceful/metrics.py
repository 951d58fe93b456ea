"""The metrics an operator watches, defined once.

The coordinator records them through Ray's metrics API (``ray.util.metrics``), so they reach
Prometheus beside Ray's own, and the Grafana dashboard (``tools/dashboard.py``,
``ray-graceful dashboard``) is generated from these same definitions: a panel can only name a
metric defined here, and every metric defined here is created by ``Metrics``.

Ray's exporter puts its namespace in front of each name and Prometheus adds the kind's suffix:
``ray_graceful_teardowns`` (a counter) is scraped as ``ray_ray_graceful_teardowns_total``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "ray"  # the exporter's prefix (Ray's reporter agent, ``namespace="ray"``)
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricDef:
    """One metric: its name as registered with Ray, its kind, what it counts, its tags."""

    name: str
    kind: Kind
    description: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The series name Prometheus scrapes (histograms: add _bucket, _sum or _count)."""
        base = f"{RAY_NAMESPACE}_{self.name}"
        return f"{base}_total" if self.kind is Kind.COUNTER else base


TEARDOWNS = MetricDef(
    "ray_graceful_teardowns", Kind.COUNTER, "Termination cycles, by result", ("result",)
)
NOTICES = MetricDef(
    "ray_graceful_notices", Kind.COUNTER, "Eviction notices accepted, by source", ("source",)
)
REJECTED = MetricDef("ray_graceful_rejected_notices", Kind.COUNTER, "Notices rejected")
RELEASE_SECONDS = MetricDef(
    "ray_graceful_release_seconds",
    Kind.HISTOGRAM,
    "From a cycle's first notice to every rank released from its collectives",
    boundaries=SECONDS,
)
TEARDOWN_SECONDS = MetricDef(
    "ray_graceful_teardown_seconds",
    Kind.HISTOGRAM,
    "From a cycle's first notice to its last teardown report",
    boundaries=SECONDS,
)
OUTCOME_SECONDS = MetricDef(
    "ray_graceful_outcome_seconds",
    Kind.HISTOGRAM,
    "From a cycle's first notice to its outcome (the checkpoint committed or not)",
    boundaries=SECONDS,
)
COMMITTED_STEP = MetricDef(
    "ray_graceful_committed_step",
    Kind.GAUGE,
    "Step of the last committed emergency checkpoint",
)
SAVES = MetricDef("ray_graceful_saves", Kind.COUNTER, "Emergency shard saves, by tier", ("tier",))
SAVED_BYTES = MetricDef(
    "ray_graceful_saved_bytes", Kind.COUNTER, "Bytes of emergency shard saves, by tier", ("tier",)
)
MEMORY_HELD_BYTES = MetricDef(
    "ray_graceful_memory_held_bytes",
    Kind.GAUGE,
    "Bytes the memory tier's keepers hold for the last checkpoint committed in memory",
)
WARM_RESTARTS = MetricDef(
    "ray_graceful_warm_restarts",
    Kind.COUNTER,
    "Warm restarts decided at a cycle's end, by result (rejoining, or cold and why not)",
    ("result",),
)
DURABLE_STEP = MetricDef(
    "ray_graceful_durable_step",
    Kind.GAUGE,
    "Step of the newest checkpoint the memory tier made durable on disk",
)
DURABLE_FAILURES = MetricDef(
    "ray_graceful_durable_copy_failures",
    Kind.COUNTER,
    "Disk copies of a memory checkpoint that failed after every try (no durable step since)",
)
NODE_AGENT_POLLS = MetricDef(
    "ray_graceful_node_agent_polls",
    Kind.COUNTER,
    "Long polls of node agents served by the coordinator",
)

DEFINITIONS: tuple[MetricDef, ...] = (
    TEARDOWNS,
    NOTICES,
    REJECTED,
    RELEASE_SECONDS,
    TEARDOWN_SECONDS,
    OUTCOME_SECONDS,
    COMMITTED_STEP,
    SAVES,
    SAVED_BYTES,
    MEMORY_HELD_BYTES,
    WARM_RESTARTS,
    DURABLE_STEP,
    DURABLE_FAILURES,
    NODE_AGENT_POLLS,
)


class Metrics:
    """Every defined metric, created with Ray's metrics API; ``outcome`` records a cycle."""

    def __init__(self) -> None:
        from ray.util import metrics

        made: dict[str, Any] = {}
        for spec in DEFINITIONS:
            tags = spec.tags or None
            if spec.kind is Kind.COUNTER:
                made[spec.name] = metrics.Counter(spec.name, spec.description, tags)
            elif spec.kind is Kind.GAUGE:
                made[spec.name] = metrics.Gauge(spec.name, spec.description, tags)
            else:
                made[spec.name] = metrics.Histogram(
                    spec.name, spec.description, list(spec.boundaries), tags
                )
        self.made = made

    def inc(self, spec: MetricDef, tags: Mapping[str, str] | None = None, by: float = 1) -> None:
        if by > 0:  # Ray refuses to add 0
            self.made[spec.name].inc(by, tags=dict(tags) if tags else None)

    def set(self, spec: MetricDef, value: float) -> None:
        self.made[spec.name].set(value)

    def observe(self, spec: MetricDef, value: float) -> None:
        self.made[spec.name].observe(value)

    def outcome(self, outcome: Any) -> None:
        """A concluded cycle: its result and times, its saves by tier, the warm decision."""
        self.inc(TEARDOWNS, {"result": str(outcome.result)})
        for spec, seconds in cycle_seconds(outcome).items():
            self.observe(spec, seconds)
        if outcome.committed:
            self.set(COMMITTED_STEP, outcome.committed["step"])
        held = 0
        for record in saved_records(outcome):
            tier = str(record.get("tier") or "disk")
            self.inc(SAVES, {"tier": tier})
            self.inc(SAVED_BYTES, {"tier": tier}, by=int(record.get("bytes") or 0))
            if tier == "memory":
                held += int(record.get("bytes") or 0) * max(len(record.get("holders") or ()), 1)
        if held:
            self.set(MEMORY_HELD_BYTES, held)
        if outcome.warm:
            self.inc(WARM_RESTARTS, {"result": str(outcome.warm.get("result"))})


def saved_records(outcome: Any) -> list[dict[str, Any]]:
    """Every shard record a cycle's ranks reported saved."""
    return [dict(record) for report in outcome.reports for record in report.get("saved") or ()]


def cycle_seconds(outcome: Any) -> dict[MetricDef, float]:
    """A cycle's release, teardown and outcome times, from its first notice (what it has)."""
    found: dict[MetricDef, float] = {}
    if not outcome.notices:
        return found
    first = min(n["received_at"] for n in outcome.notices)
    released = [
        report["started_at"] + phase["started_s"] + phase["duration_s"] - first
        for report in outcome.reports
        for phase in report.get("phases") or ()
        if phase["name"] == "release_peers" and phase["status"] == "ran"
    ]
    if released:
        found[RELEASE_SECONDS] = max(released)
    for spec, key in ((TEARDOWN_SECONDS, "last_report"), (OUTCOME_SECONDS, "outcome")):
        if key in outcome.timings:
            found[spec] = outcome.timings[key]
    return found
