"""The README's first command, `ray-graceful demo`, on nodes added to the session's cluster."""

from __future__ import annotations

import itertools
import json
import os
import re

import pytest
import ray

from ray_graceful.tools.demo import run_demo


@pytest.mark.timeout(300)
def test_demo_runs_to_its_summary(ray_cluster, tmp_path, capsys):
    import glob
    import tempfile

    left = set(glob.glob(os.path.join(tempfile.gettempdir(), "ray-graceful-demo-*")))
    assert run_demo(output=str(tmp_path), cluster=ray_cluster) == 0
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "ray-graceful-demo-*"))) == left
    assert (tmp_path / "run" / "checkpoints").is_dir(), "what the run made: under its output"
    out = capsys.readouterr().out
    assert "SUMMARY" in out
    assert "exit status 0 via Ray's intended exit: 4/4 leaving; 2 survivors kept" in out
    assert "resumed there, 0 lost, by a warm restart (2 survivors, 4 spares)" in out
    # The healthy ranks came back in their own processes; the spares loaded their shard.
    assert "rank 4 (C, pid" in out and "survivor of rank 4" in out
    assert "rank 0 (" in out and "spare for rank 0" in out
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    # Ranks 4 and 5 parked at the step hold their shards and save nothing ("held"); ranks
    # released from inside a step would have saved them first ("committed").
    assert outcome["result"] in ("held", "committed"), outcome["reason"]
    if outcome["result"] == "held":
        assert "HELD      step" in out and "IN KEEPERS" in out
        assert set(outcome["committed"]["held"]) <= {"demo/1", "demo/2"}  # C's survivors
        # The outcome is true as of the end: the held step is on disk, and a restart resumes
        # from it there - as the DURABLE line said.
        assert outcome["held"]["stage"] == "on-disk", outcome["held"]
        durable_path = re.search(r"manifest last \((.+?)\)", out).group(1)
        assert outcome["resume_from"] == {"step": outcome["held"]["step"], "path": durable_path}
    savers = {o["rank"] for o in outcome["plan"]["orders"] if o["action"] == "save"}
    assert savers.isdisjoint({0, 1}), "ranks on the FAULTY node A never save"
    assert (tmp_path / "timeline.png").stat().st_size > 0
    # The picture continues past the teardown: every rank of the new group re-forms,
    # registers and loads (a survivor holds the step itself: its load is drawn skipped), then
    # the first step, then the step durable in the background.
    drawn = json.loads((tmp_path / "timeline.json").read_text())
    by_rank: dict[int, list] = {}
    for segment in drawn["segments"]:
        by_rank.setdefault(segment["row"], []).append(segment)
    assert sorted(by_rank) == [0, 1, 2, 3, 4, 5]
    assert drawn["rows"][4:] == ["rank 4 (C)", "rank 5 (C)"], drawn["rows"]  # C's survivors
    assert all(" -> " in row for row in drawn["rows"][:4]), drawn["rows"]  # spares took A's, B's
    # Where each rank's state came from, as the demo printed it: a survivor parked at the
    # committed step holds it ("own state", its load drawn skipped); one released from inside
    # a step, and every spare, loads it.
    loaded = {int(r): where for r, where in re.findall(r"rank (\d) \(.*loaded from (.+)", out)}
    assert sorted(loaded) == [0, 1, 2, 3, 4, 5] and loaded[0] != "own state", loaded
    for rank, segments in by_rank.items():
        assert [s["name"] for s in segments] == ["rendezvous", "register", "load"], rank
        own = loaded[rank] == "own state"
        assert segments[2]["status"] == ("skipped" if own else "ran"), (rank, loaded[rank])
        for before, after in itertools.pairwise(segments):
            assert after["start"] == pytest.approx(before["start"] + before["duration"])
    back = max(s["start"] + s["duration"] for s in drawn["segments"])
    released = max(r["started_at"] + r["finished_s"] for r in outcome["reports"])
    first_notice = min(n["received_at"] for n in outcome["notices"])
    assert min(s["start"] for s in drawn["segments"]) >= released - first_notice - 0.05
    assert drawn["lines"]["first step"] >= back
    assert drawn["lines"]["durable"] > 0
    if outcome["result"] == "held":  # printed in the order it happened, as the times say
        keepers = outcome["held"]["at"]["in-keepers"] - first_notice
        printed_first = out.index("IN KEEPERS") < out.index("resumed at step")
        assert printed_first == (keepers < drawn["lines"]["first step"]), (keepers, drawn)
        assert drawn["lines"]["in the keepers"] == pytest.approx(keepers), "the picture too"


@pytest.mark.long
@pytest.mark.timeout(300)
def test_demo_host_loss_scene_comes_back_from_the_replicas(ray_cluster, tmp_path, capsys):
    """`ray-graceful demo --host-loss`: node B's processes all SIGKILLed, no notice of any kind.
    The host watch, not Ray's verdict (some 15 s later), must be what ended the cycle; B's
    shards come from their replicas on A and C, and spares take B's ranks, warm."""
    assert run_demo(output=str(tmp_path), cluster=ray_cluster, scene="host-loss") == 0
    # The session's cluster lives on: the crashed node must be gone from Ray's view too, or the
    # next test's actor is placed on it and dies at Ray's verdict (seen once in CI).
    assert not any(n["Alive"] and "demo_B" in n["Resources"] for n in ray.nodes())
    out = capsys.readouterr().out
    assert "DETECTED  host_lost" in out and "refused a TCP connect" in out
    assert "2 ranks lost with their host ([2, 3])" in out
    assert "resumed there, 0 lost, by a warm restart (4 survivors, 2 spares)" in out
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert {n["source"] for n in outcome["notices"]} == {"host_lost"}, outcome["notices"]
    assert outcome["result"] in ("held", "committed"), outcome["reason"]
    savers = {o["rank"] for o in outcome["plan"]["orders"] if o["action"] in ("save", "hold")}
    assert savers.isdisjoint({2, 3}), "ranks of the crashed host cannot save"
    kept = {record["shard"] for report in outcome["reports"] for record in report["saved"]}
    assert kept == {"demo/0", "demo/1", "demo/2"}, "every shard from a surviving replica"
    spares = re.findall(r"rank (\d) \(\w+, pid \d+\): spare for rank \d.*loaded from (.+)", out)
    assert sorted(int(rank) for rank, _ in spares) == [2, 3]
    assert all(where != "own state" for _, where in spares), spares
    # The picture keeps a row for each of B's ranks, labelled with the spare's node after.
    rows = json.loads((tmp_path / "timeline.json").read_text())["rows"]
    placed = dict(re.findall(r"rank (\d) \((\w+), pid \d+\)", out))
    assert rows == [
        f"rank {r} ({old})" if placed[str(r)] == old else f"rank {r} ({old} -> {placed[str(r)]})"
        for r, old in enumerate("AABBCC")
    ], (rows, placed)
    assert rows[2].startswith("rank 2 (B -> ") and rows[3].startswith("rank 3 (B -> "), rows


def test_a_demo_scene_that_does_not_exist_is_refused_with_the_ones_that_do():
    with pytest.raises(ValueError, match="'flood' is not allowed: one of drain, host-loss"):
        run_demo(scene="flood")


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


def test_a_rows_label_names_the_node_a_spare_took_the_rank_to():
    from ray_graceful.tools.timeline import row_labels

    assert row_labels(["A", "A", "B"], {0: "C", 1: "A"}) == [
        "rank 0 (A -> C)",
        "rank 1 (A)",
        "rank 2 (B)",
    ]
    assert row_labels(["A"]) == ["rank 0 (A)"]


def test_the_way_back_is_drawn_from_each_members_record():
    """Each member's rendezvous, registration and load, in that order from when its rejoin
    began, as the coordinator's record of the warm restart says; nothing for one that left."""
    from ray_graceful.tools.timeline import WayBack

    record = {
        "members": [
            {
                "rank": 0,
                "started_at": 110.0,
                "loaded_from": "memory-local",
                "seconds": {"rendezvous": 0.5, "register": 0.25, "load": 1.0},
            },
            {
                "rank": 1,
                "started_at": 110.5,
                "loaded_from": "own state",
                "seconds": {"rendezvous": 0.125, "register": 0.125, "load": 0.0},
            },
            {"rank": 2, "action": "left", "seconds": {}},
        ]
    }
    back = WayBack(record, first_step_at=112.5, durable_at=115.0)
    drawn = [(s.row, s.name, s.status, s.start, s.duration) for s in back.segments(t0=100.0)]
    assert drawn == [
        (0, "rendezvous", "ran", 10.0, 0.5),
        (0, "register", "ran", 10.5, 0.25),
        (0, "load", "ran", 10.75, 1.0),
        (1, "rendezvous", "ran", 10.5, 0.125),
        (1, "register", "ran", 10.625, 0.125),
        (1, "load", "skipped", 10.75, 0.0),
    ]
    assert back.lines(t0=100.0) == {"first step": 12.5, "durable": 15.0}
