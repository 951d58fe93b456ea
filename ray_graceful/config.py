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

import dataclasses
import difflib
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from . import config_values as allowed
from .config_values import (  # noqa: F401 (part of this API)
    HEALTH_PROBES,
    MAX_SECONDS,
    ConfigError,
    env_text,
    parse_env_text,
)
from .notices import short

ENV_PREFIX = "RAY_GRACEFUL_"

# Ray's own variables that share our prefix (Ray 2.60's ray_constants.py). They are Ray's to
# read; from_env leaves them be, and the whole RAY_GRACEFUL_SHUTDOWN_ family with them.
RAY_OWN_VARIABLES = frozenset(
    {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "RAY_GRACEFUL_SHUTDOWN_POLL_INTERVAL_S"}
)
RAY_OWN_PREFIX = "RAY_GRACEFUL_SHUTDOWN_"

# NVIDIA's XID catalog, as mirrored by public GPU-health tools (see docs/health.md).
DEFAULT_FATAL_XIDS = (46, 48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 143)
DEFAULT_DEGRADED_XIDS = (63, 92, 94)
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)


def _default_report_dir() -> str:
    # Not "<tmp>/ray_graceful": a folder named like the package shadows it for any script run
    # from the temp dir with an editable install.
    return os.path.join(tempfile.gettempdir(), "ray-graceful-reports")


def _setting(default: Any, check: Callable[[Any], str | None], doc: str, **kw: Any) -> Any:
    if "default_factory" in kw:
        return field(default_factory=kw["default_factory"], metadata={"check": check, "doc": doc})
    return field(default=default, metadata={"check": check, "doc": doc})


@dataclass(frozen=True)
class GracefulConfig:
    """Every knob of ray_graceful, validated when built. See docs/configuration.md."""

    teardown_timeout_s: float = _setting(
        25.0,
        allowed.seconds,
        "Deadline for a rank's teardown, counted from the notice, when the notice carries no "
        "deadline of its own (a SIGTERM). Fits Kubernetes' default 30 s grace period.",
    )
    watchdog_margin_s: float = _setting(
        1.0,
        allowed.seconds,
        "The watchdog hard-exits the process this long before the deadline, whatever the "
        "teardown is doing.",
    )
    save_budget_s: float = _setting(
        15.0,
        allowed.seconds,
        "The most time a rank's emergency checkpoint may take; a save still running then is "
        "abandoned and never marked complete.",
    )
    cuda_sync_timeout_s: float = _setting(
        5.0,
        allowed.seconds,
        "Bound on waiting for the device's queued work during teardown (polled, so a wedged "
        "device or a collective a departed peer never joins does not hold the rank).",
    )
    destroy_timeout_s: float = _setting(
        2.0,
        allowed.seconds,
        "Bound on destroy_process_group() during teardown (runs on a helper thread).",
    )
    exit_grace_s: float = _setting(
        2.0,
        allowed.between(0.0, 60.0),
        "How long Ray's intended-exit path may take (it waits for the actor's running task to "
        "return) before Ray is asked to kill the actor (still an intended exit, status 1).",
    )
    exit_code: int = _setting(
        0,
        allowed.exit_code,
        "Exit status of a hard exit (watchdog, second signal, Ray's exit path not taken). "
        "Ray's intended-exit path always ends with 0.",
    )
    order_wait_s: float = _setting(
        2.0,
        allowed.between(0.0, 60.0),
        "After reporting a SIGTERM to the coordinator, how long a rank waits for its order "
        "before tearing itself down on its own. While Ray restarts the coordinator the rank "
        "waits for the new one's order longer, as long as its own save would still fit.",
    )
    strict: bool = _setting(
        False,
        allowed.boolean,
        "Make graceful_setup raise instead of warn when the SIGTERM listener cannot be "
        "installed (not on the main thread, and neither __init__ nor the setup hook did it).",
    )
    checkpoint_dir: str | None = _setting(
        None,
        allowed.optional_path,
        "Directory for emergency checkpoints; unset means no rank saves one.",
    )
    report_dir: str = _setting(
        None,
        allowed.path,
        "Directory where each rank writes its TeardownReport as JSON.",
        default_factory=_default_report_dir,
    )
    coordinator_name: str = _setting(
        "",
        allowed.optional_name,
        "Name of the coordinator actor. Empty (the default): one coordinator per Ray job, named "
        "after the job, so one job's notices can never stop another's ranks. A name shares one "
        "coordinator between the jobs that give it (they must trust each other).",
    )
    coordinator_namespace: str = _setting(
        "ray_graceful",
        allowed.name,
        "Ray namespace of the coordinator actor: fixed, so workers of any job and the CLI "
        "(ray-graceful notify) find it without knowing the job's namespace.",
    )
    coordinator_max_restarts: int = _setting(
        3,
        allowed.count(0, 100, "a number of restarts"),
        "How often Ray restarts the coordinator actor after its process dies (an OOM kill, a "
        "segfault), on the driver's node. The restarted coordinator reads the cycle count and "
        "any cycle in flight back from report_dir and checkpoint_dir, and the ranks register "
        "with it again on their own. 0: it is never restarted.",
    )
    coordinator_reconnect_s: float = _setting(
        30.0,
        allowed.between(0.0, 600.0),
        "How long a rank's control channel keeps registering again with a coordinator that Ray "
        "is restarting. While no coordinator is reachable, a rank that tears itself down "
        "releases its peers through the process group's store.",
    )
    node_agent: str = _setting(
        "auto",
        allowed.node_agent,
        "Relay each node's ranks through one node agent (one registration, one long poll, one "
        "NVML probe per GPU per node): 'on', 'off' (every process polls the coordinator), or "
        "'auto' (on for groups of 32 ranks or more).",
    )
    node_group_size: int = _setting(
        64,
        allowed.count(0, 4096, "a number of nodes"),
        "How many node agents the coordinator answers itself. Past that many nodes, further "
        "node agents poll through group agents of this many nodes each, started on the "
        "coordinator's node: one reply per group instead of one per node when an order goes "
        "out. 0: every node agent polls the coordinator itself.",
    )
    notice_gather_s: float = _setting(
        0.2,
        allowed.between(0.0, 10.0, low_open=False),
        "After the first notice of a cycle, the longest the coordinator gathers further "
        "notices (a drain and a fault together, a SIGTERM to every rank) before it plans; "
        "while every notice is a SIGTERM it plans as soon as every process on the nodes they "
        "touched has one.",
    )
    drain_poll_interval_s: float = _setting(
        0.25,
        allowed.between(0.05, 60.0, low_open=False),
        "How often the coordinator polls Ray's drain state (the notice that carries a node's "
        "deadline); one poll costs the GCS about 0.26 ms of CPU (docs/benchmarks.md).",
    )
    health_interval_s: float = _setting(
        5.0,
        allowed.between(0.1, 300.0, low_open=False),
        "How often each worker checks its GPUs' health and renews its long poll to the "
        "coordinator (so a FAULTY verdict becomes a notice within this time).",
    )
    quiesce_timeout_s: float = _setting(
        2.0,
        allowed.seconds,
        "How long the teardown waits for the training thread to reach its step boundary "
        "(parked in should_stop(step)) or leave its loop; a thread inside a collective is "
        "released first, then waited for as long again. A save never starts mid-step.",
    )
    expected_save_s: float = _setting(
        5.0,
        allowed.seconds,
        "The planner's estimate of one shard's emergency save time until a save was measured.",
    )
    plan_margin_s: float = _setting(
        1.0,
        allowed.seconds_or_zero,
        "Slack the planner keeps between a saver's expected finish and its deadline.",
    )
    health_probe: str = _setting(
        "auto",
        allowed.probe,
        "GPU health source: 'auto' (NVML where present, else UNKNOWN), 'nvml', 'none', or "
        "'scripted' (reads faults from health_script_path; tests and the demo only).",
    )
    health_script_path: str | None = _setting(
        None,
        allowed.optional_path,
        "File the scripted probe reads injected faults from (health_probe='scripted').",
    )
    fatal_xids: tuple[int, ...] = _setting(
        DEFAULT_FATAL_XIDS, allowed.xids, "XIDs that make a GPU FAULTY (its ranks never save)."
    )
    degraded_xids: tuple[int, ...] = _setting(
        DEFAULT_DEGRADED_XIDS,
        allowed.xids,
        "XIDs that make a GPU DEGRADED (it may save, last choice).",
    )
    ignored_xids: tuple[int, ...] = _setting(
        DEFAULT_IGNORED_XIDS, allowed.xids, "XIDs caused by applications, not hardware; ignored."
    )
    train_shards: str = _setting(
        "per_rank",
        allowed.train_shards,
        "Ray Train callback: 'per_rank' (every rank holds its own state: FSDP, sharded) or "
        "'replicated' (every rank holds the same state: DDP; one rank saves).",
    )
    nologin_path: str = _setting(
        "/run/nologin",
        allowed.path,
        "Marker file whose presence means the host is shutting down (its ranks skip saving).",
    )
    cloud_notices: str = _setting(
        "off",
        allowed.cloud,
        "Read the cloud's own eviction notices from the instance metadata service, one poller "
        "per node: 'auto' (detect AWS, GCE or Azure; silent elsewhere), 'aws', 'gce', 'azure', "
        "or 'off'. Off by default: it makes HTTP requests to the metadata address.",
    )
    cloud_metadata_url: str | None = _setting(
        None,
        allowed.optional_path,
        "Base URL of the metadata service (default: each cloud's documented address); a "
        "stand-in server's address in tests.",
    )
    cloud_poll_interval_s: float = _setting(
        5.0,
        allowed.between(0.1, 300.0, low_open=False),
        "How often the node's poller reads the metadata service (AWS recommends 5 s).",
    )
    cloud_drain: bool = _setting(
        False,
        allowed.boolean,
        "Also ask Ray to drain the node with the cloud's deadline, so Ray's autoscaler and Ray "
        "Train's own preemption handling see the same event.",
    )

    host_watch: bool = _setting(
        False,
        allowed.boolean,
        "Detect a host lost without a word (crash, power loss, cut link) in about a second: "
        "ranks relay through node agents, which beat; a silent host is probed (docs/concepts).",
    )
    host_heartbeat_s: float = _setting(
        0.1, allowed.between(0.01, 10.0, low_open=False), "Host watch: the heartbeat's period."
    )
    host_suspect_s: float = _setting(
        0.5,
        allowed.between(0.05, 60.0, low_open=False),
        "Host watch: silence after which a host's raylet is probed (> host_heartbeat_s).",
    )
    host_confirm_s: float = _setting(
        0.5,
        allowed.between(0.05, 60.0, low_open=False),
        "Host watch: the probe's bound; a host whose kernel accepts in time is not lost.",
    )
    memory_replicas: int = _setting(
        0,
        allowed.count(0, 8, "a number of nodes"),
        "Memory tier: how many nodes that are not being evicted hold each shard of an "
        "emergency checkpoint in memory (a keeper actor per node), persisted to checkpoint_dir "
        "in the background. 0: no memory tier, saves go to checkpoint_dir as before.",
    )
    memory_budget_mb: int = _setting(
        8192,
        allowed.count(1, 1 << 24, "megabytes"),
        "Memory tier: the most one node's keeper holds; a shard that does not fit is saved to "
        "checkpoint_dir instead, and the outcome says so.",
    )

    warm_restart: bool = _setting(
        False,
        allowed.boolean,
        "Hand-built groups: at an eviction the surviving ranks keep their processes (and "
        "model, optimizer, CUDA context), spares take the evicted slots, and the group is "
        "re-formed in place (docs/worker.md, 'Warm restart'). Off: every rank leaves.",
    )
    warm_restart_holds: bool = _setting(
        True,
        allowed.boolean,
        "Warm restart with a memory tier: a survivor holds its own shard as a snapshot in its "
        "memory and trains on at once; the snapshot reaches the keepers and disk in the "
        "background (docs/memory-tier.md, 'Held, in the keepers, durable'). Off: survivors "
        "save before anyone trains again.",
    )
    min_world_size: int = _setting(
        0,
        allowed.count(0, 1 << 24, "a number of ranks"),
        "Warm restart: the fewest ranks a group may continue with when no spare is free for an "
        "evicted slot (only where every shard keeps a holder). 0: the group keeps its size, or "
        "every rank leaves.",
    )
    rejoin_timeout_s: float = _setting(
        30.0,
        allowed.seconds,
        "Warm restart: how long a member waits for the next cycle's group to form (and for "
        "the driver to call it back) before it leaves cleanly instead.",
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            allowed = f.metadata["check"](value)
            if allowed is not None:
                shown = short(value)
                raise ConfigError(
                    f"GracefulConfig.{f.name} = {shown} is not allowed: must be {allowed}."
                )
        if self.host_suspect_s <= self.host_heartbeat_s:
            raise ConfigError(
                f"GracefulConfig.host_suspect_s = {self.host_suspect_s} must be longer than "
                f"host_heartbeat_s = {self.host_heartbeat_s} (suspected after missed heartbeats)."
            )
        if self.watchdog_margin_s >= self.teardown_timeout_s:
            raise ConfigError(
                f"GracefulConfig.watchdog_margin_s = {self.watchdog_margin_s} must be smaller "
                f"than teardown_timeout_s = {self.teardown_timeout_s}."
            )
        if self.order_wait_s + self.watchdog_margin_s > self.teardown_timeout_s:
            raise ConfigError(
                f"GracefulConfig.order_wait_s = {self.order_wait_s} does not fit: a SIGTERMed "
                "rank waits that long for its order inside its own teardown time, so "
                f"order_wait_s + watchdog_margin_s ({self.watchdog_margin_s}) must be at most "
                f"teardown_timeout_s = {self.teardown_timeout_s}."
            )
        if self.save_budget_s + self.watchdog_margin_s > self.teardown_timeout_s:
            raise ConfigError(
                f"GracefulConfig.save_budget_s = {self.save_budget_s} does not fit: "
                f"save_budget_s + watchdog_margin_s ({self.watchdog_margin_s}) must be at most "
                f"teardown_timeout_s = {self.teardown_timeout_s}."
            )
        lists = {
            "fatal_xids": self.fatal_xids,
            "degraded_xids": self.degraded_xids,
            "ignored_xids": self.ignored_xids,
        }
        names = list(lists)
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                overlap = set(lists[first]) & set(lists[second])
                if overlap:
                    raise ConfigError(
                        f"GracefulConfig: XIDs {sorted(overlap)} are both {first} and "
                        f"{second}; an XID may be in one list only."
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
            if not name.startswith(ENV_PREFIX) or is_rays_own(name):
                continue
            f = known.get(name)
            if f is None:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f" Did you mean {close[0]}?" if close else ""
                raise ConfigError(
                    f"{name} is not a ray_graceful setting.{hint} "
                    f"Allowed: {', '.join(sorted(known))}."
                )
            values[f.name] = parse_env_text(name, raw, f)
        values.update(overrides)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The variables that make ``from_env()`` rebuild this config (non-defaults only)."""
        out = {}
        default = GracefulConfig()
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name) and f.name != "report_dir":
                out[ENV_PREFIX + f.name.upper()] = env_text(value)
            elif f.name == "report_dir" and value != _default_report_dir():
                out[ENV_PREFIX + f.name.upper()] = value
        return out

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def replace(self, **changes: Any) -> GracefulConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def is_rays_own(name: str) -> bool:
    """Whether ``name`` is one of Ray's own ``RAY_GRACEFUL_*`` variables (not a setting of ours)."""
    return name in RAY_OWN_VARIABLES or name.startswith(RAY_OWN_PREFIX)


def config_reference_markdown() -> str:
    """The configuration reference in docs/configuration.md, generated from the fields."""
    lines = [
        "| field | environment variable | default | meaning |",
        "|---|---|---|---|",
    ]
    default = GracefulConfig()
    for f in fields(GracefulConfig):
        shown = (
            "(system temp)/ray-graceful-reports"
            if f.name == "report_dir"
            else repr(getattr(default, f.name))
        )
        lines.append(
            f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | `{shown}` | {f.metadata['doc']} |"
        )
    return "\n".join(lines) + "\n"
