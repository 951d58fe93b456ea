"""The messages between a rank's worker process and the coordinator (or its node's agent).

One way: a process ``Register``s its ranks, long-polls with its ``PollState`` and is answered a
``PollAnswer`` that may carry a ``TeardownOrder``; it sends ``Ack`` (has the order),
``SigtermSeen``, ``SaveResult`` and, as a backup, ``SaveTurn`` (answered ``TurnAnswer``). Anything
else is answered a ``Reply``. A *rank* is a (group, rank) pair (``RankKey``); a *shard label* is
what a rank holds in its group ("0", "model"); a *shard key* is ``"<group>/<label>"``, a shard's
name in a checkpoint. A shard's one identity is ``ShardId(group, label)``, whose ``key`` that is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..checkpoint.records import ShardRecord, shard_key
from ..config import GracefulConfig
from ..health import HealthReport
from .checks import PROTOCOL_VERSION, ProtocolError, check_count, check_text, check_version
from .words import PollKind, Replacement

DEFAULT_NAME = "ray_graceful_coordinator"  # + "-<job id>": one coordinator per job

RankKey = tuple[str, int]


def coordinator_name(config: GracefulConfig, job_id: str) -> str:
    """The coordinator's actor name - where a rank finds it: the configured one, else one per
    Ray job, so that a second job on the same cluster never registers with, or is stopped by,
    the first job's coordinator."""
    return config.coordinator_name or f"{DEFAULT_NAME}-{job_id}"


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
    # Who takes this rank's slot when its process leaves: a spare, or the worker Ray Train
    # starts there (``ray_graceful/train/``)
    replaced_by: Replacement = Replacement.SPARE

    def __post_init__(self) -> None:
        object.__setattr__(self, "replaced_by", Replacement(self.replaced_by))

    @property
    def key(self) -> RankKey:
        return (self.group, self.rank)

    @property
    def shard_key(self) -> str:
        return shard_key(self.group, self.shard)

    def check(self) -> None:
        check_text(self.group, "group")
        if not self.group or "/" in self.group:
            raise ProtocolError(
                f"group {self.group!r} is not allowed: a non-empty name without '/' (it "
                "separates a group from its shard in a checkpoint's keys)"
            )
        check_count(self.rank, "rank")
        check_count(self.world_size, "world_size")
        if self.world_size and self.rank >= self.world_size:
            raise ProtocolError(
                f"rank {self.rank} is not below world_size {self.world_size}: ranks run from 0 "
                "to world_size-1"
            )
        check_text(self.shard, "shard")


def _is_actor_id(text: str) -> bool:
    """Ray's ActorID in hex: 16 bytes. The coordinator watches it in the GCS actor table."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


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
            check_text(getattr(self, name), name)
        if self.actor_id and not _is_actor_id(self.actor_id):
            raise ProtocolError(
                f"actor_id {self.actor_id[:40]!r} is not a Ray actor id: 32 hexadecimal "
                "characters (ray.get_runtime_context().get_actor_id()), or empty outside an actor"
            )
        check_count(self.pid, "pid")
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
    # A node agent's poll: the id of this process's order that the agent already holds, to hand
    # it again until the process acknowledges it. The coordinator holds the poll instead of
    # sending the same order back at once (which, at thousands of nodes, kept every agent's poll
    # spinning between its order and the acknowledgement).
    holding: str = ""


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
    # A warm restart's survivor saving its own shard: snapshot it, report it held, train on;
    # the copy to ``keepers`` follows in the background (``LateSave``)
    hold: bool = False

    @property
    def is_backup(self) -> bool:
        return self.backup_for is not None

    @property
    def key(self) -> RankKey:
        return (self.group, self.rank)


@dataclass(frozen=True)
class TeardownOrder:
    """The coordinator's order to a worker process: tear down by ``deadline``.

    Delivered at least once: the coordinator answers every poll with it until the process
    acknowledges ``order_id``; handling it is idempotent on the worker side. ``order_id`` tells
    one order of a process from another (never reused across cycles); processes told exactly
    the same in a cycle share one order and its id.
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
    # False when no process of the cycle saves, backs a save up or rejoins: then nobody needs
    # the training thread at a step boundary, and a rank found inside a collective releases its
    # peers at once rather than give the collective time to finish.
    boundary_needed: bool = True
    # Every rank of the cycle will answer (a warm restart whose survivors may hold; no rank
    # lost or FAULTY): the ranks of each group agree in its store on the step they all stop
    # at before any is released from a collective (``worker/stop_step.py``).
    agree_stop_step: bool = False
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class PollAnswer:
    """The answer to a long poll: an order, nothing yet, or why the poll is refused."""

    kind: PollKind
    order: TeardownOrder | None = None
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
class LateSave:
    """A survivor's held shards reached the keepers after it trained on (or could not).

    ``saved``: the copies' records (tier "memory"), one per held shard of cycle ``cycle``;
    ``failed``: the shard keys that never got there, ``reason`` why. The coordinator commits
    the cycle's step once every held shard's copy landed (``coordinator/held.py``).
    """

    process_id: str
    cycle: int
    saved: tuple[ShardRecord, ...] = ()
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
    """The coordinator's answer to anything without an answer of its own: accepted, or refused
    with the reason (``retry``: refused for now only, the same message is accepted later)."""

    accepted: bool
    reason: str = ""
    cycle: int | None = None
    retry: bool = False

    @classmethod
    def ok(cls, cycle: int | None = None) -> Reply:
        return cls(True, "", cycle)

    @classmethod
    def refused(cls, reason: str, cycle: int | None = None, retry: bool = False) -> Reply:
        return cls(False, reason, cycle, retry=retry)
