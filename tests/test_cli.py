"""The ray-graceful command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray
import yaml

from ray_graceful import GracefulConfig
from ray_graceful.cli import main
from ray_graceful.coordinator import Coordinator

COMMANDS = ["notify", "status", "plan", "demo", "anyscale", "bench", "config"]


def cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "ray_graceful.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "command",
    [[]]
    + [[c] for c in COMMANDS]
    + [["bench", b] for b in ("release", "plan", "overhead", "save", "recovery")],
)
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ray-graceful") and "options:" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["notify", "--reason", "x"],
            "one of the arguments --this-node --node-id --rank is required",
        ),
        (["notify", "--rank", "policy", "--reason", "x"], "give GROUP/RANK"),
        (["notify", "--this-node", "--reason", "x", "--deadline-in", "-3"], "seconds must be >= 0"),
        (["anyscale", "missing.yaml", "--set", "nonsense"], "give FIELD=VALUE"),
        (["plan", "/no/such/file.json"], "No such file"),
    ],
)
def test_bad_arguments_say_what_is_wrong(args, message, capsys):
    try:
        status = main(args)
    except SystemExit as exc:  # argparse's own errors
        status = exc.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_config_reads_the_environment_and_refuses_typos():
    ok = cli("config", env={"RAY_GRACEFUL_SAVE_BUDGET_S": "12"})
    assert ok.returncode == 0 and json.loads(ok.stdout)["save_budget_s"] == 12.0
    bad = cli("config", env={"RAY_GRACEFUL_SAVE_BUDGT_S": "12"})
    assert bad.returncode == 2 and "Did you mean RAY_GRACEFUL_SAVE_BUDGET_S?" in bad.stderr


def test_plan_dry_run(tmp_path):
    scenario = {
        "ranks": [
            {"group": "p", "rank": r, "node": n, "shard": s}
            for r, (n, s) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)])
        ],
        "notices": [{"source": "drain", "node_id": "b", "deadline_in_s": 30, "reason": "spot"}],
        "health": [{"node": "a", "verdict": "FAULTY", "reason": "xid_79"}],
        "config": {"expected_save_s": 5},
    }
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    result = cli("plan", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["rank", "node", "shard"]
    assert "p/0" in lines[2] and "leave" in lines[2] and "xid_79" in lines[2]
    assert "p/2" in lines[4] and "SAVE" in lines[4] and "+30.0s" in lines[4]
    as_json = json.loads(cli("plan", str(path), "--json").stdout)
    assert [s["rank"] for s in as_json["savers"]] == [2, 3]

    scenario["notices"][0]["deadline_in_s"] = -1
    path.write_text(yaml.safe_dump(scenario))
    bad = cli("plan", str(path))
    assert bad.returncode == 2 and "notices[0].deadline_in_s = -1" in bad.stderr


def test_anyscale_patches_a_job_yaml_the_sdk_loads(tmp_path):
    from anyscale.job.models import JobConfig

    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "entrypoint": "python train.py",
                "env_vars": {"WANDB_PROJECT": "rl"},
                "requirements": ["torch==2.13.0"],
                "max_retries": 2,
            }
        )
    )
    out = tmp_path / "job.graceful.yaml"
    result = cli(
        "anyscale",
        str(job),
        "-o",
        str(out),
        "--checkpoint-dir",
        "/mnt/ckpt",
        "--set",
        "save_budget_s=12",
    )
    assert result.returncode == 0, result.stderr
    patched = JobConfig.from_yaml(str(out))
    env = patched.env_vars
    assert env["WANDB_PROJECT"] == "rl"  # the user's own variable is kept
    assert env["RAY_GRACEFUL_CHECKPOINT_DIR"] == "/mnt/ckpt"
    assert env["RAY_GRACEFUL_SAVE_BUDGET_S"] == "12.0"
    assert env["RAY_TRAIN_CALLBACKS"] == "ray_graceful.train.GracefulTrainCallback"
    assert env["__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"] == "ray_graceful.hooks.setup"
    assert patched.requirements[0] == "torch==2.13.0"
    assert patched.requirements[1].startswith("ray-graceful==")
    assert patched.entrypoint == "python train.py" and patched.max_retries == 2
    assert (
        GracefulConfig.from_env(
            {k: v for k, v in env.items() if k.startswith("RAY_GRACEFUL_")}
        ).save_budget_s
        == 12.0
    )


def test_anyscale_conflicts_name_the_variable(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "entrypoint": "python train.py",
                "env_vars": {"RAY_GRACEFUL_CHECKPOINT_DIR": "/elsewhere"},
            }
        )
    )
    result = cli("anyscale", str(job), "--checkpoint-dir", "/mnt/ckpt")
    assert result.returncode == 2
    assert "env_vars['RAY_GRACEFUL_CHECKPOINT_DIR'] is '/elsewhere'" in result.stderr


def test_notify_without_a_cluster_or_coordinator(ray_cluster, tmp_path):
    no_cluster = cli(
        "notify", "--this-node", "--reason", "x", "--address", "127.0.0.1:1", timeout=120
    )
    assert no_cluster.returncode == 3 and "no Ray cluster reachable" in no_cluster.stderr
    no_coordinator = cli(
        "notify",
        "--this-node",
        "--reason",
        "x",
        "--address",
        ray_cluster.address,
        "--coordinator",
        "nobody-here",
    )
    assert no_coordinator.returncode == 4
    assert "no coordinator named 'nobody-here'" in no_coordinator.stderr


def test_notify_reaches_the_coordinator_and_changes_the_plan(ray_cluster, tmp_path):
    config = GracefulConfig(
        report_dir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "c"),
        coordinator_name="cli-test",
        teardown_timeout_s=3,
        save_budget_s=1,
    )
    coordinator = Coordinator.start(config)
    try:
        node = ray.get_runtime_context().get_node_id()
        ray.get(
            coordinator.handle.register.remote(
                "p0",
                node,
                1,
                "h",
                [{"group": "g", "rank": 0, "world_size": 1, "shard": "0", "can_save": True}],
            )
        )
        rejected = cli(
            "notify",
            "--rank",
            "g/9",
            "--reason",
            "x",
            "--address",
            ray_cluster.address,
            "--coordinator",
            "cli-test",
        )
        assert rejected.returncode == 5 and "g/9 is not registered" in rejected.stderr
        status = cli("status", "--address", ray_cluster.address, "--coordinator", "cli-test")
        assert status.returncode == 0 and "g/0" in status.stdout
        accepted = cli(
            "notify",
            "--this-node",
            "--reason",
            "preStop: pod terminating",
            "--deadline-in",
            "20",
            "--address",
            ray_cluster.address,
            "--coordinator",
            "cli-test",
        )
        assert accepted.returncode == 0, accepted.stderr
        assert "accepted" in accepted.stdout
        plan = coordinator.status()["plan_table"] or ""
        assert "g/0" in plan, "the notice from the CLI started a plan"
        outcome = coordinator.wait_outcome(timeout=30, cycle=0)
        assert outcome.notices[0]["source"] == "cli"
        assert outcome.notices[0]["reason"] == "preStop: pod terminating"
        assert outcome.missing == ["h:1"], "the registered process never reported"
    finally:
        coordinator.shutdown()
