"""The cycle machine's vocabulary: the events that go in and the decisions that come out.

The coordinator is a Ray-free machine (``machine.py``) inside a thin Ray actor (``actor.py``).
Everything the world tells the coordinator - a registration, a poll, a notice, a report, a lost
rank, a commit that landed - reaches the machine as one typed event; everything the machine
wants done - answer a caller, wake a poll with its order, start a keeper, commit, publish an
outcome - comes back as a typed decision that the actor carries out. The machine does no I/O,
holds no futures and never waits; the actor owns every future, thread and Ray call. A unit
test feeds events and reads decisions (``tests/test_machine.py``).

The protocol's messages are events themselves (``Register``, ``Ack``, ``SigtermSeen``,
``SaveResult``, ``SaveTurn``, ``Rejoined``): the actor checks each once at its door
(``admitted``), and one that is not well formed reaches the machine as ``Malformed``, with the
reason, so the machine reads only checked messages, by field.

::

    notice ─┐
    report ─┤                  ┌─> Replied / Rejected / HoldPoll
    ack    ─┼─> CycleMachine ──┼─> CycleOpened / Gathered / OrderOut / AllReported
    lost   ─┤    .step(e)      ├─> KeeperNeeded / NodeLeaving / SaveResolved / SpareTold
    commit ─┘                  └─> Commit -> (the actor commits on a thread) -> Concluded

A held step (``held.py``) lives on after its cycle, through events of its own: the survivors'
``LateSave``s, ``HeldDue`` at its deadline, ``HeldCommitted`` and ``HeldDurable`` as its memory
commit and disk copy land; it comes out as ``CommitHeld``, ``MakeDurable``, ``HeldChanged``
and ``HeldLost``. Every event is stepped in with the time it happened (``step(event, now)``):
the machine reads no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..memory.commit import MemoryCheckpoint
from ..notices import EvictionNotice, short
from ..outcome import TerminationOutcome
from ..protocol import (
    Ack,
    JobClosed,
    LateSave,
    PollAnswer,
    PollState,
    ProtocolError,
    Register,
    Rejoined,
    Reply,
    SaveResult,
    SaveTurn,
    SigtermSeen,
    SpareAnswer,
    SpareAssigned,
    TeardownReport,
    check_version,
)
from .conclusion import CommitRequest, CommitResult
from .warm_restarts import WarmRecord

D = TypeVar("D")

# --- events: what happened ------------------------------------------------------------------


@dataclass(frozen=True)
class Polled:
    """A worker process's long poll arrived (with its last step and health)."""

    process_id: str
    cycle: object  # untrusted: checked against the current cycle
    state: PollState


@dataclass(frozen=True)
class NoticesIn:
    """Notices from the CLI or the API, already parsed."""

    notices: tuple[EvictionNotice, ...]


@dataclass(frozen=True)
class Malformed:
    """A message the actor could not even parse: refused with the reason, and kept (bounded)."""

    what: dict[str, Any]
    reason: str


@dataclass(frozen=True)
class DrainsSeen:
    """Ray's drain state, as read: node id -> deadline in ms (untrusted values)."""

    drains: Mapping[str, object]


@dataclass(frozen=True)
class DrainUnreadable:
    """Ray's drain state could not be read (the error, for the record)."""

    error: str


@dataclass(frozen=True)
class RanksLost:
    """Registered ranks' actors found dead without a notice."""

    actor_ids: frozenset[str]


@dataclass(frozen=True)
class HostLost:
    """A host went silent and did not answer the probe (``host_watch.py``): with the evidence."""

    node_id: str
    evidence: str


@dataclass(frozen=True)
class RestartSettled:
    """A restarted coordinator's ranks had ``settle_s`` to register again (``recovery.py``)."""

    settle_s: float


@dataclass(frozen=True)
class GatheringClosed:
    """The gathering window of ``cycle`` closed (or every touched node was covered)."""

    cycle: int


@dataclass(frozen=True)
class ReportIn:
    """A worker process's teardown report."""

    process_id: str
    report: TeardownReport


@dataclass(frozen=True)
class BackupSaves:
    """A backup was told to save: its saver could not (recorded in the outcome)."""

    cycle: int
    shard_key: str
    why: str


@dataclass(frozen=True)
class ReportsClosed:
    """Every ordered process reported, or the last deadline (and its grace) passed."""

    cycle: int


@dataclass(frozen=True)
class CommitDone:
    """The actor carried out a ``Commit``: what landed where."""

    cycle: int
    result: CommitResult


@dataclass(frozen=True)
class CycleFailed:
    """The cycle could not conclude normally (an error on the way): it concludes anyway."""

    cycle: int
    error: str


@dataclass(frozen=True)
class JoinDeadline:
    """The warm restart into ``cycle`` reached its join deadline (``WarmRecord.join_by``): a
    member that has not said what it did by then failed it."""

    cycle: int


@dataclass(frozen=True)
class JobFinished:
    """The driver says the job is over."""

    success: bool
    permanent: bool


@dataclass(frozen=True)
class SpareArrived:
    """A spare or standby registers to wait."""

    spare_id: str
    role: str
    node_id: str
    pid: int


@dataclass(frozen=True)
class SpareWanted:
    """The driver hands a waiting spare the slot of ``group/rank`` for the next cycle."""

    group: str
    rank: int


@dataclass(frozen=True)
class HeldDue:
    """The held step of ``cycle`` reached its ``until``: copies not in by then lose it."""

    cycle: int


@dataclass(frozen=True)
class HeldCommitted:
    """The actor carried out a ``CommitHeld``: what the memory commit landed."""

    cycle: int
    result: CommitResult


@dataclass(frozen=True)
class HeldDurable:
    """The memory tier's disk copy of a held step ended (its record; None: still running)."""

    cycle: int
    durable: dict[str, Any] | None


@dataclass(frozen=True)
class SparePolled:
    """A spare's long poll: its word, if it has one (the poll is held until it does).

    ``held``: asked again once its hold ended - the word if one came, else nothing; a spare
    that left meanwhile (``SpareLeaving``) is not told to register again."""

    spare_id: str
    held: bool = False


@dataclass(frozen=True)
class SpareLeaving:
    """A spare or standby is going away (SIGTERM): never hand it a slot."""

    spare_id: str
    reason: str


Event = (
    Register
    | Polled
    | Ack
    | NoticesIn
    | Malformed
    | SigtermSeen
    | DrainsSeen
    | DrainUnreadable
    | RanksLost
    | HostLost
    | RestartSettled
    | GatheringClosed
    | ReportIn
    | SaveResult
    | SaveTurn
    | BackupSaves
    | ReportsClosed
    | CommitDone
    | CycleFailed
    | Rejoined
    | JoinDeadline
    | JobFinished
    | SpareArrived
    | SpareWanted
    | LateSave
    | HeldDue
    | HeldCommitted
    | HeldDurable
    | SparePolled
    | SpareLeaving
)


def admitted(message: Any, kind: type, what: str, prefix: str = "") -> Any:
    """``message`` if it is a well-formed ``kind`` (its ``check()``, else its protocol
    version), else the ``Malformed`` event that refuses it with the reason."""
    if not isinstance(message, kind):
        why = f"a {what} is a {kind.__name__}, not a {type(message).__name__}"
        return Malformed({what: short(message)}, prefix + why)
    try:
        check = getattr(message, "check", None)
        check() if check is not None else check_version(message)
    except (ProtocolError, AttributeError, TypeError, ValueError) as exc:
        return Malformed({what: short(message)}, prefix + str(exc))
    return message


# --- decisions: what to do ------------------------------------------------------------------


@dataclass(frozen=True)
class Replied:
    """Answer the caller of the event with this."""

    answer: Reply | PollAnswer | SpareAssigned | JobClosed | SpareAnswer


@dataclass(frozen=True)
class Rejected:
    """A message was refused (kept, bounded, in the cycle's ``rejected``): log and count it."""

    summary: str
    reason: str


@dataclass(frozen=True)
class NoticeAccepted:
    """A notice went into the cycle (metrics count them by source)."""

    source: str


@dataclass(frozen=True)
class HoldPoll:
    """Nothing to answer yet: hold the poll open until an order or its timeout."""

    process_id: str


@dataclass(frozen=True)
class CycleOpened:
    """The first notice opened ``cycle``'s gathering: run the cycle."""

    cycle: int


@dataclass(frozen=True)
class Gathered:
    """Every node the notices touched is covered: stop gathering now."""

    cycle: int


@dataclass(frozen=True)
class OrderOut:
    """Wake the process's held poll with its order."""

    process_id: str
    answer: PollAnswer


@dataclass(frozen=True)
class AllReported:
    """Every ordered process of ``cycle`` reported or is lost: conclude without waiting."""

    cycle: int


@dataclass(frozen=True)
class KeeperNeeded:
    """The memory tier needs a keeper on this node."""

    node_id: str


@dataclass(frozen=True)
class NodeLeaving:
    """This node is being evicted: its keeper's shards move before ``deadline``."""

    node_id: str
    deadline: float


@dataclass(frozen=True)
class SaveResolved:
    """The saver's fate for one shard is known: its backup (if one waits) is told."""

    cycle: int
    shard_key: str
    saved: bool
    why: str


@dataclass(frozen=True)
class AwaitSaver:
    """A backup's turn: answer it once the saver's fate is known, or at ``wait_s``."""

    cycle: int
    shard_key: str


@dataclass(frozen=True)
class SpareTold:
    """A spare has its word (exit, or a slot): wake its held poll."""

    spare_id: str


@dataclass(frozen=True)
class Commit:
    """Commit what the cycle saved (disk I/O: the actor runs it on a thread)."""

    request: CommitRequest


@dataclass(frozen=True)
class Concluded:
    """The cycle concluded: publish its outcome; the next cycle is open."""

    outcome: TerminationOutcome
    memory: MemoryCheckpoint | None
    warm: WarmRecord | None


@dataclass(frozen=True)
class WarmFinished:
    """The warm restart into ``cycle`` is over: every member spoke, it failed, or never began."""

    cycle: int


@dataclass(frozen=True)
class HoldSparePoll:
    """A spare has no word yet: hold its poll until ``SpareTold`` or its timeout."""

    spare_id: str


@dataclass(frozen=True)
class HeldChanged:
    """A held step moved on (``held.py``): publish where it is now."""

    cycle: int
    record: dict[str, Any]


@dataclass(frozen=True)
class HeldTimer:
    """Step ``HeldDue(cycle)`` in at ``until``."""

    cycle: int
    until: float


@dataclass(frozen=True)
class CommitHeld:
    """Every copy of a held step landed: commit it in memory (on a thread), then step
    ``HeldCommitted``."""

    request: CommitRequest


@dataclass(frozen=True)
class MakeDurable:
    """A held step is committed in memory: copy it to disk behind the training, then step
    ``HeldDurable``."""

    cycle: int
    memory: MemoryCheckpoint


@dataclass(frozen=True)
class HeldLost:
    """A held step is never committed: drop what its cycle handed to keepers; say so."""

    cycle: int
    step: int
    reason: str


Decision = (
    Replied
    | Rejected
    | NoticeAccepted
    | HoldPoll
    | CycleOpened
    | Gathered
    | OrderOut
    | AllReported
    | KeeperNeeded
    | NodeLeaving
    | SaveResolved
    | AwaitSaver
    | SpareTold
    | Commit
    | Concluded
    | WarmFinished
    | HoldSparePoll
    | HeldChanged
    | HeldTimer
    | CommitHeld
    | MakeDurable
    | HeldLost
)


def of_kind(decisions: list[Any], kind: type[D]) -> list[D]:
    """The decisions of one kind among ``decisions`` (the actor acts on a few itself)."""
    return [d for d in decisions if isinstance(d, kind)]


def reply_of(decisions: list[Any]) -> Any:
    """The answer among ``decisions`` for the caller of the event, if there is one."""
    for decision in decisions:
        if isinstance(decision, Replied):
            return decision.answer
    return None
