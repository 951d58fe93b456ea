"""One Ray cluster per test session (a head node; tests add raylets only when they need nodes).

Worker processes must import ``tests.*`` (actor classes live in tests/actors.py), so the repo
root goes on PYTHONPATH before the cluster starts: the raylet, and every worker it starts,
inherit the driver's environment.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
# Token auth is on by default when ~/.ray/auth_token exists; a test cluster is private.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_addoption(parser):
    parser.addoption(
        "--hosts",
        action="store_true",
        help="run tests/hosts: a Ray cluster across network namespaces, in a session of its own",
    )


def pytest_ignore_collect(collection_path, config):
    """tests/hosts only in a session of its own (`--hosts`): one Ray cluster at a time."""
    if collection_path.name == "hosts" and collection_path.is_dir():
        return not config.getoption("--hosts")
    return None


FAULTS = os.path.join(REPO, "tests", "faults")


def pytest_collection_modifyitems(items):
    """Mark each test by what it needs: `-m unit` runs the fast bulk, `-m cluster` the rest.

    Every fault-injection scenario (tests/faults) is a ``long`` row, as are the fault rows and
    soaks marked so elsewhere: `make test` (every test not `long`) walks every documented path once,
    `make test-long` what goes wrong on the way; CI runs both."""
    for item in items:
        needs_cluster = "ray_cluster" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.cluster if needs_cluster else pytest.mark.unit)
        if str(item.path).startswith(FAULTS + os.sep):
            item.add_marker(pytest.mark.long)


@pytest.fixture(scope="session")
def session_dir():
    """Ray's temp dir for the session; ``RG_KEEP_RAY_DIR=<dir>`` keeps it (its logs) after."""
    if kept := os.environ.get("RG_KEEP_RAY_DIR"):
        os.makedirs(kept, exist_ok=True)
        yield tempfile.mkdtemp(prefix="rg-tests-", dir=kept)
        return
    with tempfile.TemporaryDirectory(prefix="rg-tests-") as path:
        yield path


@pytest.fixture(scope="session")
def ray_cluster(session_dir):
    """The session's cluster: ``ray.cluster_utils.Cluster`` with a head node, driver attached."""
    import ray
    from ray.cluster_utils import Cluster

    # Ray's temp dir (and the address file it writes) stays private to this session.
    os.environ["RAY_TMPDIR"] = session_dir
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 8,
            "include_dashboard": False,
            "resources": {"head": 100},
        },
    )
    ray.init(address=cluster.address, include_dashboard=False, logging_level="WARNING")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def drain_config(tmp_path):
    """Settings for tests that drain a node: a fast drain poll, a 15 s teardown, scripted
    health (faults written to ``faults.json``), checkpoints and reports under tmp_path."""
    from ray_graceful import GracefulConfig

    return GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        drain_poll_interval_s=0.5,
        health_interval_s=0.5,
        expected_save_s=2.0,
        teardown_timeout_s=15.0,
        save_budget_s=8.0,
        health_probe="scripted",
        health_script_path=str(tmp_path / "faults.json"),
    )


@pytest.fixture
def nodes(ray_cluster):
    """Two extra raylets, "a" and "b" (resources ``node_a``/``node_b``), removed afterwards."""
    added = {
        name: ray_cluster.add_node(num_cpus=2, resources={f"node_{name}": 10})
        for name in ("a", "b")
    }
    ray_cluster.wait_for_nodes()
    yield {name: node.node_id for name, node in added.items()}
    for node in added.values():
        ray_cluster.remove_node(node)


@pytest.fixture
def memory_config(drain_config):
    """``drain_config`` with the memory tier on: one surviving keeper per shard."""
    return drain_config.replace(memory_replicas=1)


@pytest.fixture(scope="session")
def exit_recorder(session_dir):
    """A ``py_executable`` wrapper that records each worker's real exit status.

    The raylet kills a dead worker's process group (and the wrapper it started), so the
    recorder runs in a session of its own, and the worker in yet another, and writes
    ``<dir>/<pid>`` when the worker exits.
    """
    directory = os.path.join(session_dir, "exit-codes")
    os.makedirs(directory)
    script = os.path.join(session_dir, "record-exit.sh")
    with open(script, "w") as f:
        f.write(
            "#!/bin/bash\n"
            f'setsid bash -c \'setsid "$0" "$@" & c=$!; wait $c; echo $? > {directory}/$c\' '
            f'{sys.executable} "$@" &\n'
            "wait\n"
        )
    os.chmod(script, 0o755)
    return ExitRecorder(script, directory)


class ExitRecorder:
    def __init__(self, script: str, directory: str) -> None:
        self.script = script
        self.directory = directory

    def runtime_env(self, hook: bool = False, env: dict | None = None) -> dict:
        env_vars = dict(env or {})
        if hook:
            env_vars["__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"] = "ray_graceful.hooks.setup"
        out: dict = {"py_executable": self.script}
        if env_vars:
            out["env_vars"] = env_vars
        return out

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit status of ``pid`` once it exited, or None after ``timeout`` seconds."""
        import time

        path = os.path.join(self.directory, str(pid))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read().strip()
                if text:
                    return int(text)
            time.sleep(0.02)
        return None
