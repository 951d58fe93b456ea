"""The README's first command, `ray-graceful demo`, on nodes added to the session's cluster."""

from __future__ import annotations

import json

import pytest

from ray_graceful.tools.demo import run_demo


@pytest.mark.timeout(300)
def test_demo_runs_to_its_summary(ray_cluster, tmp_path, capsys):
    assert run_demo(output=str(tmp_path), cluster=ray_cluster) == 0
    out = capsys.readouterr().out
    assert "SUMMARY" in out
    assert "exit status 0 via Ray's intended exit: 4/4 leaving; 2 survivors kept" in out
    assert "resumed there, 0 lost, by a warm restart (2 survivors, 4 spares)" in out
    # The healthy ranks came back in their own processes; the spares loaded their shard.
    assert "rank 4 (C, pid" in out and "survivor of rank 4" in out
    assert "rank 0 (" in out and "spare for rank 0" in out
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["result"] == "committed"
    savers = {o["rank"] for o in outcome["plan"]["orders"] if o["action"] == "save"}
    assert savers.isdisjoint({0, 1}), "ranks on the FAULTY node A never save"
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_every_step_the_timeline_draws_has_its_own_legend_entry():
    """Review defect 12: quiesce had no legend entry (each rank's longest bar took a stray
    colour) and a parked backup's skipped save was drawn as a green save."""
    from ray_graceful.tools.timeline import STEP_ORDER, legend_kinds

    def step(name, status="ran"):
        return {"name": name, "status": status}

    reports = [
        {"phases": [step("stop"), step("quiesce"), step("save"), step("exit")]},
        {"phases": [step("quiesce"), step("save", "skipped"), step("drain_device", "skipped")]},
        {"phases": [step("save", "failed"), step("future_step")]},
    ]
    kinds = legend_kinds(reports)
    assert list(kinds) == [
        "stop",
        "quiesce",
        "drain_device skipped",
        "save",
        "save failed",
        "save skipped",
        "exit",
        "future_step",
    ]
    assert kinds["save skipped"] == ("save", "skipped")
    assert "quiesce" in STEP_ORDER
