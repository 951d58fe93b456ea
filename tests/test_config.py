"""GracefulConfig: defaults that fit a 30 s grace period, and errors that name the fix."""

from __future__ import annotations

import os
import re

import pytest

from ray_graceful import ConfigError, GracefulConfig
from ray_graceful.config import config_reference_markdown


def test_defaults_fit_a_30s_kubernetes_grace_period():
    c = GracefulConfig()
    assert c.teardown_timeout_s < 30
    assert c.save_budget_s + c.watchdog_margin_s <= c.teardown_timeout_s
    assert c.exit_code == 0


@pytest.mark.parametrize(
    "field,value,expected",
    [
        (
            "teardown_timeout_s",
            0,
            "GracefulConfig.teardown_timeout_s = 0 is not allowed: "
            "must be a number of seconds > 0 and <= 86400",
        ),
        ("save_budget_s", float("nan"), "save_budget_s = nan is not allowed"),
        ("exit_code", 256, "exit_code = 256 is not allowed: must be an integer from 0 to 255"),
        ("exit_code", True, "exit_code = True is not allowed"),
        ("strict", "yes", "strict = 'yes' is not allowed: must be true or false"),
        ("coordinator_name", " ", "coordinator_name = ' ' is not allowed"),
        ("fatal_xids", (48, -1), "fatal_xids = (48, -1) is not allowed"),
        ("health_probe", "magic", "health_probe = 'magic' is not allowed: must be one of 'auto'"),
        ("save_budget_s", "5", "save_budget_s = '5' is not allowed: must be a number of seconds"),
        ("fatal_xids", [48], "fatal_xids = [48] is not allowed: must be a tuple of XID numbers"),
        (
            "save_budgt_s",
            3,
            "GracefulConfig has no setting 'save_budgt_s'. Did you mean save_budget_s?",
        ),
    ],
)
def test_bad_field_names_field_value_and_allowed(field, value, expected):
    with pytest.raises(ConfigError) as info:
        GracefulConfig(**{field: value})
    assert expected in str(info.value)


def test_a_mode_is_its_enum_or_its_plain_string():
    from ray_graceful.config import NodeAgentMode

    assert GracefulConfig(node_agent="on") == GracefulConfig(node_agent=NodeAgentMode.ON)
    assert GracefulConfig(node_agent="on").node_agent == "on"
    assert (
        GracefulConfig.from_env({"RAY_GRACEFUL_NODE_AGENT": "off"}).node_agent is NodeAgentMode.OFF
    )


def test_replace_validates_the_copy_and_leaves_the_original():
    config = GracefulConfig(save_budget_s=10)
    assert config.replace(save_budget_s=12).save_budget_s == 12.0
    assert config.save_budget_s == 10.0
    with pytest.raises(ConfigError, match="save_budget_s = 0 is not allowed"):
        config.replace(save_budget_s=0)


def test_a_warm_restart_alone_brings_the_keepers_its_held_path_needs():
    """docs/configuration.md: ``memory_replicas`` not given is 1 with ``warm_restart`` (the
    held path) and 0 without; a given value, 0 included, is kept through copies and the
    environment."""
    assert GracefulConfig().memory_replicas == 0
    warm = GracefulConfig(warm_restart=True)
    assert warm.memory_replicas == 1
    assert GracefulConfig.from_env({"RAY_GRACEFUL_WARM_RESTART": "1"}).memory_replicas == 1
    assert GracefulConfig().replace(warm_restart=True).memory_replicas == 1
    assert warm.replace(warm_restart=False).memory_replicas == 0
    assert warm.to_env() == {"RAY_GRACEFUL_WARM_RESTART": "true"}
    disk_only = GracefulConfig(warm_restart=True, memory_replicas=0)
    assert disk_only.memory_replicas == 0
    assert disk_only.replace(rejoin_timeout_s=5.0).memory_replicas == 0
    assert GracefulConfig.from_env(disk_only.to_env()).memory_replicas == 0
    assert GracefulConfig(memory_replicas=0).replace(warm_restart=True).memory_replicas == 0
    assert GracefulConfig(warm_restart=True, memory_replicas=2).memory_replicas == 2


def test_cross_field_rules():
    with pytest.raises(ConfigError, match=r"save_budget_s = 25\.0 does not fit"):
        GracefulConfig(save_budget_s=25)
    with pytest.raises(ConfigError, match=r"watchdog_margin_s = 30\.0 must be smaller"):
        GracefulConfig(watchdog_margin_s=30)
    with pytest.raises(ConfigError, match=r"XIDs \[48\] are both fatal_xids and ignored_xids"):
        GracefulConfig(ignored_xids=(48,))
    with pytest.raises(ConfigError, match="needs health_script_path"):
        GracefulConfig(health_probe="scripted")


def test_from_env_reads_every_kind_of_field():
    env = {
        "RAY_GRACEFUL_TEARDOWN_TIMEOUT_S": "40",
        "RAY_GRACEFUL_SAVE_BUDGET_S": "30.5",
        "RAY_GRACEFUL_EXIT_CODE": "3",
        "RAY_GRACEFUL_STRICT": "yes",
        "RAY_GRACEFUL_CHECKPOINT_DIR": "/ckpt",
        "RAY_GRACEFUL_FATAL_XIDS": "48, 79",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "30",  # Ray's own variables: left to Ray
        "RAY_GRACEFUL_SHUTDOWN_POLL_INTERVAL_S": "0.5",
        "UNRELATED": "x",
    }
    c = GracefulConfig.from_env(env)
    assert (c.teardown_timeout_s, c.save_budget_s, c.exit_code) == (40.0, 30.5, 3)
    assert c.strict is True and c.checkpoint_dir == "/ckpt" and c.fatal_xids == (48, 79)


def test_from_env_round_trips_to_env():
    c = GracefulConfig(
        teardown_timeout_s=40,
        save_budget_s=30,
        strict=True,
        checkpoint_dir="/ckpt",
        fatal_xids=(48,),
        report_dir="/reports",
    )
    assert GracefulConfig.from_env(c.to_env()) == c


@pytest.mark.parametrize(
    "env,expected",
    [
        (
            {"RAY_GRACEFUL_SAVE_BUDGET_S": "soon"},
            "RAY_GRACEFUL_SAVE_BUDGET_S='soon' is not allowed: must be a number of seconds > 0",
        ),
        (
            {"RAY_GRACEFUL_STRICT": "maybe"},
            "RAY_GRACEFUL_STRICT='maybe' is not allowed: must be one of 1, true",
        ),
        ({"RAY_GRACEFUL_EXIT_CODE": "300"}, "GracefulConfig.exit_code = 300 is not allowed"),
        ({"RAY_GRACEFUL_FATAL_XIDS": "48,x"}, "RAY_GRACEFUL_FATAL_XIDS='48,x' is not allowed"),
        (
            {"RAY_GRACEFUL_SAVE_BUDGT_S": "5"},
            "RAY_GRACEFUL_SAVE_BUDGT_S is not a ray_graceful setting. "
            "Did you mean RAY_GRACEFUL_SAVE_BUDGET_S?",
        ),
    ],
)
def test_bad_environment_names_the_variable(env, expected):
    with pytest.raises(ConfigError) as info:
        GracefulConfig.from_env(env)
    assert expected in str(info.value)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        GracefulConfig().exit_code = 1  # type: ignore[misc]


def test_docs_configuration_reference_matches_the_code():
    """docs/configuration.md embeds the generated table; it cannot drift from the fields."""
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "configuration.md")
    with open(path) as f:
        text = f.read()
    assert config_reference_markdown() in text, (
        "docs/configuration.md is out of date: regenerate with `ray-graceful config --markdown`"
    )


def test_every_variable_ray_reads_under_our_prefix_is_left_to_ray():
    """Ray's own RAY_GRACEFUL_* variables (read from the installed Ray's source, and those Ray
    2.60 reads, which KubeRay users set whatever Ray they run) never fail us."""
    import re

    import ray
    from packaging.version import Version

    from ray_graceful.config import RAY_OWN_VARIABLES

    root = os.path.dirname(ray.__file__)
    rays = set()
    for base, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(base, name), errors="replace") as f:
                    rays |= set(re.findall(r"RAY_GRACEFUL_[A-Z0-9_]+", f.read()))
    if Version(ray.__version__) >= Version("2.60"):  # the scan finds them (2.51 reads none)
        assert rays >= RAY_OWN_VARIABLES, f"the scan of Ray's source found only {sorted(rays)}"
    GracefulConfig.from_env({name: "1" for name in rays | RAY_OWN_VARIABLES})  # no ConfigError


def test_no_internal_marker_uses_the_settings_prefix():
    """A job-wide env reaches the plugin's own actors: nothing of ours may trip from_env there."""
    import ray_graceful

    package = os.path.dirname(ray_graceful.__file__)
    fields = {"RAY_GRACEFUL_" + n.upper() for n in GracefulConfig.field_names()}
    for base, _dirs, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(base, name)) as f:
                    text = f.read()
                for var in set(re.findall(r"[\"']((?:_)?RAY_GRACEFUL_[A-Z_]+)[\"']", text)):
                    assert (
                        var in fields
                        or var.startswith("_")
                        or var.startswith("RAY_GRACEFUL_SHUTDOWN_")
                    ), f"{name} uses {var}, which from_env would reject"


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"RAY_GRACEFUL_TEARDOWN_TIMEOUT_S": "1e10"}, "<= 86400"),
        ({"RAY_GRACEFUL_NOTICE_GATHER_S": "1e9"}, "notice_gather_s = 1000000000.0 is not allowed"),
        ({"RAY_GRACEFUL_DRAIN_POLL_INTERVAL_S": "1e-9"}, "seconds >= 0.05"),
        (
            {"RAY_GRACEFUL_CHECKPOINT_DIR": "   "},
            "RAY_GRACEFUL_CHECKPOINT_DIR='   ' is not allowed",
        ),
        ({"RAY_GRACEFUL_DEGRADED_XIDS": "48"}, "XIDs [48] are both fatal_xids and degraded_xids"),
        ({"RAY_GRACEFUL_COORDINATR_NAME": "x"}, "Did you mean RAY_GRACEFUL_COORDINATOR_NAME?"),
    ],
)
def test_out_of_range_values_are_refused_with_what_is_allowed(env, expected):
    with pytest.raises(ConfigError) as info:
        GracefulConfig.from_env(env)
    assert expected in str(info.value)


def test_an_empty_optional_path_means_unset():
    assert GracefulConfig.from_env({"RAY_GRACEFUL_CHECKPOINT_DIR": ""}).checkpoint_dir is None


def test_the_default_report_dir_cannot_shadow_the_package():
    name = os.path.basename(GracefulConfig().report_dir)
    assert not name.isidentifier(), f"{name!r} is importable as a package name"
    assert "ray_graceful" not in GracefulConfig().report_dir


def test_a_checkpoint_dir_is_absolute_with_its_home_expanded_where_it_is_given():
    """A relative path resolved against each process's own working directory, and "~" against
    each process's home: the ranks and the coordinator could write to different places."""
    assert GracefulConfig(checkpoint_dir="~/ckpt").checkpoint_dir == os.path.expanduser("~/ckpt")
    assert GracefulConfig(checkpoint_dir="/shared//ckpt/").checkpoint_dir == "/shared/ckpt"
    with pytest.raises(ConfigError, match=r"checkpoint_dir = 'ckpt' is not allowed: must be an "):
        GracefulConfig(checkpoint_dir="ckpt")


@pytest.mark.parametrize("case", ["file", "under a file", "fine", "made"])
def test_a_checkpoint_dir_is_checked_where_it_is_given_not_at_the_eviction(tmp_path, case):
    """``Coordinator.start`` checks it before anything starts (no cluster needed to refuse)."""
    from ray_graceful.config import ConfigError
    from ray_graceful.coordinator import Coordinator

    path = tmp_path / "ckpt"
    if case == "file":
        path.write_text("x")
    elif case == "under a file":  # cannot be made, even by root
        (tmp_path / "a-file").write_text("x")
        path = tmp_path / "a-file" / "ckpt"
    config = GracefulConfig(checkpoint_dir=str(path))
    if case in ("fine", "made"):
        if case == "fine":
            path.mkdir()
        config.check_checkpoint_dir("Coordinator.start")
        assert path.is_dir()
        return
    with pytest.raises(ConfigError) as info:
        Coordinator.start(config)
    assert str(info.value).startswith(f"Coordinator.start: checkpoint_dir = '{path}' cannot")


def test_the_config_command_refuses_a_checkpoint_dir_that_is_a_file(tmp_path):
    import subprocess
    import sys

    (tmp_path / "ckpt").write_text("x")
    env = {**os.environ, "RAY_GRACEFUL_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    done = subprocess.run(
        [sys.executable, "-m", "ray_graceful.tools.cli", "config"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "it exists and is not a directory" in done.stderr
    assert "Traceback" not in done.stderr
