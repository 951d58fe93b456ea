"""The Anyscale job option, against the real anyscale SDK's JobConfig (no service needed)."""

from __future__ import annotations

import pytest
from anyscale.job.models import JobConfig

from ray_graceful import GracefulConfig, __version__
from ray_graceful.anyscale import (
    SETUP_HOOK_VAR,
    TRAIN_CALLBACK,
    TRAIN_CALLBACKS_VAR,
    AnyscaleConfigError,
    enable,
)


def test_enable_keeps_the_users_settings_and_adds_ours():
    job = JobConfig(
        entrypoint="python rl.py",
        env_vars={"A": "1", TRAIN_CALLBACKS_VAR: "my.Cb"},
        requirements=["ray-graceful>=0.1", "numpy"],
    )
    patched = enable(job, GracefulConfig(checkpoint_dir="/ckpt"))
    assert patched.env_vars["A"] == "1"
    assert patched.env_vars[TRAIN_CALLBACKS_VAR] == f"my.Cb,{TRAIN_CALLBACK}"
    assert patched.env_vars["RAY_GRACEFUL_CHECKPOINT_DIR"] == "/ckpt"
    # An older pin would run another plugin on the cluster than the driver's: ours, in its place.
    assert patched.requirements == [f"ray-graceful=={__version__}", "numpy"]
    assert job.env_vars == {"A": "1", TRAIN_CALLBACKS_VAR: "my.Cb"}, "the input is not mutated"
    again = enable(patched, GracefulConfig(checkpoint_dir="/ckpt"))
    assert again.env_vars == patched.env_vars, "enabling twice changes nothing"


def test_options_to_leave_parts_out():
    patched = enable(
        {"entrypoint": "python x.py"}, package=None, train_callback=False, setup_hook=False
    )
    assert patched.requirements is None
    assert TRAIN_CALLBACKS_VAR not in patched.env_vars and SETUP_HOOK_VAR not in patched.env_vars


@pytest.mark.parametrize(
    "job,message",
    [
        (
            JobConfig(entrypoint="x", env_vars={SETUP_HOOK_VAR: "my.hook"}),
            "Ray runs one worker setup hook per job",
        ),
        (
            JobConfig(entrypoint="x", requirements="requirements.txt"),
            "requirements is a file ('requirements.txt')",
        ),
        (
            JobConfig(entrypoint="x", env_vars={"RAY_GRACEFUL_EXIT_CODE": "999"}),
            "GracefulConfig.exit_code = 999 is not allowed",
        ),
        (
            JobConfig(entrypoint="x", env_vars={"RAY_GRACEFUL_NOPE": "1"}),
            "RAY_GRACEFUL_NOPE is not a ray_graceful setting",
        ),
    ],
)
def test_conflicts_and_bad_values_are_errors(job, message):
    with pytest.raises(AnyscaleConfigError) as info:
        enable(job)
    assert message in str(info.value)


def test_not_a_job_config():
    with pytest.raises(AnyscaleConfigError, match=r"takes an anyscale\.job\.models\.JobConfig"):
        enable(["python x.py"])
