"""The listener and teardown in plain processes (no Ray): what torchrun-style ranks see."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import free_port, report_for, wait_for

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "gloo_rank.py")


def _spawn(rank, world, port, report_dir, mode):
    return subprocess.Popen(
        [sys.executable, SCRIPT, str(rank), str(world), str(port), report_dir, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_json_line(proc, key, timeout=60):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{") and key in json.loads(line):
            return json.loads(line)
    raise AssertionError(f"no {key!r} line from the rank; stderr: {proc.stderr.read()[-2000:]}")


def test_blocked_plain_rank_exits_with_configured_code(tmp_path):
    port = free_port()
    ranks = [_spawn(r, 2, port, str(tmp_path), "block") for r in range(2)]
    try:
        for proc in ranks:
            _read_json_line(proc, "ready")
        _read_json_line(ranks[0], "blocked")  # rank 0 is in the all-reduce; rank 1 never joins
        sent = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        code = ranks[0].wait(timeout=10)
        assert time.monotonic() - sent < 2.0
        assert code == 7  # outside Ray the exit is os._exit(exit_code)
        report = wait_for(lambda: report_for(str(tmp_path), ranks[0].pid), 5, "the report")
        assert report["exit_path"] == "hard"
        # Stuck in a collective: the peers are released first, the device drained after.
        names = [s["name"] for s in report["phases"]]
        assert names[:3] == ["stop", "quiesce", "release_peers"], names
        assert names.index("drain_device") > names.index("release_peers")
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


def test_a_rank_leaving_alone_releases_its_peer_through_the_store(tmp_path):
    """No coordinator: rank 0, SIGTERMed inside a collective, tears itself down and tells the
    group through its store; rank 1, idle and never in that collective, leaves too rather
    than staying behind with a group it can never use again."""
    port = free_port()
    ranks = [_spawn(r, 2, port, str(tmp_path), "leave-together") for r in range(2)]
    try:
        for proc in ranks:
            _read_json_line(proc, "ready")
        ranks[0].send_signal(signal.SIGTERM)
        assert ranks[0].wait(timeout=10) == 7
        assert ranks[1].wait(timeout=10) == 7, "the peer stayed behind"
        report = wait_for(lambda: report_for(str(tmp_path), ranks[1].pid), 5, "its report")
        assert report["trigger"].startswith("released by a peer"), report["trigger"]
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


def test_signal_to_a_child_in_its_first_instant_does_not_reach_the_parent(tmp_path):
    """A child signalled before its at-fork hooks ran must not wake the parent's listener."""
    proc = _spawn(0, 1, free_port(), str(tmp_path), "fork-race")
    try:
        result = _read_json_line(proc, "child_signal")
        assert result["child_signal"] == signal.SIGTERM  # the child ended as without us
        assert result["parent_signals_seen"] == 0
        assert result["parent_stopping"] is False
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_save_holds_the_state_of_the_step_it_is_labelled_with(tmp_path):
    """The rank finishes a weight update after the signal; it parks at should_stop(k) and saves
    step k's weights labelled k - and a loop that breaks at should_stop and then waits in the
    same function still gets to save (it is parked, not "inside its step")."""
    proc = _spawn(0, 1, free_port(), str(tmp_path), "park")
    try:
        _read_json_line(proc, "ready")
        _read_json_line(proc, "training")
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 7
        report = wait_for(lambda: report_for(str(tmp_path), proc.pid), 5, "the report")
        save = next(s for s in report["phases"] if s["name"] == "save")
        assert save["status"] == "ran", save
        (record,) = report["saved"]
        import torch

        from ray_graceful.checkpoint import step_dir

        path = os.path.join(step_dir(str(tmp_path / "ckpt"), record["step"]), record["file"])
        saved = torch.load(path, weights_only=True)
        assert saved["step"] == record["step"]
        assert saved["state"]["w"].item() == record["step"], "weights of another step"
    finally:
        proc.kill()
        proc.wait()


def _deadline_case(tmp_path, mode):
    proc = _spawn(0, 1, free_port(), str(tmp_path), mode)
    try:
        _read_json_line(proc, "ready")
        _read_json_line(proc, "training")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        return code, time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()


def test_a_save_that_holds_the_gil_cannot_pass_the_deadline(tmp_path):
    """torch.save into a FIFO nobody reads blocks in C++ holding the GIL: no Python thread -
    the watchdog included - can run. The kernel timer still ends the rank at its deadline."""
    code, took = _deadline_case(tmp_path, "gil-save")
    assert code == 7, "the hard deadline exits with the configured status"
    assert took < 4.0 + 1.0, f"out {took:.1f}s after the signal; the deadline was 4 s"


def test_a_blocking_report_directory_cannot_pass_the_deadline(tmp_path):
    code, took = _deadline_case(tmp_path, "report-fifo")
    assert code == 7
    assert took < 4.0 + 1.0, f"out {took:.1f}s after the signal; the deadline was 4 s"
