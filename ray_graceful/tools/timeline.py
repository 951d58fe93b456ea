"""The demo's timeline picture: one bar per rank, one coloured segment per teardown step, and
for a warm restart the way back: the group re-formed, each rank's load (or its own state), the
first step, and the moment the step was durable.

Every step has its own colour and its own legend entry; a step that did not do its work (a
parked backup's save, a survivor that loaded nothing) is drawn pale and hatched, a failed one
with a black edge, so only a real save is green. matplotlib is optional: without it, no picture
and a line that says so.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..protocol import TeardownPhase

STEP_ORDER = tuple(step.value for step in TeardownPhase)
WAY_BACK = ("rendezvous", "register", "load")  # a warm member's steps, ``Rejoined.seconds``


@dataclass(frozen=True)
class Segment:
    """One drawn step of the way back: ``row`` is the member's new rank."""

    row: int
    name: str
    status: str  # "ran"; "skipped": a survivor that held the step itself loaded nothing
    start: float  # seconds since the first notice
    duration: float


@dataclass(frozen=True)
class WayBack:
    """What the picture shows past the teardown of a warm cycle.

    ``record``: ``Coordinator.wait_rejoined()``'s record (each member's ``started_at`` and
    ``seconds``); ``first_step_at`` when the new group's first step had finished on every rank;
    ``durable_at`` when the step was durable (the memory tier's copy landed, or the commit on
    disk); ``in_keepers_at`` when a held step was committed in the keepers. Times are
    ``time.time()``.
    """

    record: dict[str, Any]
    first_step_at: float | None = None
    durable_at: float | None = None
    in_keepers_at: float | None = None

    def segments(self, t0: float) -> list[Segment]:
        """Each member's rendezvous, registration and load, in that order, from its start."""
        out = []
        for member in self.record.get("members") or ():
            at = member.get("started_at") or 0.0
            if not at:
                continue  # it did not join: nothing to draw on the way back
            at -= t0
            for name in WAY_BACK:
                seconds = (member.get("seconds") or {}).get(name, 0.0)
                own = name == "load" and member.get("loaded_from") == "own state"
                out.append(Segment(member["rank"], name, "skipped" if own else "ran", at, seconds))
                at += seconds
        return out

    def lines(self, t0: float) -> dict[str, float]:
        """The vertical lines: the first step, a held step in the keepers, the step durable
        (seconds since t0)."""
        found = {
            "first step": self.first_step_at,
            "in the keepers": self.in_keepers_at,
            "durable": self.durable_at,
        }
        return {label: at - t0 for label, at in found.items() if at is not None}


def legend_kinds(reports: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Every (step, status) the timeline draws, by its legend label, in teardown order.

    A step that ran is labelled by its name; one that did not do its work is labelled with its
    status too ("save skipped": a parked backup), so no bar takes a colour the legend lacks.
    """
    found: dict[str, tuple[str, str]] = {}
    for report in reports:
        for step in report["phases"]:
            name, status = step["name"], step["status"]
            found.setdefault(name if status == "ran" else f"{name} {status}", (name, status))

    def place(label: str) -> tuple[int, str]:
        name = found[label][0]
        return (STEP_ORDER.index(name) if name in STEP_ORDER else len(STEP_ORDER), label)

    return {label: found[label] for label in sorted(found, key=place)}


def bar_style(status: str) -> dict[str, Any]:
    """How a step of this status is drawn, in its bar and its legend entry alike."""
    return {
        "alpha": 1.0 if status == "ran" else 0.35,
        "hatch": None if status == "ran" else ("xx" if status == "failed" else "///"),
        "edgecolor": "black" if status == "failed" else "none",
    }


def row_labels(placement: Sequence[str], after: dict[int, str] | None = None) -> list[str]:
    """Each rank's row label: the node it ran on, and where a new member took it (a spare on
    another node) the node it runs on after - "rank 2 (B -> C)"."""
    labels = []
    for rank, node in enumerate(placement):
        now = (after or {}).get(rank, node)
        labels.append(f"rank {rank} ({node})" if now == node else f"rank {rank} ({node} -> {now})")
    return labels


def timeline_png(
    outcome: Any,
    path: str,
    placement: Sequence[str],
    way_back: WayBack | None = None,
    after: dict[int, str] | None = None,
) -> str | None:
    """One row per rank, one segment per teardown step, from the first notice; for a warm
    restart (``way_back``) each rank's way back after it, and the first step and durable
    lines. A rank that sent no report (its host lost with it) keeps its row, marked so.

    ``placement[rank]`` names the node each rank ran on, ``after[rank]`` the node of the member
    that holds the rank after a warm restart; None when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "    (matplotlib not installed: no timeline picture; pip install matplotlib)",
            file=sys.stderr,
        )
        return None
    colors = {  # every teardown step has its own colour, and each is in the legend
        "stop": "#999999",
        "quiesce": "#bcbd22",
        "release_peers": "#d62728",
        "drain_device": "#9467bd",
        "save": "#2ca02c",
        "destroy_process_group": "#1f77b4",
        "exit": "#ff7f0e",
        "rendezvous": "#17becf",
        "register": "#8c564b",
        "load": "#e377c2",
    }
    t0 = min(n["received_at"] for n in outcome.notices)
    reports = sorted(outcome.reports, key=lambda r: r["ranks"][0]["rank"])
    notices = sorted(outcome.notices, key=lambda n: n["received_at"])
    rows = len(placement)
    head = 0.6 + 0.35 * len(notices)  # room above the first bar for the notice labels
    fig, ax = plt.subplots(figsize=(10, 0.6 * rows + 2.2 + 0.25 * len(notices)))
    drawn = legend_kinds(reports)
    reported = {rank["rank"] for report in reports for rank in report["ranks"]}
    for rank in sorted(set(range(rows)) - reported):
        ax.text(0.01, rank, " no report: lost with its host", va="center", fontsize=8)
    for report in reports:
        row = report["ranks"][0]["rank"]
        base = report["started_at"] - t0
        for step in report["phases"]:
            name, status = step["name"], step["status"]
            # A step that did not run its work (a parked backup's save, a skipped drain) is
            # drawn hatched and pale, a failed one with a black edge: only a real save is green.
            ax.barh(
                row,
                max(step["duration_s"], 0.004),
                left=base + step["started_s"],
                color=colors.get(name, "#cccccc"),
                linewidth=0.8,
                **bar_style(status),
            )
        if report["saved"]:
            record = report["saved"][0]
            said = (" held " if record["tier"] == "held" else " saved ") + record["shard"]
        else:
            said = " left" if report.get("exit_path") else " stays"  # a survivor keeps its process
        ax.text(base + (report["finished_s"] or 0) + 0.01, row, said, va="center", fontsize=8)
    segments = way_back.segments(t0) if way_back is not None else []
    for segment in segments:
        ax.barh(
            segment.row,
            max(segment.duration, 0.004),
            left=segment.start,
            color=colors[segment.name],
            linewidth=0.8,
            **bar_style(segment.status),
        )
    for label, at in (way_back.lines(t0) if way_back is not None else {}).items():
        line = {"durable": "#2ca02c", "in the keepers": "#9467bd"}.get(label, "#d62728")
        ax.axvline(at, color=line, linewidth=1.2)
        ax.text(at, rows - 0.55, f" {label}", fontsize=7, va="bottom")
    for kind in dict.fromkeys((s.name, s.status) for s in segments):
        drawn.setdefault(kind[0] if kind[1] == "ran" else f"{kind[0]} {kind[1]}", kind)
    for i, notice in enumerate(notices):
        at = notice["received_at"] - t0
        ax.axvline(at, color="#444444", linestyle="--", linewidth=0.8)
        ax.text(at, -0.6 - 0.35 * i, f" {notice['source']}", fontsize=7, va="center")
    plan_at = outcome.timings.get("plan", 0)
    ax.axvline(plan_at, color="black", linestyle=":", linewidth=1)
    ax.text(plan_at, -0.6 - 0.35 * len(notices), " plan", fontsize=7, va="center")
    ax.set_xlim(left=-0.02)
    ax.set_ylim(rows - 0.5, -0.6 - head)  # inverted: rank 0 on top, labels above it
    ax.set_yticks(range(rows))
    ax.set_yticklabels(row_labels(placement, after))
    label = "seconds since the first eviction notice (dashed: notices; dotted: the plan"
    if segments:  # two lines: one would run off the picture
        label += ";\nthen each rank's way back; red: the new group's first step; green: durable)"
    ax.set_xlabel(label + ("" if segments else ", after the gathering window)"))
    ax.set_title(
        "ray_graceful: teardown and warm restart" if segments else "ray_graceful teardown timeline",
        pad=10,
    )
    kinds = list(drawn)
    handles = [
        plt.Rectangle(
            (0, 0),
            1,
            1,
            facecolor=colors.get(drawn[k][0], "#cccccc"),
            **bar_style(drawn[k][1]),
        )
        for k in kinds
    ]
    ax.legend(
        handles,
        kinds,
        loc="upper left",
        bbox_to_anchor=(0, -0.18),
        fontsize=7,
        ncol=5,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def way_back_json(
    way_back: WayBack, t0: float, placement: Sequence[str], after: dict[int, str] | None = None
) -> dict[str, Any]:
    """What the picture draws past the teardown, as data (the demo writes it beside the PNG)."""
    return {
        "rows": row_labels(placement, after),
        "segments": [asdict(segment) for segment in way_back.segments(t0)],
        "lines": way_back.lines(t0),
    }
