"""The project's harnesses (``python -m benchmarks``) and the package's diagnostic
(``ray-graceful bench``) as a user starts them: every command answers ``--help``, a mistake is
one line and exit status 2 before anything runs, and a harness asked of the installed package
says where it went."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ray_graceful.tools.bench.kit import markdown_table, percentile
from ray_graceful.tools.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESSES = (
    "release",
    "save",
    "plan",
    "overhead",
    "recovery",
    "fanout",
    "restart",
    "soak",
    "watcher",
    "host-loss",
    "keeper-memory",
    "host-watch-scale",
)


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize("name", HARNESSES)
def test_every_harness_has_help(name):
    done = harness(name, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks") and "--json" in done.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["plan", "--sizes", "abc"], "give integers >= 1 separated by commas"),
        (["plan", "--json", "/tmp"], "'/tmp' is a directory: give a file path"),
        (["recovery", "--peers", "--ways", "ray"], "give one or more of none"),
        (["fanout", "--ranks-per-node", "8,x"], "each 0 (per rank) to 4096"),
        (["soak", "--kinds", "sigterm,flood"], "'flood' is not one of them"),
        (["soak", "--cycles", "0"], "give an integer >= 1"),
        (["soak", "--warm", "--train"], "--warm and --train are two harnesses; give one"),
        (["save", "--format", "dcp", "--tier", "memory"], "use --tier disk"),
        (["host-loss", "--faults", "crash,flood"], "'flood' is not one of them"),
        (["host-loss", "--stalls", "-1"], "give an integer >= 0"),
        (["host-loss", "--slow-ms", "90000"], "a delay of at most 60000 ms"),
    ],
)
def test_harness_mistakes_are_explained(args, message):
    done = harness(*args)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_plan_run_writes_its_table_and_results(tmp_path):
    out = tmp_path / "plan.json"
    done = harness("plan", "--sizes", "100", "--reps", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("| ranks |") and out.exists()


def test_the_host_watch_under_many_agents_is_measured_and_hears_every_one(tmp_path):
    """A small run of ``host-watch-scale``: every agent is watched, none declared lost while
    all beat, and the watch's CPU and memory are read."""
    out = tmp_path / "scale.json"
    done = harness("host-watch-scale", "--agents", "50", "--seconds", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    import json

    [run] = json.loads(out.read_text())["results"]
    assert (run["agents"], run["hosts"], run["lost"], run["refused"]) == (50, 50, 0, 0), run
    assert 0 <= run["watch_cpu_percent_of_one_core"] < 100 and run["watch_rss_mb"] > 0


@pytest.mark.parametrize("name", ["fanout", "restart", "soak", "plan"])
def test_the_package_says_where_a_harness_went(name, capsys):
    assert main(["bench", name, "--sizes", "4"]) == 2
    err = capsys.readouterr().err
    assert f"python -m benchmarks {name}" in err and "Traceback" not in err


def test_tables_are_markdown_and_percentiles_interpolate():
    lines = markdown_table(["N", "p50 s"], [[8, 0.0561]]).splitlines()
    assert lines[0].replace(" ", "") == "|N|p50s|" and lines[2].replace(" ", "") == "|8|0.056|"
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN: no values


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "no pidfd: /proc polled"])
def test_the_exit_watch_sees_each_process_end_as_it_happens(pidfds, monkeypatch):
    """``bench release`` times each rank's exit by its pidfd, not by polling: a process that
    ends is seen then (and only then), one already gone before the watch is seen at once."""
    from ray_graceful.tools.bench.kit import ExitWatch

    if not pidfds:
        monkeypatch.delattr(os, "pidfd_open")

    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    waiting = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        for _ in range(2)
    ]
    watch = ExitWatch([reaped.pid] + [p.pid for p in waiting])

    def seen(pid: int) -> bool:
        for _ in range(300):
            if pid in watch.gone:
                return True
            watch.changed.wait(0.1)
            watch.changed.clear()
        return False

    try:
        assert set(watch.gone) == {reaped.pid}
        waiting[0].stdin.close()  # the first one ends now
        waiting[0].wait(timeout=30)
        assert seen(waiting[0].pid), "the end was not seen"
        assert waiting[1].pid not in watch.gone, "one still running is not gone"
        waiting[1].stdin.close()
        waiting[1].wait(timeout=30)
        assert seen(waiting[1].pid), "the second end was not seen"
        assert watch.gone[waiting[1].pid] >= watch.gone[waiting[0].pid]
    finally:
        watch.close()
        for p in waiting:
            p.kill()
            p.wait()


# --- the harnesses on NCCL: what can be checked without a GPU -------------------------------


@pytest.mark.parametrize(
    ("backend", "ranks", "gpus", "asks"),
    [
        ("gloo", 4, 0, 0.0),
        ("nccl", 4, 8, 1.0),  # a GPU per rank
        ("nccl", 4, 1, 0.25),  # GPU_SHARE: four ranks on one GPU
        ("nccl", 3, 1, 0.3333),  # Ray counts in 1/10,000ths: three shares fit on one GPU
        ("nccl", 8, 2, 0.25),
    ],
)
def test_an_nccl_rank_asks_for_a_gpu_or_its_share_of_one(backend, ranks, gpus, asks):
    from ray_graceful.tools.bench.kit import rank_gpus

    assert rank_gpus(backend, ranks, gpus) == asks
    assert rank_gpus(backend, ranks, gpus) * ranks <= max(gpus, 0)


def test_nccl_without_a_gpu_is_refused_with_the_reason():
    from ray_graceful.tools.bench.kit import BenchError, rank_gpus

    with pytest.raises(BenchError, match="needs a GPU, and torch sees none"):
        rank_gpus("nccl", 2, 0)


def test_each_rank_process_has_its_own_nccl_host_id():
    """Inherited from the driver through the raylet, one id was every rank's: NCCL then
    refused two ranks on one GPU ("Duplicate GPU detected")."""
    from ray_graceful.tools.bench.kit import nccl_host_id

    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ray_graceful.tools.bench.kit import nccl_host_id as h; print(h())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() != nccl_host_id()


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_be_placed_is_named_within_the_limit(ray_cluster):
    """The NCCL release benchmark waited 600 s without a word for ranks asking a GPU of a
    cluster started with none. Now each stage names the rank and why within its limit."""
    import ray

    from ray_graceful.tools.bench.kit import BenchError, BenchRank, start_ranks

    placeable = ray.remote(BenchRank).options(num_cpus=0).remote()
    unplaceable = ray.remote(BenchRank).options(num_cpus=0, num_gpus=0.25).remote()
    try:
        with pytest.raises(BenchError) as caught:
            start_ranks(
                ray,
                [placeable, unplaceable],
                lambda i, r: r.__ray_ready__.remote(),
                "0.25 GPU",
                limit_s=3,
            )
        said = str(caught.value)
        assert said.startswith("rank(s) [1] not placed within 3s: each asks 0.25 GPU"), said
        assert "the cluster has {" in said and "free of {" in said  # what it does offer
        joined = start_ranks(ray, [placeable], lambda i, r: r.__ray_ready__.remote(), "-", 10)
        assert joined == [True]
    finally:
        ray.kill(placeable)
        ray.kill(unplaceable)


def test_a_gpu_stage_past_its_limit_is_ended_named_and_counted(tmp_path):
    """``tests/gpu/run.sh`` has a short lend to run in: a stage that stalls (the NCCL release
    benchmark once printed nothing for 200 s) is ended at its limit, says so, and the next
    stage still runs; the script's status keeps the failure."""
    script = (
        f"out={tmp_path}; source tests/gpu/stage.sh; "
        "stage stalls 1 sleep 30; stage next 5 echo next-ran; echo status=$status"
    )
    started = time.monotonic()
    ran = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert time.monotonic() - started < 20, "the stalled stage was waited out"
    assert "== stalls: ran past its 1s limit" in ran.stdout
    assert "next-ran" in ran.stdout and ran.stdout.strip().endswith("status=124"), ran.stdout
    assert (tmp_path / "next.log").read_text().strip() == "next-ran"
