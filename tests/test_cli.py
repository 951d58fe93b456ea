"""The ray-graceful command line, run as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_graceful import GracefulConfig
from ray_graceful.coordinator import Coordinator
from ray_graceful.tools.cli import main
from tests.helpers import register_stand_in_rank

COMMANDS = ["notify", "status", "plan", "demo", "anyscale", "bench", "config"]


def cli(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "ray_graceful.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "command",
    [[]] + [[c] for c in COMMANDS] + [["bench", b] for b in ("release", "save")],
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
    now_line, *lines = result.stdout.splitlines()
    assert now_line.startswith("now = ") and "Unix seconds" in now_line
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
    assert "no coordinator to talk to" in no_coordinator.stderr
    assert "nobody-here" in no_coordinator.stderr


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
        register_stand_in_rank(coordinator)
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
            "6",
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


# --- a user's mistakes never print a traceback ------------------------------------------------


def _bomb_yaml() -> str:
    """A rank whose value is a YAML alias bomb: 9 lines, 9**9 strings once expanded."""
    parts = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "ranks:\n  - {group: p, node: a, rank: [" + ", ".join(parts) + "]}\n"


SCENARIO = {
    "ranks": [{"group": "p", "rank": 0, "node": "a"}, {"group": "p", "rank": 1, "node": "b"}]
}


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("bad.json", b"\xff\xfe{}", "not UTF-8"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("h.json", json.dumps({**SCENARIO, "health": 5}).encode(), "health must be a list"),
        ("n.json", json.dumps({**SCENARIO, "notices": 5}).encode(), "notices must be a list"),
        (
            "r.json",
            json.dumps({"ranks": [{"group": "p", "rank": [1], "node": "a"}]}).encode(),
            "ranks[0].rank = [1]: must be an integer",
        ),
        (
            "t.json",
            json.dumps(
                {
                    **SCENARIO,
                    "notices": [
                        {"source": "cli", "reason": "x", "node_id": "a", "received_at": "x"}
                    ],
                }
            ).encode(),
            "received_at 'x' is not allowed",
        ),
        (
            "bomb.yaml",
            _bomb_yaml().encode(),
            "ranks[0].rank = [[",
        ),
        (
            "unknown-node.json",
            json.dumps(
                {**SCENARIO, "notices": [{"source": "cli", "reason": "x", "node_id": "zz"}]}
            ).encode(),
            "notices[0].node_id 'zz' has no rank",
        ),
        (
            "unknown-rank.json",
            json.dumps({**SCENARIO, "health": [{"rank": ["p", 9], "verdict": "FAULTY"}]}).encode(),
            "health[0].rank ['p', 9] must be [group, rank] of a rank in 'ranks'",
        ),
    ],
)
def test_plan_input_mistakes_are_explained(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err) < 2000, "the error message stays small whatever the input"


def test_plan_takes_real_unix_times_and_says_which_now(tmp_path, capsys):
    now = 1_800_000_000.0
    scenario = {
        **SCENARIO,
        "notices": [{"source": "drain", "reason": "spot", "node_id": "b", "deadline": now + 30}],
    }
    path = tmp_path / "s.json"
    path.write_text(json.dumps(scenario))
    assert main(["plan", str(path), "--now", str(now)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"now = {now:.3f}") and "+30.0s" in out
    assert main(["plan", str(path), "--now", str(now + 60)]) == 2
    assert "in the past" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["status", "--timeout", "nan"], "give a finite number of seconds"),
        (["status", "--timeout", "inf"], "give a finite number of seconds"),
        (["notify", "--node-id=", "--reason", "x"], "must not be empty"),
        (["notify", "--this-node", "--reason", "x", "--deadline", "30"], "use --deadline-in"),
        (["bench", "release", "--timeout", "-1"], "seconds must be > 0"),
        # The review's defects 8 and 9: each was a traceback or a misleading answer.
        (["status", "--timeout", "1e300"], "at most 86400 seconds"),
        (["notify", "--this-node", "--reason", "x", "--deadline-in", "700000"], "at most 7 days"),
        (["notify", "--this-node", "--reason", "bad \udcff"], "is not valid UTF-8 text"),
        (["bench", "release", "--how", "foo"], "'foo' is not one of them"),
        (["bench", "release", "--node-agent", "maybe"], "'maybe' is not one of them"),
        (["bench", "save", "--dir", "/dev/null"], "'/dev/null' is not a directory"),
        (["bench", "release", "--sizes", "abc"], "give integers >= 1 separated by commas"),
        (["bench", "save", "--reps", "0"], "give an integer >= 1"),
        (["bench", "save", "--json", "/tmp"], "'/tmp' is a directory: give a file path"),
        (["demo", "--output", "/dev/null/x"], "cannot be made: /dev/null is not one"),
    ],
)
def test_argument_mistakes_are_explained(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_anyscale_on_invalid_yaml_is_explained(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("entrypoint: [unclosed\n")
    assert main(["anyscale", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err and "Traceback" not in err


ARGS = st.lists(
    st.one_of(
        st.sampled_from(
            [
                "notify",
                "status",
                "plan",
                "anyscale",
                "bench",
                "config",
                "release",
                "save",
                "--this-node",
                "--node-id",
                "--rank",
                "--reason",
                "--deadline",
                "--deadline-in",
                "--timeout",
                "--sizes",
                "--reps",
                "--now",
                "--json",
                "--set",
                "--job",
                "-o",
                "nan",
                "inf",
                "-1",
                "0",
                "1e400",
                "g/1",
                "/",
                "=",
                "",
            ]
        ),
        st.text(max_size=12),
    ),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(ARGS)
def test_any_argument_list_parses_or_is_refused_cleanly(args):
    """argparse either accepts the words or exits 2 with a message; nothing else escapes."""
    from ray_graceful.tools.cli import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        assert exc.code in (0, 2)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
SCENARIOISH = st.fixed_dictionaries(
    {},
    optional={
        "ranks": st.lists(
            st.fixed_dictionaries(
                {"node": st.sampled_from(["a", "b"]) | JSONISH},
                optional={
                    "group": st.sampled_from(["p"]) | JSONISH,
                    "rank": st.integers(0, 3) | JSONISH,
                    "shard": JSONISH,
                    "can_save": JSONISH,
                },
            ),
            max_size=4,
        )
        | JSONISH,
        "notices": st.lists(
            st.fixed_dictionaries(
                {"source": st.sampled_from(["drain", "cli"]) | JSONISH},
                optional={
                    "reason": JSONISH,
                    "node_id": st.sampled_from(["a", "b"]) | JSONISH,
                    "rank": JSONISH,
                    "deadline_in_s": JSONISH,
                    "deadline": JSONISH,
                    "received_at": JSONISH,
                },
            ),
            max_size=3,
        )
        | JSONISH,
        "health": JSONISH,
        "config": st.dictionaries(
            st.sampled_from(["expected_save_s", "teardown_timeout_s", "nope"]), JSONISH
        )
        | JSONISH,
    },
)


@settings(max_examples=300, deadline=None)
@given(SCENARIOISH)
def test_any_scenario_file_plans_or_is_explained(tmp_path_factory, scenario):
    import contextlib
    import io

    path = tmp_path_factory.mktemp("s") / "s.json"
    path.write_text(json.dumps(scenario))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(["plan", str(path)])
    assert status in (0, 2), err.getvalue()
    assert (status == 0) == (err.getvalue() == ""), err.getvalue()


def test_status_at_localhost_with_nobody_listening_exits_at_once():
    """Review defect 5: a host name starting with "local" skipped the reachability check, and
    `status --address localhost:PORT --timeout 1` hung for minutes, ignoring SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once closed
    started = time.monotonic()
    result = cli("status", "--address", f"localhost:{port}", "--timeout", "1", timeout=60)
    assert result.returncode == 3, result.stderr
    assert "no Ray cluster reachable at" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 30


def test_an_address_that_is_not_host_port_is_explained(capsys):
    assert main(["status", "--address", "localhost"]) == 2
    assert "give HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content,message",
    [
        (
            {**SCENARIO, "health": [{"rank": ["p", [0]], "verdict": "FAULTY"}]},
            "must be [group, rank] of a rank in 'ranks'",
        ),
        ('{"ranks": [{"rank": ' + "9" * 5000 + ', "node": "a"}]}', "out of range"),
    ],
    ids=["rank-with-a-list", "5000-digit-integer"],
)
def test_plan_scenarios_that_were_tracebacks(tmp_path, capsys, content, message):
    path = tmp_path / "s.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_anyscale_set_of_rays_own_variable_is_refused_not_dropped(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nentrypoint: python train.py\n")
    assert main(["anyscale", str(job), "--set", "shutdown_drain_timeout_s=5"]) == 2
    err = capsys.readouterr().err
    assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S is Ray's own variable" in err
    assert main(["anyscale", str(job), "--set", "save_budget_z=5"]) == 2
    assert "Did you mean save_budget_s?" in capsys.readouterr().err


def test_anyscale_output_into_a_missing_directory_names_the_output(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nentrypoint: python train.py\n")
    out = tmp_path / "missing" / "out.yaml"
    assert main(["anyscale", str(job), "-o", str(out), "--checkpoint-dir", "/ckpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ray-graceful anyscale: {out}:"), err
    assert "No such file or directory" in err


def test_a_huge_environment_value_is_cut_short_in_the_error():
    from ray_graceful.config import ConfigError

    with pytest.raises(ConfigError) as info:
        GracefulConfig.from_env({"RAY_GRACEFUL_SAVE_BUDGET_S": "9" * 100_000 + "x"})
    assert "RAY_GRACEFUL_SAVE_BUDGET_S=" in str(info.value) and len(str(info.value)) < 400


@pytest.mark.timeout(240)
def test_the_documented_prestop_line_reaches_every_job_on_the_node(ray_cluster, tmp_path):
    """Review defect 11: with two jobs on one cluster, `notify --this-node` exactly as
    docs/kubernetes.md writes it exited 4 ("pick one with --job") and reached neither. A node's
    eviction concerns every job on it: both coordinators get the notice, both commit."""
    import ray

    from tests import actors
    from tests.helpers import free_port

    other = subprocess.Popen(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "scripts", "other_job.py"),
            ray_cluster.address,
            str(tmp_path / "other"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    config = GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        teardown_timeout_s=10.0,
        save_budget_s=5.0,
        expected_save_s=1.0,
    )
    coordinator = Coordinator.start(config)
    rank = ray.remote(actors.GracefulTrainer).options(num_cpus=0, resources={"head": 1}).remote()
    try:
        ray.get(rank.setup.remote(0, 1, "127.0.0.1", free_port(), config), timeout=120)
        ray.get(rank.train.remote(3), timeout=60)
        assert other.stdout.readline().strip() == "ready"
        # docs/kubernetes.md's preStop command, plus the test cluster's address
        hook = cli(
            "notify",
            "--this-node",
            "--deadline-in",
            "45",
            "--reason",
            "pod terminating (preStop)",
            "--address",
            ray_cluster.address,
        )
        assert hook.returncode == 0, hook.stderr
        assert hook.stdout.count("(cycle 0)") == 2, hook.stdout
        ours = coordinator.wait_outcome(timeout=60, cycle=0)
        assert ours is not None and ours.result == "committed", ours
        theirs = json.loads(other.stdout.readline())["outcome"]
        assert theirs is not None and theirs["result"] == "committed", theirs
        assert theirs["notices"][0]["reason"] == "pod terminating (preStop)"
    finally:
        other.kill()
        other.wait(30)
        coordinator.shutdown()


@pytest.mark.parametrize("name,content", [("s.yaml", "ranks: [\n  - {rank"), ("s.json", "{")])
def test_a_malformed_scenario_is_said_to_be_malformed_not_out_of_range(
    tmp_path, capsys, name, content
):
    """``ScenarioError`` is a ValueError: the outer handler for over-long integers wrapped it
    again as "a number in it is out of range (not valid YAML: ...)"."""
    path = tmp_path / name
    path.write_text(content)
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert ("not valid YAML" in err or "not valid JSON" in err) and "out of range" not in err


def test_an_unknown_flag_is_answered_with_the_subcommands_own_usage(capsys):
    cases = (
        (["status", "--bogus"], "usage: ray-graceful status"),
        (["bench", "release", "--bogus"], "usage: ray-graceful bench release"),
    )
    for argv, usage in cases:
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith(usage), err
        assert "unrecognized arguments: --bogus" in err


def test_the_release_benchs_drain_poll_is_the_librarys_default():
    from ray_graceful import GracefulConfig
    from ray_graceful.tools.cli import build_parser

    args = build_parser().parse_args(["bench", "release"])
    assert args.drain_poll == GracefulConfig().drain_poll_interval_s == 0.25
