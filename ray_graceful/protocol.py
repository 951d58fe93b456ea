"""Everything that crosses between a worker process and the coordinator, typed to its leaves.

One way: notice -> plan -> order -> acknowledgement -> report -> outcome. Workers send
``Register``, ``PollState`` (with each long poll), ``SigtermSeen``, ``Ack``, ``SaveResult``,
``SaveTurn`` (a backup asking whether to save) and their ``TeardownReport``; the coordinator
answers a ``Reply``, a ``TurnAnswer``, or to a poll a ``PollAnswer`` that may carry an
``Order``; spares get ``SpareOrder``; a warm restart's members get a ``Rendezvous`` and say
``Rejoined``. Closed sets of words are enums (``Word``). A message is built once, checked where
it arrives (``check()``) and read by field; each carries ``PROTOCOL_VERSION``, and another
version is refused with a reason. A *rank* is a (group, rank) pair (``RankKey``); a *shard
label* is what a rank holds in its group ("0", "model"); a *shard key* is ``"<group>/<label>"``,
a shard's name in a checkpoint.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .checkpoint.records import ShardRecord, shard_key
from .config import GracefulConfig
from .health import HealthReport

PROTOCOL_VERSION = 1
DEFAULT_NAME = "ray_graceful_coordinator"  # + "-<job id>": one coordinator per job

RankKey = tuple[str, int]


class ProtocolError(ValueError):
    """A message is malformed; the message says which field and what is allowed."""


class Word(str, enum.Enum):
    """A closed set of words: compares, prints and serialises (JSON) as its plain string."""

    def __str__(self) -> str:
        return str(self.value)


class Action(Word):
    """What the plan has one rank do (``plan.RankOrder.action``)."""

    SAVE = "save"  # save its shard, then leave
    BACKUP = "backup"  # save its shard only if the shard's saver cannot
    LEAVE = "leave"  # leave without saving


class PollKind(Word):
    """What a long poll's answer is."""

    ORDER = "order"  # an Order: tear down
    IDLE = "idle"  # nothing within the poll's wait: poll again
    UNKNOWN = "unknown"  # this process is not registered
    STALE = "stale"  # the poll named a cycle that is not the current one
    AWAY = "away"  # (from a node agent) the coordinator is restarting or gone: register again


class StepStatus(Word):
    """How one teardown step went."""

    RUNNING = "running"
    RAN = "ran"
    SKIPPED = "skipped"  # with the reason in its detail
    FAILED = "failed"  # with the error in its detail
    INTERRUPTED = "interrupted"  # the deadline's watchdog ended the process during it


class Result(Word):
    """What a cycle came to (``TerminationOutcome.result``)."""

    COMMITTED = "committed"  # every shard of the plan at one step: a restart loads it
    ABANDONED = "abandoned"  # nothing committed, with the reason
    NO_CHECKPOINT = "no-checkpoint"  # nowhere to write: no checkpoint_dir, no memory tier
    RAY_TRAIN = "ray-train"  # the savers reported to Ray Train (ray.train.get_checkpoint())
    FAILED = "failed"  # the coordinator could not conclude normally (the reason says why)


def coordinator_name(config: GracefulConfig, job_id: str) -> str:
    """The coordinator's actor name - where a rank finds it: the configured one, else one per
    Ray job, so that a second job on the same cluster never registers with, or is stopped by,
    the first job's coordinator."""
    return config.coordinator_name or f"{DEFAULT_NAME}-{job_id}"


def check_version(message: object) -> None:
    version = getattr(message, "version", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"{type(message).__name__} has protocol version {version!r}, this coordinator speaks "
            f"{PROTOCOL_VERSION}: run the same ray_graceful on the driver and the workers"
        )


def _text(value: object, name: str, limit: int = 200) -> None:
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"{name} must be a string of at most {limit} characters")


def _non_negative_int(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{name} must be an integer >= 0")


@dataclass(frozen=True)
class RankSpec:
    """One rank a worker process holds, as it registers it."""

    group: str
    rank: int
    world_size: int
    shard: str  # the shard label
    can_save: bool
    train_fn_saves: bool = False  # the training function saves (Ray Train)
    gpus: tuple[int, ...] = ()

    @property
    def key(self) -> RankKey:
        return (self.group, self.rank)

    @property
    def shard_key(self) -> str:
        return shard_key(self.group, self.shard)

    def check(self) -> None:
        _text(self.group, "group")
        if not self.group:
            raise ProtocolError("group must not be empty")
        _non_negative_int(self.rank, "rank")
        _non_negative_int(self.world_size, "world_size")
        if self.world_size and self.rank >= self.world_size:
            raise ProtocolError(
                f"rank {self.rank} is not below world_size {self.world_size}: ranks run from 0 "
                "to world_size-1"
            )
        _text(self.shard, "shard")


@dataclass(frozen=True)
class Register:
    """A worker process registers its ranks (again after a restart: the newest wins)."""

    process_id: str
    node_id: str
    pid: int
    hostname: str
    job_id: str
    ranks: tuple[RankSpec, ...]
    actor_id: str = ""
    version: int = PROTOCOL_VERSION

    def check(self) -> None:
        check_version(self)
        for name in ("process_id", "node_id", "hostname", "job_id", "actor_id"):
            _text(getattr(self, name), name)
        _non_negative_int(self.pid, "pid")
        if not isinstance(self.ranks, tuple) or len(self.ranks) > 4096:
            raise ProtocolError("ranks must be a tuple of at most 4096 RankSpec")
        for spec in self.ranks:
            if not isinstance(spec, RankSpec):
                raise ProtocolError(f"ranks holds a {type(spec).__name__}, not a RankSpec")
            spec.check()


@dataclass(frozen=True)
class PollState:
    """What a worker tells the coordinator with each long poll."""

    last_step: int | None = None
    health: HealthReport | None = None


@dataclass(frozen=True)
class SaveAssignment:
    """Save this rank's shard under ``root``; a backup only if rank ``backup_for`` cannot.

    A backup asks (``SaveTurn``) by ``start_by`` at the latest, the last moment its own save
    still fits before its deadline; until then it stays parked, its state intact.
    """

    group: str
    rank: int
    shard_key: str
    root: str
    backup_for: int | None = None
    start_by: float = 0.0
    keepers: tuple[str, ...] = ()  # memory tier: the keepers that hold it (else: to ``root``)

    @property
    def is_backup(self) -> bool:
        return self.backup_for is not None

    @property
    def key(self) -> RankKey:
        return (self.group, self.rank)


@dataclass(frozen=True)
class Order:
    """The coordinator's order to one worker process: tear down by ``deadline``.

    Delivered at least once: the coordinator answers every poll with it until the process
    acknowledges ``order_id``; handling it is idempotent on the worker side.
    """

    job_id: str
    cycle: int
    order_id: str
    deadline: float
    trigger: str
    saves: tuple[SaveAssignment, ...] = ()
    skip_reason: str = ""
    save_budget_s: float = 0.0
    # Warm restart: this process survives. Its teardown ends without an exit, and it waits for
    # the next cycle's ``Rendezvous`` (``worker/rejoin.py``) instead.
    rejoin: bool = False
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class PollAnswer:
    """The answer to a long poll: an order, nothing yet, or why the poll is refused."""

    kind: PollKind
    order: Order | None = None
    reason: str = ""


@dataclass(frozen=True)
class Ack:
    """A worker process has its order (so it is not sent again)."""

    process_id: str
    cycle: int
    order_id: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class SigtermSeen:
    """A worker's listener saw SIGTERM: every rank of that process is being evicted."""

    process_id: str
    cycle: int
    received_at: float
    version: int = PROTOCOL_VERSION

    def check(self) -> None:
        check_version(self)
        if (
            not isinstance(self.received_at, (int, float))
            or isinstance(self.received_at, bool)
            or not math.isfinite(self.received_at)
            or self.received_at <= 0
        ):
            raise ProtocolError(
                f"received_at {self.received_at!r} is not allowed: Unix seconds (finite, > 0)"
            )


@dataclass(frozen=True)
class SaveResult:
    """A saver's save step ended: which shard keys it saved, which it could not, and why."""

    process_id: str
    cycle: int
    saved: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    reason: str = ""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class SaveTurn:
    """A backup saver asks whether it must save ``shard_key`` (answered: ``TurnAnswer``)."""

    process_id: str
    cycle: int
    shard_key: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class TurnAnswer:
    """The answer to a backup's ``SaveTurn``: save or not, and why (the saver's fate)."""

    save: bool
    why: str
    cycle: int | None = None
    accepted: bool = True  # False: the turn was refused (``why`` says why); do not save
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Reply:
    """The coordinator's answer to anything but a poll."""

    accepted: bool
    reason: str = ""
    cycle: int | None = None
    details: dict = field(default_factory=dict)
    retry: bool = False  # refused for now only: the same message is accepted later

    @classmethod
    def ok(cls, cycle: int | None = None, **details: object) -> Reply:
        return cls(True, "", cycle, dict(details))

    @classmethod
    def refused(cls, reason: str, cycle: int | None = None, retry: bool = False) -> Reply:
        return cls(False, reason, cycle, retry=retry)


@dataclass(frozen=True)
class SpareOrder:
    """What ends a spare's or standby's wait: exit, or a slot to take (spares only)."""

    action: str  # "exit" | "assigned"
    reason: str = ""
    group: str | None = None
    rank: int | None = None
    cycle: int | None = None


@dataclass(frozen=True)
class Rendezvous:
    """A warm restart's answer to one member: "join" group ``group`` as ``rank`` of
    ``world_size`` through the store at ``store_host:store_port`` under ``prefix`` (one per
    cycle and group: a stale rank cannot join), then hold shard ``shard`` of step ``step`` -
    its own state if it can prove it is that step, else loaded; or "leave", with ``reason``."""

    action: str  # "join" | "leave"
    reason: str = ""
    cycle: int = 0
    group: str = ""
    rank: int = 0
    world_size: int = 0
    shard: str = ""
    step: int = -1
    store_host: str = ""
    store_port: int = 0
    prefix: str = ""
    timeout_s: float = 30.0
    was: str = ""  # "survivor of rank N" | "spare for rank N"


@dataclass(frozen=True)
class Rejoined:
    """What one member of a warm restart did ("joined" or "left"), loaded from where ("own
    state", "memory-local", "memory-peer", "disk"), and its ``seconds``: ``rendezvous`` (the
    group formed), ``register`` (registered in the new cycle) and ``load``."""

    action: str  # "joined" | "left"
    member: str = ""
    group: str = ""
    rank: int = -1
    world_size: int = 0
    step: int = -1
    cycle: int = 0
    was: str = ""
    loaded_from: str = ""
    reason: str = ""
    pid: int = 0
    node_id: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    version: int = PROTOCOL_VERSION

    @property
    def joined(self) -> bool:
        return self.action == "joined"


# How a process left: Ray's intended exit (status 0); Ray's kill of the actor, for a task that
# could not return (still recorded INTENDED_SYSTEM_EXIT, status 1); os._exit (outside Ray, or
# both of those failed); the deadline's watchdog; a second SIGTERM.
ExitPath = Literal["ray_intended", "ray_kill", "hard", "watchdog", "second-signal"]


@dataclass
class StepRecord:
    """One teardown step: what happened and when (seconds from the teardown's start)."""

    name: str
    status: StepStatus
    detail: str = ""
    started_s: float = 0.0
    duration_s: float = 0.0


@dataclass
class TeardownReport:
    """What one process's teardown did; JSON in ``report_dir`` and one log line."""

    pid: int
    hostname: str
    node_id: str
    job_id: str
    ranks: list[dict[str, Any]]
    trigger: str
    cycle: int
    started_at: float
    deadline: float
    steps: list[StepRecord] = field(default_factory=list)
    saved: list[ShardRecord] = field(default_factory=list)  # the shards it saved (or reused)
    last_step: int | None = None  # the last step boundary the training loop reported
    exit_path: ExitPath | None = None
    exit_code: int | None = None
    finished_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["steps"] = [asdict(s) for s in list(self.steps)]
        data["saved"] = [record.to_dict() for record in list(self.saved)]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeardownReport:
        values = dict(data)
        values["steps"] = [
            StepRecord(**{**s, "status": StepStatus(s["status"])}) for s in data.get("steps", [])
        ]
        values["saved"] = [ShardRecord.from_dict(record) for record in data.get("saved", [])]
        return cls(**values)

    def step(self, name: str) -> StepRecord:
        for record in self.steps:
            if record.name == name:
                return record
        raise KeyError(f"no step {name!r} in this report; steps: {[s.name for s in self.steps]}")

    def save_failure(self) -> str:
        """Why the save step saved nothing (or only part): its detail, else the exit path."""
        for record in self.steps:
            if record.name == "save":
                return f"save {record.status}: {record.detail}"[:300]
        return f"no save step ran (exit: {self.exit_path})"

    def summary(self) -> str:
        ranks = ",".join(f"{r['group']}/{r['rank']}" for r in self.ranks) or "-"
        steps = " ".join(f"{s.name}={s.status}({s.duration_s * 1000:.0f}ms)" for s in self.steps)
        return f"pid={self.pid} ranks={ranks} trigger={self.trigger} {steps} exit={self.exit_path}"
