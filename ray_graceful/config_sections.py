"""The settings of ``GracefulConfig``, in sections: one class per part of the plugin.

``GracefulConfig`` (``config.py``) is all of them at once - one flat, frozen model, built as
``GracefulConfig(warm_restart=True)`` and read as ``config.warm_restart`` - and adds the
environment, the errors and the checks. Each section here holds its settings, their ranges,
their documentation and the rules between them; ``SECTIONS`` orders them as
docs/configuration.md shows them.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Self

from .config_values import (
    CheckpointDir,
    CloudNotices,
    ConfigError,
    ExitCode,
    HealthProbe,
    Name,
    NameOrEmpty,
    NodeAgentMode,
    OptionalPath,
    Path,
    Seconds,
    SecondsOrZero,
    Switch,
    TrainShards,
    Xids,
    count,
    mode,
    seconds,
)

# NVIDIA's XID catalog, as mirrored by public GPU-health tools (see docs/health.md).
DEFAULT_FATAL_XIDS = (46, 48, 62, 64, 74, 79, 95, 119, 120, 136, 140, 143)
DEFAULT_DEGRADED_XIDS = (63, 92, 94)
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)

# The ranges of this config's settings (config_values has the kinds).
# A type checker sees each setting's plain type (users' checkers see float, int, the modes);
# pydantic sees the bounds and the words an error shows.
if TYPE_CHECKING:
    UpTo60s = float
    UpTo600s = float
    GatherWindow = float
    PollInterval = float
    SlowPoll = float
    Heartbeat = float
    Restarts = int
    NodeCount = int
    ReplicaCount = int
    Megabytes = int
    RankCount = int
    NodeAgent = NodeAgentMode
    Probe = HealthProbe
    Shards = TrainShards
    Cloud = CloudNotices
else:
    UpTo60s = seconds(0.0, 60.0)
    UpTo600s = seconds(0.0, 600.0)
    GatherWindow = seconds(0.0, 10.0, low_open=False)
    PollInterval = seconds(0.05, 60.0, low_open=False)
    SlowPoll = seconds(0.1, 300.0, low_open=False)
    Heartbeat = seconds(0.01, 10.0, low_open=False)
    Restarts = count(0, 100, "a number of restarts")
    NodeCount = count(0, 4096, "a number of nodes")
    ReplicaCount = count(0, 8, "a number of nodes")
    Megabytes = count(1, 1 << 24, "megabytes")
    RankCount = count(0, 1 << 24, "a number of ranks")
    NodeAgent = mode(NodeAgentMode)
    Probe = mode(HealthProbe)
    Shards = mode(TrainShards)
    Cloud = mode(CloudNotices)


def _default_report_dir() -> str:
    # Not "<tmp>/ray_graceful": a folder named like the package shadows it for any script run
    # from the temp dir with an editable install.
    return os.path.join(tempfile.gettempdir(), "ray-graceful-reports")


class Section(BaseModel):
    """A section of the settings: strict (``"5"`` is not a number of seconds), frozen, closed."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, use_attribute_docstrings=True
    )


class TeardownSettings(Section):
    """How a rank ends: its deadlines, its save, its exit, and where the records go."""

    teardown_timeout_s: Seconds = 25.0
    """Deadline for a rank's teardown, counted from the notice, when the notice carries no deadline
    of its own (a SIGTERM). Fits Kubernetes' default 30 s grace period."""

    watchdog_margin_s: Seconds = 1.0
    """The watchdog hard-exits the process this long before the deadline, whatever the teardown is
    doing."""

    save_budget_s: Seconds = 15.0
    """The most time a rank's emergency checkpoint may take; a save still running then is abandoned
    and never marked complete."""

    cuda_sync_timeout_s: Seconds = 5.0
    """Bound on waiting for the device's queued work during teardown (polled, so a wedged device or
    a collective a departed peer never joins does not hold the rank)."""

    destroy_timeout_s: Seconds = 2.0
    """Bound on destroy_process_group() during teardown (runs on a helper thread)."""

    exit_grace_s: UpTo60s = 2.0
    """How long Ray's intended-exit path may take (it waits for the actor's running task to return)
    before Ray is asked to kill the actor (still an intended exit, status 1)."""

    exit_code: ExitCode = 0
    """Exit status of a hard exit (watchdog, second signal, Ray's exit path not taken). Ray's
    intended-exit path always ends with 0."""

    order_wait_s: UpTo60s = 2.0
    """After reporting a SIGTERM to the coordinator, how long a rank waits for its order before
    tearing itself down on its own. While Ray restarts the coordinator the rank waits for the
    new one's order longer, as long as its own save would still fit."""

    strict: Switch = False
    """Make graceful_setup raise instead of warn when the SIGTERM listener cannot be installed (not
    on the main thread, and neither __init__ nor the setup hook did it)."""

    quiesce_timeout_s: Seconds = 2.0
    """How long the teardown waits for the training thread to reach its step boundary (parked in
    should_stop(step)) or leave its loop - a warm restart's agreement on the stop step included;
    a thread inside a collective is released first, then waited for as long again. A save never
    starts mid-step."""

    checkpoint_dir: CheckpointDir = None
    """Directory for emergency checkpoints; unset means no rank saves one. Absolute (``~`` is
    expanded); ``Coordinator.start`` and setup check that it is a directory this process can
    write, or can make."""

    report_dir: Path = Field(default_factory=_default_report_dir)
    """Directory where each rank writes its TeardownReport as JSON."""

    expected_save_s: Seconds = 5.0
    """The planner's estimate of one shard's emergency save time until a save was measured."""

    plan_margin_s: SecondsOrZero = 1.0
    """Slack the planner keeps between a saver's expected finish and its deadline."""

    train_shards: Shards = TrainShards.PER_RANK
    """Ray Train callback: 'per_rank' (every rank holds its own state: FSDP, sharded) or
    'replicated' (every rank holds the same state: DDP; one rank saves)."""

    @model_validator(mode="after")
    def _teardown_fits(self) -> Self:
        margin, teardown = self.watchdog_margin_s, self.teardown_timeout_s
        if margin >= teardown:
            raise ConfigError(
                f"GracefulConfig.watchdog_margin_s = {margin} must be smaller "
                f"than teardown_timeout_s = {teardown}."
            )
        if self.order_wait_s + margin > teardown:
            raise ConfigError(
                f"GracefulConfig.order_wait_s = {self.order_wait_s} does not fit: a SIGTERMed "
                "rank waits that long for its order inside its own teardown time, so "
                f"order_wait_s + watchdog_margin_s ({margin}) must be at most "
                f"teardown_timeout_s = {teardown}."
            )
        if self.save_budget_s + margin > teardown:
            raise ConfigError(
                f"GracefulConfig.save_budget_s = {self.save_budget_s} does not fit: "
                f"save_budget_s + watchdog_margin_s ({margin}) must be at most "
                f"teardown_timeout_s = {teardown}."
            )
        return self


class CoordinatorSettings(Section):
    """The job's coordinator: its name, its restarts, how ranks reach it, how it hears notices."""

    coordinator_name: NameOrEmpty = ""
    """Name of the coordinator actor. Empty (the default): one coordinator per Ray job, named after
    the job, so one job's notices can never stop another's ranks. A name shares one coordinator
    between the jobs that give it (they must trust each other)."""

    coordinator_namespace: Name = "ray_graceful"
    """Ray namespace of the coordinator actor: fixed, so workers of any job and the CLI
    (ray-graceful notify) find it without knowing the job's namespace."""

    coordinator_max_restarts: Restarts = 3
    """How often Ray restarts the coordinator actor after its process dies (an OOM kill, a
    segfault), on the driver's node. The restarted coordinator reads the cycle count and any
    cycle in flight back from report_dir and checkpoint_dir, and the ranks register with it
    again on their own. 0: it is never restarted."""

    coordinator_reconnect_s: UpTo600s = 30.0
    """How long a rank's control channel keeps registering again with a coordinator that Ray is
    restarting. While no coordinator is reachable, a rank that tears itself down releases its
    peers through the process group's store."""

    node_agent: NodeAgent = NodeAgentMode.AUTO
    """Relay each node's ranks through one node agent (one registration, one long poll, one NVML
    probe per GPU per node): 'on', 'off' (every process polls the coordinator), or 'auto' (on
    for groups of 32 ranks or more)."""

    node_group_size: NodeCount = 64
    """How many node agents the coordinator answers itself. Past that many nodes, further node
    agents poll through group agents of this many nodes each, started on the coordinator's node:
    one reply per group instead of one per node when an order goes out. 0: every node agent
    polls the coordinator itself."""

    notice_gather_s: GatherWindow = 0.2
    """After the first notice of a cycle, the longest the coordinator gathers further notices (a
    fault and a drain together, a SIGTERM to every rank) before it plans; while every notice is
    a SIGTERM or a drain it plans as soon as every process on the nodes they touched has one."""

    drain_poll_interval_s: PollInterval = 0.25
    """How often the coordinator polls Ray's drain state (the notice that carries a node's
    deadline); one poll costs the GCS about 0.26 ms of CPU (docs/benchmarks.md)."""


class HealthSettings(Section):
    """GPU health (NVML) and the host's own shutdown marker."""

    health_interval_s: SlowPoll = 5.0
    """How often each worker checks its GPUs' health and renews its long poll to the coordinator
    (so a FAULTY verdict becomes a notice within this time)."""

    health_probe: Probe = HealthProbe.AUTO
    """GPU health source: 'auto' (NVML where present, else UNKNOWN), 'nvml', 'none', or 'scripted'
    (reads faults from health_script_path; tests and the demo only)."""

    health_script_path: OptionalPath = None
    """File the scripted probe reads injected faults from (health_probe='scripted')."""

    fatal_xids: Xids = DEFAULT_FATAL_XIDS
    """XIDs that make a GPU FAULTY (its ranks never save)."""

    degraded_xids: Xids = DEFAULT_DEGRADED_XIDS
    """XIDs that make a GPU DEGRADED (it may save, last choice)."""

    ignored_xids: Xids = DEFAULT_IGNORED_XIDS
    """XIDs caused by applications, not hardware; ignored."""

    nologin_path: Path = "/run/nologin"
    """Marker file whose presence means the host is shutting down (its ranks skip saving)."""

    @model_validator(mode="after")
    def _health_fits(self) -> Self:
        lists = {"fatal_xids": self.fatal_xids, "degraded_xids": self.degraded_xids}
        lists["ignored_xids"] = self.ignored_xids
        for first, second in itertools.combinations(lists, 2):
            overlap = set(lists[first]) & set(lists[second])
            if overlap:
                raise ConfigError(
                    f"GracefulConfig: XIDs {sorted(overlap)} are both {first} and "
                    f"{second}; an XID may be in one list only."
                )
        if self.health_probe == HealthProbe.SCRIPTED and self.health_script_path is None:
            raise ConfigError(
                "GracefulConfig.health_probe = 'scripted' needs health_script_path: the file "
                "the scripted probe reads faults from."
            )
        return self


class CloudSettings(Section):
    """The cloud's own eviction notices, read from the instance metadata service."""

    cloud_notices: Cloud = CloudNotices.OFF
    """Read the cloud's own eviction notices from the instance metadata service, one poller per
    node: 'auto' (detect AWS, GCE or Azure; silent elsewhere), 'aws', 'gce', 'azure', or 'off'.
    Off by default: it makes HTTP requests to the metadata address."""

    cloud_metadata_url: OptionalPath = None
    """Base URL of the metadata service (default: each cloud's documented address); a stand-in
    server's address in tests."""

    cloud_poll_interval_s: SlowPoll = 5.0
    """How often the node's poller reads the metadata service (AWS recommends 5 s)."""

    cloud_drain: Switch = False
    """Also ask Ray to drain the node with the cloud's deadline, so Ray's autoscaler and Ray
    Train's own preemption handling see the same event."""


class HostWatchSettings(Section):
    """Hosts lost without a word: heartbeats from node agents, a probe of the silent."""

    host_watch: Switch = True
    """Detect a host lost without a word (crash, power loss, cut link) in about a second: ranks
    relay through node agents, which beat; a silent host is probed (docs/concepts). Off: such a
    host waits for Ray's verdict (13-15 s after a crash, about 64 s after a partition)."""

    host_heartbeat_s: Heartbeat = 0.1
    """Host watch: the heartbeat's period."""

    host_suspect_s: PollInterval = 0.5
    """Host watch: silence after which a host's raylet is probed (> host_heartbeat_s)."""

    host_confirm_s: PollInterval = 0.5
    """Host watch: the probe's bound; a host whose kernel accepts in time is not lost."""

    @model_validator(mode="after")
    def _host_watch_fits(self) -> Self:
        if self.host_suspect_s <= self.host_heartbeat_s:
            raise ConfigError(
                f"GracefulConfig.host_suspect_s = {self.host_suspect_s} must be longer than "
                f"host_heartbeat_s = {self.host_heartbeat_s} (suspected after missed heartbeats)."
            )
        return self


class MemorySettings(Section):
    """The memory tier: shards held in the memory of nodes that stay."""

    memory_replicas: ReplicaCount = 0
    """Memory tier: how many nodes that are not being evicted hold each shard of an emergency
    checkpoint in memory (a keeper actor per node), persisted to checkpoint_dir in the
    background. 0: no memory tier, saves go to checkpoint_dir. Not given: 1 with warm_restart
    (the held path: survivors hold their shards and train on, the keepers make the step
    durable behind the training), 0 without."""

    memory_budget_mb: Megabytes = 8192
    """Memory tier: the most one node's keeper holds; a shard that does not fit is saved to
    checkpoint_dir instead, and the outcome says so."""


class WarmRestartSettings(Section):
    """Warm restart: survivors keep their processes, spares take the evicted slots."""

    warm_restart: Switch = False
    """Hand-built groups: at an eviction the surviving ranks keep their processes (and model,
    optimizer, CUDA context), spares take the evicted slots, and the group is re-formed in place
    (docs/worker.md, 'Warm restart'). Off: every rank leaves."""

    warm_restart_holds: Switch = True
    """Warm restart with a memory tier: a survivor holds its own shard as a snapshot in its memory
    and trains on at once; the snapshot reaches the keepers and disk in the background
    (docs/memory-tier.md, 'Held, in the keepers, durable'). Off: survivors save before anyone
    trains again."""

    min_world_size: RankCount = 0
    """Warm restart: the fewest ranks a group may continue with when no spare is free for an
    evicted slot (only where every shard keeps a holder). 0: the group keeps its size, or every
    rank leaves."""

    rejoin_timeout_s: Seconds = 30.0
    """Warm restart: how long a member waits for the next cycle's group to form (and for the driver
    to call it back) before it leaves cleanly instead."""


# The sections as docs/configuration.md shows them: (title, section).
SECTIONS: tuple[tuple[str, type[Section]], ...] = (
    ("Teardown", TeardownSettings),
    ("Coordinator", CoordinatorSettings),
    ("Health", HealthSettings),
    ("Cloud notices", CloudSettings),
    ("Host watch", HostWatchSettings),
    ("Memory tier", MemorySettings),
    ("Warm restart", WarmRestartSettings),
)
