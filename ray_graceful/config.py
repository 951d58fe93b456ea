"""One frozen, validated configuration object for the whole plugin.

Defaults fit Kubernetes' 30 s termination grace period (and Ray's own 30 s drain before kill):
a rank that is told to leave without a deadline leaves within 25 s, its save gets at most 15 s
of that, and a watchdog hard-exits 1 s before the deadline whatever else happens.

An Anyscale job or a KubeRay pod turns the plugin on and tunes it through environment
variables: ``GracefulConfig.from_env()`` reads ``RAY_GRACEFUL_<FIELD>`` for every field. A bad
value, or a ``RAY_GRACEFUL_*`` variable that is not ours and not Ray's, raises ``ConfigError``
naming the variable, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ENV_PREFIX = "RAY_GRACEFUL_"

# Ray's own variables that share our prefix. They are Ray's to read; from_env leaves them be.
RAY_OWN_VARIABLES = frozenset({"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"})

# NVIDIA's XID catalog, as mirrored by public GPU-health tools (see docs/health.md).
DEFAULT_FATAL_XIDS = (46, 48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 143)
DEFAULT_DEGRADED_XIDS = (63, 92, 94)
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)

HEALTH_PROBES = ("auto", "nvml", "none", "scripted")


class ConfigError(ValueError):
    """A configuration value is not allowed; the message names it and what is allowed."""


def _default_report_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "ray_graceful", "reports")


# --- checks: each returns None when the value is fine, else a description of what is allowed.


def _seconds(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and value > 0:
        return None
    return "a finite number of seconds > 0"


def _seconds_or_zero(value: Any) -> str | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and math.isfinite(value) and value >= 0:
        return None
    return "a finite number of seconds >= 0"


def _exit_code(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255:
        return None
    return "an integer from 0 to 255"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _name(value: Any) -> str | None:
    if isinstance(value, str) and value.strip() and value == value.strip():
        return None
    return "a non-empty name without surrounding spaces"


def _path(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else "a non-empty path"


def _optional_path(value: Any) -> str | None:
    return None if value is None else _path(value)


def _xids(value: Any) -> str | None:
    if isinstance(value, tuple) and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 < x < 65536 for x in value
    ):
        return None
    return "a tuple of XID numbers from 1 to 65535 (in the environment: '48,79,95')"


def _probe(value: Any) -> str | None:
    if value in HEALTH_PROBES:
        return None
    return "one of " + ", ".join(repr(p) for p in HEALTH_PROBES)


def _train_shards(value: Any) -> str | None:
    return None if value in ("per_rank", "replicated") else "'per_rank' or 'replicated'"


def _setting(default: Any, check: Callable[[Any], str | None], doc: str, **kw: Any) -> Any:
    if "default_factory" in kw:
        return field(default_factory=kw["default_factory"], metadata={"check": check, "doc": doc})
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True)
class GracefulConfig:
    """Every knob of ray_graceful, validated when built. See docs/configuration.md."""

    teardown_timeout_s: float = _setting(
        25.0,
        _seconds,
        "Deadline for a rank's teardown, counted from the notice, when the notice carries no "
        "deadline of its own (a SIGTERM). Fits Kubernetes' default 30 s grace period.",
    )
    watchdog_margin_s: float = _setting(
        1.0,
        _seconds,
        "The watchdog hard-exits the process this long before the deadline, whatever the "
        "teardown is doing.",
    )
    save_budget_s: float = _setting(
        15.0,
        _seconds,
        "The most time a rank's emergency checkpoint may take; a save still running then is "
        "abandoned and never marked complete.",
    )
    cuda_sync_timeout_s: float = _setting(
        5.0,
        _seconds,
        "Bound on torch.cuda.synchronize() during teardown (runs on a helper thread; a wedged "
        "device does not hold the rank).",
    )
    destroy_timeout_s: float = _setting(
        2.0,
        _seconds,
        "Bound on destroy_process_group() during teardown (runs on a helper thread).",
    )
    exit_grace_s: float = _setting(
        2.0,
        _seconds,
        "How long Ray's intended-exit path may take (it waits for the actor's running task to "
        "return) before the rank exits hard with os._exit.",
    )
    exit_code: int = _setting(
        0,
        _exit_code,
        "Exit status of a hard exit (watchdog, second signal, Ray's exit path not taken). "
        "Ray's intended-exit path always ends with 0.",
    )
    order_wait_s: float = _setting(
        2.0,
        _seconds,
        "After reporting a SIGTERM to the coordinator, how long a rank waits for its order "
        "before tearing itself down on its own.",
    )
    strict: bool = _setting(
        False,
        _boolean,
        "Make graceful_setup raise instead of warn when the SIGTERM listener cannot be "
        "installed (not on the main thread, and neither __init__ nor the setup hook did it).",
    )
    checkpoint_dir: str | None = _setting(
        None,
        _optional_path,
        "Directory for emergency checkpoints; unset means no rank saves one.",
    )
    report_dir: str = _setting(
        None,
        _path,
        "Directory where each rank writes its TeardownReport as JSON.",
        default_factory=_default_report_dir,
    )
    coordinator_name: str = _setting(
        "ray_graceful_coordinator",
        _name,
        "Name of the coordinator actor that workers look up in their Ray namespace.",
    )
    coordinator_namespace: str = _setting(
        "ray_graceful",
        _name,
        "Ray namespace of the coordinator actor: fixed, so workers of any job and the CLI "
        "(ray-graceful notify) find it without knowing the job's namespace.",
    )
    notice_gather_s: float = _setting(
        0.2,
        _seconds_or_zero,
        "After the first notice of a cycle, how long the coordinator gathers further notices "
        "(a drain and a fault together, a SIGTERM to every rank) before it plans.",
    )
    drain_poll_interval_s: float = _setting(
        1.0,
        _seconds,
        "How often the coordinator polls Ray's drain state (the notice that carries a node's "
        "deadline).",
    )
    health_interval_s: float = _setting(
        5.0,
        _seconds,
        "How often each worker checks its GPUs' health and renews its long poll to the "
        "coordinator (so a FAULTY verdict becomes a notice within this time).",
    )
    quiesce_timeout_s: float = _setting(
        2.0,
        _seconds,
        "Before an emergency save, how long to wait for the training thread to leave its step "
        "(released from its collective, or at should_stop); a save is not started mid-step.",
    )
    expected_save_s: float = _setting(
        5.0,
        _seconds,
        "The planner's estimate of one shard's emergency save time until a save was measured.",
    )
    plan_margin_s: float = _setting(
        1.0,
        _seconds_or_zero,
        "Slack the planner keeps between a saver's expected finish and its deadline.",
    )
    health_probe: str = _setting(
        "auto",
        _probe,
        "GPU health source: 'auto' (NVML where present, else UNKNOWN), 'nvml', 'none', or "
        "'scripted' (reads faults from health_script_path; tests and the demo only).",
    )
    health_script_path: str | None = _setting(
        None,
        _optional_path,
        "File the scripted probe reads injected faults from (health_probe='scripted').",
    )
    fatal_xids: tuple[int, ...] = _setting(
        DEFAULT_FATAL_XIDS, _xids, "XIDs that make a GPU FAULTY (its ranks never save)."
    )
    degraded_xids: tuple[int, ...] = _setting(
        DEFAULT_DEGRADED_XIDS, _xids, "XIDs that make a GPU DEGRADED (it may save, last choice)."
    )
    ignored_xids: tuple[int, ...] = _setting(
        DEFAULT_IGNORED_XIDS, _xids, "XIDs caused by applications, not hardware; ignored."
    )
    train_shards: str = _setting(
        "per_rank",
        _train_shards,
        "Ray Train callback: 'per_rank' (every rank holds its own state: FSDP, sharded) or "
        "'replicated' (every rank holds the same state: DDP; one rank saves).",
    )
    nologin_path: str = _setting(
        "/run/nologin",
        _path,
        "Marker file whose presence means the host is shutting down (its ranks skip saving).",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            allowed = f.metadata["check"](value)
            if allowed is not None:
                raise ConfigError(
                    f"GracefulConfig.{f.name} = {value!r} is not allowed: must be {allowed}."
                )
        if self.watchdog_margin_s >= self.teardown_timeout_s:
            raise ConfigError(
                f"GracefulConfig.watchdog_margin_s = {self.watchdog_margin_s} must be smaller "
                f"than teardown_timeout_s = {self.teardown_timeout_s}."
            )
        if self.save_budget_s + self.watchdog_margin_s > self.teardown_timeout_s:
            raise ConfigError(
                f"GracefulConfig.save_budget_s = {self.save_budget_s} does not fit: "
                f"save_budget_s + watchdog_margin_s ({self.watchdog_margin_s}) must be at most "
                f"teardown_timeout_s = {self.teardown_timeout_s}."
            )
        overlap = set(self.fatal_xids) & set(self.ignored_xids)
        if overlap:
            raise ConfigError(
                f"GracefulConfig: XIDs {sorted(overlap)} are both fatal_xids and ignored_xids; "
                "an XID may be in one list only."
            )
        if self.health_probe == "scripted" and self.health_script_path is None:
            raise ConfigError(
                "GracefulConfig.health_probe = 'scripted' needs health_script_path: the file "
                "the scripted probe reads faults from."
            )

    # --- environment ---------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GracefulConfig:
        """Build from ``RAY_GRACEFUL_<FIELD>`` variables; keyword overrides win over them."""
        env = os.environ if environ is None else environ
        known = {ENV_PREFIX + f.name.upper(): f for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, raw in env.items():
            if not name.startswith(ENV_PREFIX) or name in RAY_OWN_VARIABLES:
                continue
            f = known.get(name)
            if f is None:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]}?" if close else ""
                raise ConfigError(
                    f"{name} is not a ray_graceful setting.{hint} "
                    f"Allowed: {', '.join(sorted(known))}."
                )
            values[f.name] = _parse_env(name, raw, f)
        values.update(overrides)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables that make ``from_env()`` rebuild this config (non-defaults only)."""
        out = {}
        default = GracefulConfig()
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name) and f.name != "report_dir":
                out[ENV_PREFIX + f.name.upper()] = _format_env(value)
            elif f.name == "report_dir" and value != _default_report_dir():
                out[ENV_PREFIX + f.name.upper()] = value
        return out

    def replace(self, **changes: Any) -> GracefulConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _format_env(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(x) for x in value)
    return "" if value is None else str(value)


def _parse_env(name: str, raw: str, f: dataclasses.Field) -> Any:
    text = raw.strip()
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))

    def bad(allowed: str) -> ConfigError:
        return ConfigError(f"{name}={raw!r} is not allowed: must be {allowed}.")

    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise bad(f.metadata["check"]("x") or "a number") from None
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise bad(f.metadata["check"]("x") or "an integer") from None
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise bad("one of 1, true, yes, on, 0, false, no, off")
    if kind.startswith("tuple"):
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise bad("comma-separated XID numbers, e.g. '48,79,95'") from None
    if kind == "str | None":
        return text or None
    return text


def config_reference_markdown() -> str:
    """The configuration reference in docs/configuration.md, generated from the fields."""
    lines = [
        "| field | environment variable | default | meaning |",
        "|---|---|---|---|",
    ]
    default = GracefulConfig()
    for f in fields(GracefulConfig):
        shown = (
            "(system temp)/ray_graceful/reports"
            if f.name == "report_dir"
            else repr(getattr(default, f.name))
        )
        lines.append(
            f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | `{shown}` | {f.metadata['doc']} |"
        )
    return "\n".join(lines) + "\n"
