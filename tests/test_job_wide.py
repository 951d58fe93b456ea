"""The plugin switched on job-wide, exactly as docs/ tells a user to - nothing set per actor.

Each test runs a user's driver (tests/scripts/job_driver.py) as a Ray job of its own on the
session's cluster, with the environment a guide produces: the Anyscale option's output
(``ray-graceful anyscale`` on examples/anyscale_job.yaml), and a KubeRay worker pod's env from
examples/kuberay_raycluster.yaml, which carries Ray's own ``RAY_GRACEFUL_SHUTDOWN_*`` variables
as KubeRay users set them. That env is the driver's environment and the job's runtime_env, so
Ray runs the setup hook in every process of the job - the coordinator's, Ray Train's controller
- as it does on Anyscale. For (a) a sync actor group, (b) an async, SkyRL/verl-shaped group and
(c) Ray Train through ``RAY_TRAIN_CALLBACKS`` (its warm path with the Anyscale env, its cold
path with KubeRay's): a normal run must finish unharmed, and an
eviction (a SIGTERM to a rank; the KubeRay preStop command) must be handled.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
DRIVER = os.path.join(REPO, "tests", "scripts", "job_driver.py")


@functools.cache
def _anyscale_option_output() -> tuple[tuple[str, str], ...]:
    """The env_vars `ray-graceful anyscale` writes into the example job (run once a session).

    examples/anyscale_job.yaml is that command's output; its plain job (the example less what
    the command adds) is what the user starts from.
    """
    with open(os.path.join(EXAMPLES, "anyscale_job.yaml")) as f:
        job = yaml.safe_load(f)
    added = ("RAY_GRACEFUL_", "RAY_TRAIN_CALLBACKS", "__RAY_WORKER_PROCESS_SETUP_HOOK")
    job["env_vars"] = {k: v for k, v in job["env_vars"].items() if not k.startswith(added)}
    with tempfile.TemporaryDirectory() as scratch:
        plain, out = os.path.join(scratch, "job.yaml"), os.path.join(scratch, "job.graceful.yaml")
        with open(plain, "w") as f:
            yaml.safe_dump(job, f)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ray_graceful.tools.cli",
                "anyscale",
                plain,
                "-o",
                out,
                "--checkpoint-dir",
                CHECKPOINT_DIR_MARK,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        with open(out) as f:
            return tuple(yaml.safe_load(f)["env_vars"].items())


CHECKPOINT_DIR_MARK = "/checkpoint-dir-of-the-test"


def anyscale_env(tmp_path) -> dict[str, str]:
    """The Anyscale option's env_vars, with this test's checkpoint dir."""
    env = dict(_anyscale_option_output())
    assert env["RAY_GRACEFUL_CHECKPOINT_DIR"] == CHECKPOINT_DIR_MARK, env
    env["RAY_GRACEFUL_CHECKPOINT_DIR"] = str(tmp_path / "ckpt")
    return env


def kuberay_env_and_prestop(tmp_path) -> tuple[dict[str, str], str]:
    """A KubeRay worker pod's env (plus the job-wide hook), and its preStop command."""
    with open(os.path.join(EXAMPLES, "kuberay_raycluster.yaml")) as f:
        cluster = yaml.safe_load(f)
    (container,) = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" in env, "the example sets Ray's own variable"
    env["RAY_GRACEFUL_CHECKPOINT_DIR"] = str(tmp_path / "ckpt")  # the shared mount, here
    env.update(anyscale_env(tmp_path))  # the hook and the Train callback, job-wide
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    return env, subprocess.list2cmdline(command)


def run_driver(ray_cluster, tmp_path, kind: str, env: dict[str, str], evict: str) -> dict:
    env_path = tmp_path / "env.json"
    env_path.write_text(json.dumps(env))
    done = subprocess.run(
        [sys.executable, DRIVER, kind, ray_cluster.address, str(env_path), str(tmp_path), evict],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
        # The installed `ray-graceful` command is on PATH, as in the pod's image.
        env={
            **os.environ,
            **env,
            "PYTHONPATH": REPO,
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        },
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"result"')]
    assert done.returncode == 0 and lines, (done.stdout[-3000:], done.stderr[-12000:])
    return json.loads(lines[-1])["result"]


def check_actor_group(result: dict) -> None:
    for status in result["statuses"]:
        assert "SIGTERM listener: installed" in status, status
        assert "orders arrive through a long poll" in status, status
    assert result["normal"] == [3, 3], "the normal run finished unharmed"
    after = result["after_normal"]
    assert after["cycle"] == 0 and not after["tearing_down"] and not after["notices"], after
    assert not after["failures"], after
    outcome = result["outcome"]
    assert outcome is not None, "the eviction was handled: an outcome was published"
    assert outcome["result"] == "committed", (outcome["result"], outcome["reason"])
    assert result["committed"] == outcome["committed"]["step"]
    assert len(result["ended"]) == 2, result["ended"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_actor_group_with_the_anyscale_option(ray_cluster, tmp_path, kind):
    """The async group leaves the host watch as it is by default: on - the ranks' node agent
    beats to the coordinator's watch, and an eviction with a notice ends as it does without it.
    The sync group switches it off job-wide, as docs/configuration.md says:
    ``RAY_GRACEFUL_HOST_WATCH=0``, nothing in any config object."""
    env = anyscale_env(tmp_path)
    if kind == "sync":
        env["RAY_GRACEFUL_HOST_WATCH"] = "0"
    result = run_driver(ray_cluster, tmp_path, kind, env, "sigterm")
    check_actor_group(result)
    assert result["outcome"]["notices"][0]["source"] == "sigterm"
    watch = result["host_watch"]
    if kind == "sync":
        assert watch is None, "the job's env did not switch the host watch off"
    else:
        assert watch is not None, "the host watch is on by default"
        assert len(watch["hosts"]) == 1 and watch["lost"] == {}, watch


@pytest.mark.timeout(300)
def test_actor_group_on_kuberay_with_the_prestop_hook(ray_cluster, tmp_path):
    env, prestop = kuberay_env_and_prestop(tmp_path)
    result = run_driver(ray_cluster, tmp_path, "sync", env, prestop)
    assert result["evict"]["status"] == 0, result["evict"]
    check_actor_group(result)
    notice = result["outcome"]["notices"][0]
    assert notice["source"] == "cli" and notice["reason"] == "pod terminating (preStop)"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flavour", ["anyscale", "kuberay"])
def test_ray_train_through_ray_train_callbacks(ray_cluster, tmp_path, flavour):
    """Both ways of switching the callback on, each through an eviction: the Anyscale option's
    env with Ray Train's warm path (``GracefulTorchConfig`` in the driver, the callback from
    ``RAY_TRAIN_CALLBACKS``) - the SIGTERMed rank 1 is replaced alone; KubeRay's env and preStop
    hook with the cold path - a restart from the emergency checkpoint. A normal run unharmed is
    checked once (it does not depend on them)."""
    if flavour == "anyscale":
        env, evict, kind = anyscale_env(tmp_path), "sigterm", "train-warm"
    else:
        env, evict = kuberay_env_and_prestop(tmp_path)
        kind = "train-evicted"
    result = run_driver(ray_cluster, tmp_path, kind, env, evict)
    if kind == "train-warm":
        normal = {"error": None, "starts": [0], "started_again": []}
        assert result["normal"] == normal, "a normal run is unharmed"
    evicted = result["evicted"]
    assert evicted["error"] is None, evicted
    assert len(evicted["starts"]) == 2 and evicted["starts"][1] > 0, (
        "the evicted run went on from the step committed at the eviction",
        result,
    )
    if kind == "train-warm":  # only the SIGTERMed rank started again: rank 0 kept its process
        assert evicted["started_again"] == [1], result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["warm-sync", "warm-async"])
def test_warm_restart_switched_on_by_the_jobs_env(ray_cluster, tmp_path, kind):
    """docs/worker.md: ``RAY_GRACEFUL_WARM_RESTART=1`` job-wide, nothing in any config object."""
    env = {**anyscale_env(tmp_path), "RAY_GRACEFUL_WARM_RESTART": "1"}
    result = run_driver(ray_cluster, tmp_path, kind, env, "sigterm")
    warm = result["warm"]
    assert warm["outcome"]["result"] == "rejoining", warm["outcome"]
    assert [m[:3] for m in warm["members"]] == [
        [0, 2, "spare for rank 0"],
        [1, 2, "survivor of rank 1"],
    ], warm["members"]
    assert warm["pids_after"][1] == warm["pids_before"][1], "the survivor kept its process"
    assert warm["step"] == result["committed"], "every member resumes at the committed step"
    assert warm["trained_on"] == [warm["step"] + 2] * 2
