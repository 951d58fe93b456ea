"""The examples run as a user runs them, against the session's cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(name, address, timeout=300):
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), "--address", address],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(320)
def test_actor_group_example(ray_cluster):
    result = run_example("actor_group.py", ray_cluster.address)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "SIGTERM to rank 0" in out
    assert "cycle 0: committed; 4 report(s), 0 missing; resume from step 3" in out
    assert "restarted from step 3; now at step 5" in out


@pytest.mark.timeout(320)
def test_ray_train_example(ray_cluster):
    result = run_example("ray_train.py", ray_cluster.address)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "notice: {'accepted': True" in result.stdout
    # Worker lines reach the driver prefixed, and Ray may repeat them: keep each start once.
    starts = list(dict.fromkeys(re.findall(r"attempt starts at step (\d+)", result.stdout)))
    assert len(starts) == 2 and starts[0] == "0" and int(starts[1]) > 0, starts
    assert "finished at step 40; error: None" in result.stdout
