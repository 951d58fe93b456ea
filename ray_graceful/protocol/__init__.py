"""Everything that crosses between a worker process and the coordinator, typed to its leaves.

One way: notice -> plan -> order -> acknowledgement -> report -> outcome.

- ``messages``: a rank's process and the coordinator - ``Register``, ``PollState``,
  ``PollAnswer`` with its ``TeardownOrder``, ``Ack``, ``SigtermSeen``, ``SaveResult``, a backup's
  ``SaveTurn`` / ``TurnAnswer``, and the plain ``Reply``;
- ``teardown_report``: the ``TeardownReport`` a process sends when its teardown ended;
- ``spare_messages``: a spare's ``SpareAnswer``; the driver's ``SpareAssigned`` and
  ``JobClosed``;
- ``warm_messages``: a warm restart's ``Rendezvous`` and ``Rejoined``;
- ``words``: the closed sets of words (enums that are also their strings);
- ``checks``: the version and field bounds every message is checked against where it arrives;
- ``wire``: the coordinator's replies to node agents, packed into one pickle each.

A message is built once, checked where it arrives (``check()``) and read by field; each carries
``PROTOCOL_VERSION``, and another version is refused with a reason.
"""

from ..checkpoint.records import ShardId, ShardRecord, shard_key
from ..place import LoadedFrom, Place
from .checks import PROTOCOL_VERSION, ProtocolError, check_count, check_text, check_version
from .messages import (
    DEFAULT_NAME,
    Ack,
    LateSave,
    PollAnswer,
    PollState,
    RankKey,
    RankSpec,
    Register,
    Reply,
    SaveAssignment,
    SaveResult,
    SaveTurn,
    SigtermSeen,
    TeardownOrder,
    TurnAnswer,
    coordinator_name,
)
from .spare_messages import JobClosed, SpareAnswer, SpareAssigned
from .teardown_report import ExitPath, PhaseRecord, ReportedRank, TeardownReport
from .warm_messages import Rejoined, Rendezvous, train_slot_member
from .words import (
    Action,
    JobState,
    PhaseStatus,
    PollKind,
    RejoinResult,
    RendezvousAction,
    Replacement,
    Result,
    SpareAction,
    TeardownPhase,
    WarmResult,
    Word,
)

__all__ = [
    "DEFAULT_NAME",
    "PROTOCOL_VERSION",
    "Ack",
    "Action",
    "ExitPath",
    "JobClosed",
    "JobState",
    "LateSave",
    "LoadedFrom",
    "PhaseRecord",
    "PhaseStatus",
    "Place",
    "PollAnswer",
    "PollKind",
    "PollState",
    "ProtocolError",
    "RankKey",
    "RankSpec",
    "Register",
    "RejoinResult",
    "Rejoined",
    "Rendezvous",
    "RendezvousAction",
    "Replacement",
    "Reply",
    "ReportedRank",
    "Result",
    "SaveAssignment",
    "SaveResult",
    "SaveTurn",
    "ShardId",
    "ShardRecord",
    "SigtermSeen",
    "SpareAction",
    "SpareAnswer",
    "SpareAssigned",
    "TeardownOrder",
    "TeardownPhase",
    "TeardownReport",
    "TurnAnswer",
    "WarmResult",
    "Word",
    "check_count",
    "check_text",
    "check_version",
    "coordinator_name",
    "shard_key",
    "train_slot_member",
]
