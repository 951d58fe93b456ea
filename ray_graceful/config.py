"""One frozen, validated configuration object for the whole plugin.

Defaults fit Kubernetes' 30 s termination grace period (and Ray's own 30 s drain before kill):
a rank that is told to leave without a deadline leaves within 25 s, its save gets at most 15 s
of that, and a watchdog hard-exits 1 s before the deadline whatever else happens.

An Anyscale job or a KubeRay pod turns the plugin on and tunes it through environment
variables: ``GracefulConfig.from_env()`` reads ``RAY_GRACEFUL_<FIELD>`` for every field. A bad
value, or a ``RAY_GRACEFUL_*`` variable that is not ours and not Ray's, raises ``ConfigError``
naming the variable, the value and what is allowed.

The prefix is shared with Ray itself: Ray reads ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` and
``RAY_GRACEFUL_SHUTDOWN_POLL_INTERVAL_S`` (``ray/_private/ray_constants.py`` in Ray 2.60; Ray
2.51 reads none), and KubeRay users set them. Those, and the whole ``RAY_GRACEFUL_SHUTDOWN_`` family
(no field of ours starts with ``shutdown_``), are Ray's and are left alone. The plugin's own
process markers never use the prefix (they start with ``_RAY_GRACEFUL``), so a job-wide
environment that reaches the plugin's own actors never trips over them.

Every duration has an upper bound as well as a lower one: a value a thread cannot wait for
(``threading`` overflows near 1e10 s), a gathering window that never plans, or a drain poll that
busy-loops the GCS is a mistake, and is refused with what is allowed.
"""

from __future__ import annotations

import difflib
import enum
import os
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError, model_validator
from typing_extensions import Self

from .config_sections import (  # noqa: F401 (the default XIDs: part of this API)
    DEFAULT_DEGRADED_XIDS,
    DEFAULT_FATAL_XIDS,
    DEFAULT_IGNORED_XIDS,
    SECTIONS,
    CloudSettings,
    CoordinatorSettings,
    HealthSettings,
    HostWatchSettings,
    MemorySettings,
    TeardownSettings,
    WarmRestartSettings,
)
from .config_values import (  # noqa: F401 (MAX_SECONDS, the modes: part of this API)
    MAX_SECONDS,
    CloudNotices,
    ConfigError,
    HealthProbe,
    NodeAgentMode,
    TrainShards,
    allowed_text,
    env_text,
    from_text,
)
from .notices import short

ENV_PREFIX = "RAY_GRACEFUL_"

# Ray's own variables that share our prefix (Ray 2.60's ray_constants.py). They are Ray's to
# read; from_env leaves them be, and the whole RAY_GRACEFUL_SHUTDOWN_ family with them.
RAY_OWN_VARIABLES = frozenset(
    {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "RAY_GRACEFUL_SHUTDOWN_POLL_INTERVAL_S"}
)
RAY_OWN_PREFIX = "RAY_GRACEFUL_SHUTDOWN_"


class GracefulConfig(
    WarmRestartSettings,  # pydantic takes the bases' fields last first: teardown's lead
    MemorySettings,
    HostWatchSettings,
    CloudSettings,
    HealthSettings,
    CoordinatorSettings,
    TeardownSettings,
):
    """Every knob of ray_graceful, validated when built. See docs/configuration.md.

    A pydantic model, strict (``"5"`` is not a number of seconds; the environment's text is
    parsed by ``from_env``) and frozen; its settings are defined in sections
    (``config_sections.py``: teardown, coordinator, health, cloud, host watch, memory, warm
    restart), each with the rules between its own settings. Every refusal is a ``ConfigError``
    that names the setting, the value and what is allowed, never a pydantic traceback.
    """

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise _config_error(error, values) from None

    @model_validator(mode="after")
    def _held_path_with_warm_restart(self) -> Self:
        """``memory_replicas`` not given: what ``warm_restart`` needs for its fast way back.

        A warm restart's survivors hold their own shards only where keepers will make the
        held step durable (``coordinator/held.py``); without them every survivor saves before
        anyone trains again. So the warm restart alone brings one keeper replica; a given
        ``memory_replicas`` (0 included) is kept as given."""
        if "memory_replicas" not in self.model_fields_set:
            object.__setattr__(self, "memory_replicas", default_memory_replicas(self.warm_restart))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        # AttributeError, as a frozen dataclass raises (pydantic's own is a ValidationError).
        raise AttributeError(f"GracefulConfig is frozen: config.replace({name}=...) makes a copy")

    # --- environment ---------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GracefulConfig:
        """Build from ``RAY_GRACEFUL_<FIELD>`` variables; keyword overrides win over them."""
        env = os.environ if environ is None else environ
        known = {ENV_PREFIX + name.upper(): name for name in cls.model_fields}
        values: dict[str, Any] = {}
        for variable, raw in env.items():
            if not variable.startswith(ENV_PREFIX) or is_rays_own(variable):
                continue
            name = known.get(variable)
            if name is None:
                raise ConfigError(
                    f"{variable} is not a ray_graceful setting.{_hint(variable, known)}"
                )
            field = cls.model_fields[name]
            values[name] = from_text(variable, raw, field.annotation, allowed_text(field.metadata))
        values.update(overrides)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables that make ``from_env()`` rebuild this config (non-defaults only; a
        setting derived from another, as ``memory_replicas`` from ``warm_restart``, is derived
        again there)."""
        default = dict(GracefulConfig(), memory_replicas=default_memory_replicas(self.warm_restart))
        return {
            ENV_PREFIX + name.upper(): env_text(value)
            for name, value in self
            if name in self.model_fields_set and value != default[name]
        }

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)

    def check_checkpoint_dir(self, where: str = "") -> None:
        """``ConfigError`` naming ``where`` unless ``checkpoint_dir`` (if set) is a directory
        this process can write: every save of an eviction would fail there otherwise."""
        if self.checkpoint_dir is None:
            return
        problem = checkpoint_dir_problem(self.checkpoint_dir)
        if problem is not None:
            raise ConfigError(
                f"{f'{where}: ' if where else ''}checkpoint_dir = {self.checkpoint_dir!r} cannot "
                f"take checkpoints: "
                f"{problem}. Give a directory every process of the job can write (a shared "
                "file system on a multi-node job), or leave it unset."
            )

    def replace(self, **changes: Any) -> GracefulConfig:
        """A copy with some fields changed (validated again). A setting that was not given
        stays not given: ``memory_replicas`` follows ``warm_restart`` in the copy too."""
        given = {name: value for name, value in self if name in self.model_fields_set}
        return GracefulConfig(**{**given, **changes})


def default_memory_replicas(warm_restart: bool) -> int:
    """``memory_replicas`` when it is not given: one keeper replica for a warm restart's held
    path, none otherwise (docs/configuration.md)."""
    return 1 if warm_restart else 0


def _hint(name: str, known: Mapping[str, str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    return f"{hint} Allowed: {', '.join(sorted(known))}."


def _config_error(error: ValidationError, values: Mapping[str, Any]) -> ConfigError:
    """The first of pydantic's findings, in the words of the setting's ``Allowed``."""
    first = error.errors()[0]
    if not first["loc"]:  # a rule across settings: its own ConfigError
        return first["ctx"]["error"]
    name = str(first["loc"][0])
    if first["type"] == "extra_forbidden":
        known = {n: n for n in GracefulConfig.model_fields}
        return ConfigError(f"GracefulConfig has no setting {short(name)}.{_hint(name, known)}")
    allowed = allowed_text(GracefulConfig.model_fields[name].metadata)
    return ConfigError(
        f"GracefulConfig.{name} = {short(values[name])} is not allowed: must be {allowed}."
    )


def checkpoint_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot take checkpoints from this process (None: it can). A directory that
    does not exist is made, as the first save would; a regular file, a directory this process
    may not write, or a parent it may not create in is found now, not at the eviction."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "it exists and is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"it cannot be made ({exc.strerror or exc})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "this process may not write in it"
    return None


def is_rays_own(name: str) -> bool:
    """Whether ``name`` is one of Ray's own ``RAY_GRACEFUL_*`` variables (not a setting of ours)."""
    return name in RAY_OWN_VARIABLES or name.startswith(RAY_OWN_PREFIX)


def config_reference_markdown() -> str:
    """The configuration reference in docs/configuration.md, generated from the fields: one
    table per section."""
    default = GracefulConfig()
    lines: list[str] = []
    for title, section in SECTIONS:
        lines += [f"### {title}", "", section.__doc__ or "", ""]
        lines += ["| field | environment variable | default | meaning |", "|---|---|---|---|"]
        for name, field in section.model_fields.items():
            value = getattr(default, name)
            shown = repr(value.value if isinstance(value, enum.Enum) else value)
            if name == "report_dir":
                shown = "(system temp)/ray-graceful-reports"
            if name == "memory_replicas":
                shown = "1 with warm_restart, else 0"
            meaning = " ".join(str(field.description).split())
            lines.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | `{shown}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)
