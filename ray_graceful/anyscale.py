"""The Anyscale job option: turn a JobConfig (or its YAML) into one with ray_graceful on.

Anyscale's ``JobConfig`` has no general ``runtime_env``, so the plugin is switched
on through what it does have: ``env_vars`` carries ray_graceful's own ``RAY_GRACEFUL_*``
settings, the Ray Train callback (``RAY_TRAIN_CALLBACKS``) and the job-wide worker setup hook
(``__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR``, for async actors); ``requirements`` installs the
package. The user's own variables and requirements are kept; a value of theirs that conflicts
with the plugin's is an error that names it.

::

    from anyscale.job.models import JobConfig
    from ray_graceful.anyscale import enable
    config = GracefulConfig(checkpoint_dir="/mnt/user_storage/ckpt")
    job = enable(JobConfig.from_yaml("job.yaml"), config)

or, from a shell: ``ray-graceful anyscale job.yaml -o job.graceful.yaml``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from . import __version__, ray_adapter
from .config import ENV_PREFIX, ConfigError, GracefulConfig

SETUP_HOOK_VAR = ray_adapter.SETUP_HOOK_ENV_VAR
SETUP_HOOK = "ray_graceful.hooks.setup"
TRAIN_CALLBACKS_VAR = "RAY_TRAIN_CALLBACKS"
TRAIN_CALLBACK = "ray_graceful.train.GracefulTrainCallback"
DEFAULT_PACKAGE = f"ray-graceful=={__version__}"


class AnyscaleConfigError(ValueError):
    """The job config cannot take the plugin as it is; the message names what to change."""


def plugin_env_vars(
    config: GracefulConfig, train_callback: bool = True, setup_hook: bool = True
) -> dict[str, str]:
    """The variables that turn the plugin on with ``config`` (its non-default settings)."""
    env = dict(config.to_env())
    if train_callback:
        env[TRAIN_CALLBACKS_VAR] = TRAIN_CALLBACK
    if setup_hook:
        env[SETUP_HOOK_VAR] = SETUP_HOOK
    return env


def merge_env_vars(user: Mapping[str, str], ours: Mapping[str, str]) -> dict[str, str]:
    """The user's variables plus ours; conflicting values are an error naming the variable."""
    merged = dict(user)
    for name, value in ours.items():
        theirs = merged.get(name)
        if theirs is None or theirs == value:
            merged[name] = value
        elif name == TRAIN_CALLBACKS_VAR:
            callbacks = [c.strip() for c in theirs.split(",") if c.strip()]
            if value not in callbacks:
                callbacks.append(value)
            merged[name] = ",".join(callbacks)
        elif name == SETUP_HOOK_VAR:
            raise AnyscaleConfigError(
                f"env_vars[{name!r}] is already {theirs!r}: Ray runs one worker setup hook per "
                f"job. Call {SETUP_HOOK}() from your hook and keep yours, or pass "
                "setup_hook=False (--no-setup-hook)."
            )
        else:
            raise AnyscaleConfigError(
                f"env_vars[{name!r}] is {theirs!r} in the job, but the ray_graceful config "
                f"asks for {value!r}: remove one of them."
            )
    # Whatever RAY_GRACEFUL_* the user set must itself be a valid configuration.
    try:
        GracefulConfig.from_env({k: v for k, v in merged.items() if k.startswith(ENV_PREFIX)})
    except ConfigError as exc:
        raise AnyscaleConfigError(f"the job's env_vars: {exc}") from exc
    return merged


def _package_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[@]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def merge_requirements(user: Any, package: str) -> list[str]:
    """The user's requirement list with the plugin as this driver pins it: an entry for
    ray-graceful already there is replaced (a cluster running 0.1.0 under a 0.2.0 driver reads
    settings and messages it does not know); ``package=None`` (``--no-package``) leaves the
    requirements as they are."""
    if user is None:
        return [package]
    if isinstance(user, str):
        raise AnyscaleConfigError(
            f"requirements is a file ({user!r}): add {package!r} to it, then call enable() "
            "with package=None (--no-package)."
        )
    ours = _package_name(package)
    listed = [r for r in user if _package_name(r) == ours]
    if not listed:
        return [*user, package]
    first = user.index(listed[0])  # in its place, once
    return [package if i == first else r for i, r in enumerate(user) if r not in listed[1:]]


def enable(
    job: Any,
    config: GracefulConfig | None = None,
    *,
    package: str | None = DEFAULT_PACKAGE,
    train_callback: bool = True,
    setup_hook: bool = True,
) -> Any:
    """Return ``job`` (an ``anyscale.job.models.JobConfig``) with the plugin switched on."""
    from anyscale.job.models import JobConfig

    if isinstance(job, Mapping):
        job = JobConfig.from_dict(dict(job))
    if not isinstance(job, JobConfig):
        raise AnyscaleConfigError(
            f"enable() takes an anyscale.job.models.JobConfig or a dict, got {type(job).__name__}"
        )
    config = config or GracefulConfig()
    env = merge_env_vars(job.env_vars or {}, plugin_env_vars(config, train_callback, setup_hook))
    changes: dict[str, Any] = {"env_vars": env}
    if package is not None:
        changes["requirements"] = merge_requirements(job.requirements, package)
    return job.options(**changes)


def enable_yaml(source: str, target: str | None = None, **kwargs: Any) -> Any:
    """Read a job YAML, switch the plugin on, write it to ``target`` (or return it)."""
    import yaml
    from anyscale.job.models import JobConfig

    try:
        job = JobConfig.from_yaml(source)
    except yaml.YAMLError as exc:
        raise AnyscaleConfigError(f"not valid YAML: {str(exc)[:500]}") from None
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        raise AnyscaleConfigError(f"not a valid Anyscale job config: {str(exc)[:500]}") from None
    patched = enable(job, **kwargs)
    if target is not None:
        with open(target, "w") as f:
            yaml.safe_dump(patched.to_dict(), f, sort_keys=False)
    return patched
