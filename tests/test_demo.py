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
    assert "exit status 0 via Ray's intended exit: 6/6" in out
    assert "resumed there, 0 lost" in out
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["result"] == "committed"
    savers = {o["rank"] for o in outcome["plan"]["orders"] if o["action"] == "save"}
    assert savers.isdisjoint({0, 1}), "ranks on the FAULTY node A never save"
    assert (tmp_path / "timeline.png").stat().st_size > 0
