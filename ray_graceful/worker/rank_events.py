"""The rank machine's vocabulary: its phases and their data, the events in, the actions out.

``RankMachine`` (``lifecycle.py``) decides; these are the words it decides in, as
``coordinator/events.py`` is for the coordinator's machine. Every event says when it happened
(the machine reads no clock); every action is carried out by ``ProcessRuntime``
(``process_runtime.py``), outside the machine's lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import Rendezvous, TeardownOrder
from ..protocol.words import Word


class RankPhase(Word):
    """Where a process's ranks are in their life."""

    IDLE = "idle"  # nothing registered: a SIGTERM is not ours
    SPARE = "spare"  # waiting as a spare: no rank, nothing to save
    RUNNING = "running"  # ranks registered and training
    SIGNALLED = "signalled"  # SIGTERM reported; waiting for the coordinator's order
    STOPPING = "stopping"  # Ray Train: should_stop() is true, the training function saves
    TEARING_DOWN = "tearing_down"
    AWAITING_REJOIN = "awaiting_rejoin"  # a survivor's teardown ended without an exit
    REJOINING = "rejoining"  # rejoin() runs
    LEAVING = "leaving"


class Told(Word):
    """What the coordinator said to a SIGTERM report (``ControlChannel.report_sigterm``)."""

    ACCEPTED = "accepted"
    REFUSED = "refused"  # no order to come
    RESTARTING = "restarting"  # Ray restarts it; the report goes to the new process
    UNANSWERED = "unanswered"  # a process just killed answers nothing for a second or so
    UNREACHABLE = "unreachable"  # gone for good


class Link(Word):
    """What became of the control channel's link to the coordinator (``control.py``)."""

    RESTARTING = "restarting"  # Ray restarts the coordinator; the channel registers again
    BACK = "back"  # registered again with the restarted coordinator
    LOST = "lost"  # gone for good


class Timer(Word):
    """The waits the machine asks for; each comes back as ``Due``."""

    ORDER_WAIT = "order_wait"  # a SIGTERMed rank's wait for its order
    RESTART_WAIT = "restart_wait"  # the same, while the coordinator restarts
    GUARD = "guard"  # Ray Train: leave shortly before the deadline, whatever the loop does
    REJOIN = "rejoin"  # a survivor not called back within rejoin_timeout_s leaves


# --- the data of each phase ---------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    train_fn_saves: bool = False  # the training function saves (Ray Train): see train.py


@dataclass(frozen=True)
class Signalled:
    signum: int
    at: float  # when the SIGTERM was received (Unix seconds)
    latest: float  # the latest moment its teardown may still start with a release and exit
    train_fn_saves: bool = False
    told: Told | None = None  # the coordinator's answer to the report
    restarted: bool = False  # the coordinator restarted since the signal
    waits_until: float = 0.0  # the order is waited for until then (the timers say when)


@dataclass(frozen=True)
class Stopping:
    order: TeardownOrder
    ordered_at: float


@dataclass(frozen=True)
class TearingDown:
    trigger: str
    exit_process: bool
    order_cycle: int | None = None  # the order's cycle; None: it went alone
    # A survivor's teardown that a SIGTERM came into: (signum, at). Its process is going too,
    # so it does not stay: held into its rejoin (which then leaves without an answer), or it
    # leaves when the teardown ends
    held: tuple[int, float] | None = None

    @property
    def survivor(self) -> bool:
        """Ordered to rejoin: the teardown ends without an exit."""
        return not self.exit_process and self.order_cycle is not None


@dataclass(frozen=True)
class AwaitingRejoin:
    order_cycle: int
    until: float
    answer: Rendezvous | None = None


@dataclass(frozen=True)
class Rejoining:
    held: tuple[int, float] | None = None  # a SIGTERM that came meanwhile: (signum, at)
    waiting_as_spare: bool = False  # a spare's rejoin, not handed a slot yet


@dataclass(frozen=True)
class Leaving:
    reason: str
    spare: bool = False  # a signalled spare: it leaves once its wait returned (SpareDismissed)


PhaseData = (
    None | Running | Signalled | Stopping | TearingDown | AwaitingRejoin | Rejoining | Leaving
)


# --- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    """A rank of this process registered (``graceful_setup``)."""

    train_fn_saves: bool = False


@dataclass(frozen=True)
class SpareWaiting:
    """This process waits as a spare (``wait_as_spare``)."""


@dataclass(frozen=True)
class SpareDismissed:
    """A waiting spare or standby is told to go (the job is over): it leaves, status 0."""

    reason: str


@dataclass(frozen=True)
class SpareAssigned:
    """The spare was handed a slot: it waits no more, and has no rank until it registers."""


@dataclass(frozen=True)
class Signal:
    """A SIGTERM, the ``count``-th this process received, at ``at``."""

    signum: int
    count: int
    at: float
    coordinator_answers: bool = True  # connected, or reconnecting to a restarted one


@dataclass(frozen=True)
class SigtermAnswer:
    told: Told
    at: float
    reason: str = ""  # a refusal's


@dataclass(frozen=True)
class LinkChanged:
    change: Link
    at: float


@dataclass(frozen=True)
class TeardownRequested:
    """``teardown_now()``: as if signalled, without a coordinator's order."""

    trigger: str
    at: float
    exit_process: bool = True


@dataclass(frozen=True)
class OrderIn:
    order: TeardownOrder
    at: float


@dataclass(frozen=True)
class PeerLeft:
    """A peer wrote that it left alone, while no coordinator answers (``peer_release.py``)."""

    why: str
    at: float


@dataclass(frozen=True)
class LoopStuck:
    """The training loop did not reach ``should_stop()`` in time (``TrainingLoop``)."""

    at: float


@dataclass(frozen=True)
class Due:
    timer: Timer
    at: float
    connected: bool = True  # whether the coordinator answered when it came due


@dataclass(frozen=True)
class TeardownEnded:
    at: float


@dataclass(frozen=True)
class RendezvousIn:
    answer: Rendezvous
    at: float


@dataclass(frozen=True)
class AskFailed:
    why: str
    at: float


@dataclass(frozen=True)
class RejoinBegun:
    at: float


@dataclass(frozen=True)
class RejoinEnded:
    joined: bool
    at: float
    cycle: int = 0  # the cycle it joined
    reason: str = ""


Event = (
    Registered
    | SpareWaiting
    | SpareDismissed
    | SpareAssigned
    | Signal
    | SigtermAnswer
    | LinkChanged
    | OrderIn
    | PeerLeft
    | LoopStuck
    | Due
    | TeardownEnded
    | RendezvousIn
    | AskFailed
    | RejoinBegun
    | RejoinEnded
    | TeardownRequested
)


# --- actions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmKernelDeadline:
    """Whatever happens next, the process is gone by then (``hard_deadline.py``)."""

    at: float  # Unix seconds


@dataclass(frozen=True)
class ReportSigterm:
    at: float  # when it was received


@dataclass(frozen=True)
class StartTimer:
    timer: Timer
    at: float


@dataclass(frozen=True)
class AwaitRejoin:
    """What a survivor does once its teardown ended within its deadline (``StartTeardown.then``):
    tell ``TeardownEnded``, then ask the coordinator for the rendezvous (``RendezvousIn`` /
    ``AskFailed``)."""

    order: TeardownOrder


@dataclass(frozen=True)
class StartTeardown:
    """Begin the teardown: with the order's saves, or alone (its own shards, peers told)."""

    trigger: str
    deadline: float | None  # None: teardown_timeout_s from now
    order: TeardownOrder | None = None
    save: bool = True  # False: no shard saved (a stuck loop; Ray Train saves its own)
    skip_reason: str = ""
    exit_process: bool = True  # False: a survivor (``order.rejoin``), or ``teardown_now``'s
    then: AwaitRejoin | None = None  # a survivor's next step, once the teardown ended in time

    @property
    def alone(self) -> bool:
        """No coordinator's order: it saves its own shards and tells its peers it leaves."""
        return self.order is None


@dataclass(frozen=True)
class StopLoop:
    """``should_stop()`` turns true (and a waiting spare stops waiting)."""


@dataclass(frozen=True)
class WatchLoop:
    """Ray Train: ``order`` stopped the loop at ``since``; tell ``LoopStuck`` if it never
    reaches its boundary (``TrainingLoop.stuck_since``)."""

    order: TeardownOrder
    since: float


@dataclass(frozen=True)
class KeepAnswer:
    answer: Rendezvous


@dataclass(frozen=True)
class Leave:
    """Leave as a torn-down rank does: Ray's intended exit, a hard exit if that never ends it.

    ``unanswered``: a survivor leaving of its own accord before the coordinator's answer (a
    SIGTERM, no call to rejoin in time) - it says so first (``left_unanswered``), so that no
    warm restart keeps it as a member."""

    reason: str
    unanswered: bool = False


@dataclass(frozen=True)
class HardExit:
    code: int
    why: str


@dataclass(frozen=True)
class NoticeAgain:
    """Report a SIGTERM held while the rank rejoined, once the new group has joined: it is
    that group's first notice (then ``SigtermAnswer`` as for any report)."""

    signum: int
    at: float
    cycle: int


Action = (
    ArmKernelDeadline
    | ReportSigterm
    | StartTimer
    | StartTeardown
    | StopLoop
    | WatchLoop
    | KeepAnswer
    | Leave
    | HardExit
    | NoticeAgain
)
