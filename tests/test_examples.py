"""The examples run as a user runs them, against the session's cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(name, address, timeout=300, temp=None):
    """``temp``: the example's TMPDIR (to see what it leaves there)."""
    env = {**os.environ, **({"TMPDIR": temp} if temp else {})}
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), "--address", address],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.timeout(320)
def test_actor_group_example(ray_cluster, tmp_path):
    result = run_example("actor_group.py", ray_cluster.address, temp=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "SIGTERM to rank 0" in out
    assert "cycle 0: committed; 4 report(s), 0 missing; resume from step 3" in out
    assert "warm restart: rejoining (4 member(s))" in out
    assert "rank 0: spare for rank 0, new process" in out
    for rank in (1, 2, 3):  # the survivors kept their processes
        assert f"rank {rank}: survivor of rank {rank}, same process" in out
    assert "warm restart from step 3; now at step 5" in out
    assert list(tmp_path.glob("actor-group-*")) == [], "the example leaves its temp dir behind"


@pytest.mark.timeout(320)
def test_ray_train_example(ray_cluster):
    result = run_example("ray_train.py", ray_cluster.address)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "notice accepted: True" in result.stdout
    # Worker lines reach the driver prefixed, and Ray may repeat them: keep each start once.
    starts = list(dict.fromkeys(re.findall(r"attempt starts at step (\d+)", result.stdout)))
    assert len(starts) == 2 and starts[0] == "0" and int(starts[1]) > 0, starts
    assert "finished at step 40; error: None" in result.stdout


@pytest.mark.timeout(320)
def test_ray_train_warm_example(ray_cluster):
    """Ray Train's warm path with DDP, a ``notify`` for rank 1: only rank 1 starts again, rank
    0 keeps its process, and the run ends at its last step."""
    from ray_graceful.train.backend import ray_has_replica_groups

    if not ray_has_replica_groups():
        pytest.skip("this Ray has no replica groups (Ray >= 2.56)")
    result = run_example("ray_train_warm.py", ray_cluster.address)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "notice accepted: True" in result.stdout
    starts = dict.fromkeys(
        re.findall(r"rank (\d) starts at step (\d+) \(pid (\d+)\)", result.stdout)
    )
    assert [(rank, step) for rank, step, _pid in starts][:2] in (
        [("0", "0"), ("1", "0")],
        [("1", "0"), ("0", "0")],
    ), starts
    again = [(rank, int(step)) for rank, step, _pid in list(starts)[2:]]
    assert len(again) == 1 and again[0][0] == "1" and again[0][1] > 0, starts
    pids = {rank: pid for rank, _step, pid in starts}
    assert f"rank 0 finished at step 40 (pid {pids['0']})" in result.stdout  # the same process
    assert "finished at step" in result.stdout and "error: None" in result.stdout


def test_scenario_example_plans():
    """examples/scenario.yaml, as its first line says to run it."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ray_graceful.tools.cli",
            "plan",
            os.path.join(EXAMPLES, "scenario.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if "policy/" in line}
    assert "FAULTY" in rows["policy/0"] and "leave" in rows["policy/0"]  # node-a never saves
    assert "SAVE" in rows["policy/4"], "node-c's replica of shard 0 saves: node-a is faulty"


@pytest.mark.timeout(120)
def test_slurm_example_trap_notifies_every_node(ray_cluster, tmp_path):
    """The SLURM batch script's USR2 trap, run by bash with stand-ins for srun and scontrol
    (no SLURM here): its `ray-graceful notify` reaches the running job's coordinator."""

    from ray_graceful import GracefulConfig
    from ray_graceful.coordinator import Coordinator
    from tests.helpers import register_stand_in_rank

    config = GracefulConfig(
        report_dir=str(tmp_path),
        coordinator_name="slurm-example",
        teardown_timeout_s=3,
        save_budget_s=1,
    )
    coordinator = Coordinator.start(config)
    try:
        register_stand_in_rank(coordinator)
        with open(os.path.join(EXAMPLES, "slurm_job.sbatch")) as f:
            script = f.read()
        trap = script[script.index("notify_all() {") : script.index("trap notify_all USR2")]
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
        (bin_dir / "srun").write_text(  # drop srun's own options, run the command
            '#!/bin/bash\nwhile [[ "$1" == -* ]]; do [[ "$1" == -w ]] && shift; shift; done\n'
            'exec "$@"\n'
        )
        for name in ("scontrol", "srun"):
            os.chmod(bin_dir / name, 0o755)
        env = {
            **os.environ,
            "PATH": os.pathsep.join(
                [str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]]
            ),
            "SLURM_JOB_NODELIST": "localhost",
            "RAY_ADDRESS": ray_cluster.address,
            "RAY_GRACEFUL_COORDINATOR_NAME": "slurm-example",
        }
        done = subprocess.run(
            ["bash", "-c", f"set -euo pipefail\n{trap}\nnotify_all"],
            capture_output=True,
            text=True,
            env=env,
            timeout=90,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "ray-graceful notify: accepted" in done.stdout, done.stdout + done.stderr[-2000:]
        (notice,) = coordinator.status()["notices"]
        assert notice["reason"] == "SLURM: time limit or preemption"
        assert 100 < notice["deadline"] - notice["received_at"] <= 110
    finally:
        coordinator.shutdown()
