"""The demo's timeline picture: one bar per rank, one coloured segment per teardown step.

Every step has its own colour and its own legend entry; a step that did not do its work (a
parked backup's save) is drawn pale and hatched, a failed one with a black edge, so only a real
save is green. matplotlib is optional: without it, no picture and a line that says so.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ..protocol import TeardownPhase

STEP_ORDER = tuple(step.value for step in TeardownPhase)


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


def timeline_png(outcome: Any, path: str, placement: Sequence[str]) -> str | None:
    """One bar per rank, one segment per teardown step, from the first notice.

    ``placement[rank]`` names the node each rank ran on; None when matplotlib is missing.
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
    }
    t0 = min(n["received_at"] for n in outcome.notices)
    reports = sorted(outcome.reports, key=lambda r: r["ranks"][0]["rank"])
    notices = sorted(outcome.notices, key=lambda n: n["received_at"])
    head = 0.6 + 0.35 * len(notices)  # room above the first bar for the notice labels
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(reports) + 2.2 + 0.25 * len(notices)))
    drawn = legend_kinds(reports)
    for row, report in enumerate(reports):
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
        ax.text(
            base + (report["finished_s"] or 0) + 0.01,
            row,
            " saved " + report["saved"][0]["shard"] if report["saved"] else " left",
            va="center",
            fontsize=8,
        )
    for i, notice in enumerate(notices):
        at = notice["received_at"] - t0
        ax.axvline(at, color="#444444", linestyle="--", linewidth=0.8)
        ax.text(at, -0.6 - 0.35 * i, f" {notice['source']}", fontsize=7, va="center")
    plan_at = outcome.timings.get("plan", 0)
    ax.axvline(plan_at, color="black", linestyle=":", linewidth=1)
    ax.text(plan_at, -0.6 - 0.35 * len(notices), " plan", fontsize=7, va="center")
    ax.set_xlim(left=-0.02)
    ax.set_ylim(len(reports) - 0.5, -0.6 - head)  # inverted: rank 0 on top, labels above it
    ax.set_yticks(range(len(reports)))
    ax.set_yticklabels(
        [f"rank {r['ranks'][0]['rank']} ({placement[r['ranks'][0]['rank']]})" for r in reports]
    )
    ax.set_xlabel(
        "seconds since the first eviction notice (dashed: notices; dotted: the plan, "
        "after the gathering window)"
    )
    ax.set_title("ray_graceful teardown timeline", pad=10)
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
