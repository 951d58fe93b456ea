"""A rank's life as one typed machine: events in, actions out, no threads, no Ray, no torch.

The coordinator decides a cycle in ``CycleMachine.step``; this is the same shape for the other
end: one process's ranks, from registration to their ending. ``RankMachine.step(event)`` is the
one place that decides how a rank's life goes on - a teardown, a leave, a hard exit, a rejoin,
a spare's exit - and returns the actions that carry it out. It reads no clock (every event says
when it happened), starts nothing and calls no one.

The phases, and what moves a process between them:

    IDLE ──Registered──> RUNNING ──Signal──> SIGNALLED ──OrderIn──> TEARING_DOWN ──┐
      │                    │ └────OrderIn (Ray Train)──> STOPPING ─LoopStuck/Due──┘ │
      └─SpareWaiting─> SPARE        └──PeerLeft / no coordinator─> TEARING_DOWN     │
                         │                                                          │
                 Signal: LEAVING      TeardownEnded: LEAVING, or (a survivor) ──────┘
                                          AWAITING_REJOIN ──RejoinBegun──> REJOINING
                                            │ leave / Due / Signal: LEAVING   │ joined: RUNNING

Each phase carries its own frozen data (``Signalled``, ``Stopping``, ...), so a rank that
rejoins starts from fresh data by construction. A second SIGTERM ends the process at once
from any phase that claims signals.

The safety net does not depend on this machine: the teardown's watchdog, the kernel timer
(``hard_deadline.py``) and the teardown's own deadline run whatever the machine decides.

Today ``ProcessRuntime`` still decides (``process_runtime.py``); this machine is checked
against it (``tests/test_lifecycle.py``), the first step of moving the worker's rules into one
file (docs/concepts.md, "The rank's machine").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import GracefulConfig
from ..protocol import Rendezvous, RendezvousAction, TeardownOrder
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
class StartTeardown:
    """Begin the teardown: with the order's saves, or alone (its own shards, peers told)."""

    trigger: str
    deadline: float | None  # None: teardown_timeout_s from now
    order: TeardownOrder | None = None
    save: bool = True  # False: no shard saved (a stuck loop; Ray Train saves its own)
    skip_reason: str = ""
    exit_process: bool = True  # False: a survivor (``order.rejoin``), or ``teardown_now``'s

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
class AwaitRejoin:
    """A survivor's teardown runs without an exit: tell ``TeardownEnded`` when it is done,
    then ask the coordinator for the rendezvous (``RendezvousIn`` / ``AskFailed``)."""

    order: TeardownOrder


@dataclass(frozen=True)
class KeepAnswer:
    answer: Rendezvous


@dataclass(frozen=True)
class Leave:
    """Leave as a torn-down rank does: Ray's intended exit, a hard exit if that never ends it."""

    reason: str


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
    | AwaitRejoin
    | KeepAnswer
    | Leave
    | HardExit
    | NoticeAgain
)


# --- the machine ----------------------------------------------------------------------------


@dataclass
class RankMachine:
    """One process's ranks: ``step`` decides; the caller carries the actions out, in order."""

    config: GracefulConfig
    phase: RankPhase = RankPhase.IDLE
    data: PhaseData = None
    history: list[RankPhase] = field(default_factory=list)

    def claims_signals(self) -> bool:
        """Whether a SIGTERM is this process's to handle (else the handler before ours runs)."""
        return self.phase is not RankPhase.IDLE

    def held_signal(self) -> tuple[int, float] | None:
        """The SIGTERM held while ``rejoin()`` runs: (signum, received at), or None."""
        return self.data.held if isinstance(self.data, Rejoining) else None

    def step(self, event: Event) -> list[Action]:
        """The one place a rank's life is decided: the actions for ``event`` in this phase."""
        if isinstance(event, Signal):
            return self._signal(event)
        handler = {
            RankPhase.IDLE: self._in_idle,
            RankPhase.SPARE: self._in_spare,
            RankPhase.RUNNING: self._in_running,
            RankPhase.SIGNALLED: self._in_signalled,
            RankPhase.STOPPING: self._in_stopping,
            RankPhase.TEARING_DOWN: self._in_tearing_down,
            RankPhase.AWAITING_REJOIN: self._in_awaiting_rejoin,
            RankPhase.REJOINING: self._in_rejoining,
        }.get(self.phase)
        return handler(event) if handler is not None else []  # LEAVING: nothing changes it

    def _move(self, phase: RankPhase, data: PhaseData = None) -> None:
        if phase is not self.phase:
            self.history.append(self.phase)
        self.phase, self.data = phase, data

    # --- signals, in any phase -----------------------------------------------------------

    def _signal(self, event: Signal) -> list[Action]:
        config = self.config
        if self.phase is RankPhase.IDLE:
            return []  # not ours
        if self.phase is RankPhase.SPARE or (
            isinstance(self.data, Rejoining) and self.data.waiting_as_spare
        ):
            # nothing to save and no slot yet: it stops waiting and leaves
            if self.phase is RankPhase.SPARE:
                self._move(RankPhase.LEAVING, Leaving("SIGTERM while waiting as a spare"))
            return [StopLoop()]
        if event.count >= 2:
            return [HardExit(config.exit_code, "second SIGTERM")]
        kernel = ArmKernelDeadline(
            event.at + config.teardown_timeout_s - config.watchdog_margin_s / 2
        )
        if isinstance(self.data, Rejoining):
            if self.data.held is not None:
                return []
            self._move(RankPhase.REJOINING, Rejoining((event.signum, event.at)))
            return [kernel]
        if self.phase is RankPhase.AWAITING_REJOIN:
            return self._leave("SIGTERM while waiting to rejoin")
        if self.phase is not RankPhase.RUNNING:
            return []  # already signalled, stopping, tearing down or leaving
        train_fn_saves = isinstance(self.data, Running) and self.data.train_fn_saves
        if not event.coordinator_answers:
            return self._alone(f"signal {event.signum} (no coordinator reachable)", None)
        self._move(RankPhase.SIGNALLED, self._signalled(event.signum, event.at, train_fn_saves))
        return [kernel, ReportSigterm(event.at)]

    # --- per phase -----------------------------------------------------------------------

    def _in_idle(self, event: Event) -> list[Action]:
        if isinstance(event, Registered):
            self._move(RankPhase.RUNNING, Running(event.train_fn_saves))
        elif isinstance(event, SpareWaiting):
            self._move(RankPhase.SPARE)
        elif isinstance(event, RejoinBegun):  # a spare's rejoin: it waits for a slot in it
            self._move(RankPhase.REJOINING, Rejoining())
        return []

    def _in_spare(self, event: Event) -> list[Action]:
        if isinstance(event, Registered):  # handed a slot: its rank registered
            self._move(RankPhase.RUNNING, Running(event.train_fn_saves))
        elif isinstance(event, SpareAssigned):  # no rank yet: a signal is not ours
            self._move(RankPhase.IDLE)
        return []

    def _in_running(self, event: Event) -> list[Action]:
        if isinstance(event, Registered):
            running = self.data if isinstance(self.data, Running) else Running()
            self._move(RankPhase.RUNNING, Running(running.train_fn_saves or event.train_fn_saves))
            return []
        return self._ended_from_outside(event)

    def _ended_from_outside(self, event: Event) -> list[Action]:
        """What ends a running or signalled rank whatever else it waits for: an order, a peer
        that left alone, ``teardown_now()``."""
        if isinstance(event, OrderIn):
            return self._ordered(event)
        if isinstance(event, PeerLeft):
            return self._alone(f"released by a peer: {event.why}", None)
        if isinstance(event, TeardownRequested):
            self._move(RankPhase.TEARING_DOWN, TearingDown(event.trigger, event.exit_process))
            return [StartTeardown(event.trigger, None, exit_process=event.exit_process)]
        return []

    def _in_signalled(self, event: Event) -> list[Action]:
        """Waiting for the order: ``order_wait_s`` once the report was taken; while the
        coordinator restarts (1-2 s, often longer), as long as going alone afterwards still
        leaves the rank its own save; never once the link is lost or the report refused."""
        data = self.data
        assert isinstance(data, Signalled)
        config = self.config
        if isinstance(event, SigtermAnswer):
            if data.told is not None:
                return []  # a report made again to a restarted coordinator: the wait goes on
            data = replace(data, told=event.told, restarted=event.told is Told.RESTARTING)
            if event.told is Told.ACCEPTED:
                until = min(event.at + config.order_wait_s, data.latest)
                return self._wait(data, Timer.ORDER_WAIT, until)
            if event.told in (Told.RESTARTING, Told.UNANSWERED):
                return self._wait(data, Timer.RESTART_WAIT, data.latest - config.save_budget_s)
            if event.told is Told.REFUSED:
                return self._alone_signalled(
                    f"the coordinator refused the SIGTERM report: {event.reason}"
                )
            return self._alone_signalled("coordinator unreachable")
        if isinstance(event, LinkChanged):
            if event.change is Link.LOST:
                return self._alone_signalled(self._why_no_order(data, connected=False))
            if event.change is Link.RESTARTING:
                data = replace(data, restarted=True)
                return self._wait(data, Timer.RESTART_WAIT, data.latest - config.save_budget_s)
            return [ReportSigterm(data.at)]  # BACK: the report died with the old coordinator
        if isinstance(event, Due) and event.timer in (Timer.ORDER_WAIT, Timer.RESTART_WAIT):
            if event.at < data.waits_until:
                return []  # a longer wait is still running
            return self._alone_signalled(self._why_no_order(data, event.connected))
        return self._ended_from_outside(event)

    def _wait(self, data: Signalled, timer: Timer, until: float) -> list[Action]:
        """Wait for the order until ``until`` at least (a wait already longer stands)."""
        if until <= data.waits_until:
            self._move(RankPhase.SIGNALLED, data)
            return []
        self._move(RankPhase.SIGNALLED, replace(data, waits_until=until))
        return [StartTimer(timer, until)]

    def _why_no_order(self, data: Signalled, connected: bool) -> str:
        if data.restarted:
            back = "no order from it" if connected else "it was not back"
            return f"the coordinator restarted; {back} while this rank's own save still fit"
        if data.told is Told.UNANSWERED:
            return "the coordinator did not answer while this rank's own save still fit"
        if not connected:
            return "coordinator unreachable"
        return f"no order from the coordinator within {self.config.order_wait_s}s"

    def _alone_signalled(self, why: str) -> list[Action]:
        """Going alone after a SIGTERM: the deadline still counts from the signal."""
        data = self.data
        assert isinstance(data, Signalled)
        return self._alone(
            f"signal {data.signum} ({why})", data.at + self.config.teardown_timeout_s
        )

    def _in_stopping(self, event: Event) -> list[Action]:
        data = self.data
        assert isinstance(data, Stopping)
        order = data.order
        if isinstance(event, LoopStuck):
            trigger = (
                f"coordinator order ({order.trigger}); the training loop is stuck: it did not "
                "reach should_stop() in time"
            )
            skip = "the training loop is stuck before its step boundary"
        elif isinstance(event, Due) and event.timer is Timer.GUARD:
            trigger = f"coordinator order ({order.trigger}); guard before the deadline"
            skip = "saving is the training function's (Ray Train)"
        else:
            return []
        self._move(RankPhase.TEARING_DOWN, TearingDown(trigger, True, order.cycle))
        return [StartTeardown(trigger, order.deadline, order, save=False, skip_reason=skip)]

    def _in_tearing_down(self, event: Event) -> list[Action]:
        data = self.data
        assert isinstance(data, TearingDown)
        survivor = not data.exit_process and data.order_cycle is not None
        if isinstance(event, RejoinBegun) and survivor:
            # The driver called rejoin() before the teardown ended: rejoin() waits for it.
            self._move(RankPhase.REJOINING, Rejoining())
            return []
        if not isinstance(event, TeardownEnded):
            return []
        if data.exit_process or data.order_cycle is None:
            self._move(RankPhase.LEAVING, Leaving(data.trigger))
            return []
        until = event.at + self.config.rejoin_timeout_s
        self._move(RankPhase.AWAITING_REJOIN, AwaitingRejoin(data.order_cycle, until))
        return [StartTimer(Timer.REJOIN, until)]

    def _in_awaiting_rejoin(self, event: Event) -> list[Action]:
        data = self.data
        assert isinstance(data, AwaitingRejoin)
        if isinstance(event, RejoinBegun):
            self._move(RankPhase.REJOINING, Rejoining())
            return []
        if isinstance(event, RendezvousIn):
            answer = event.answer
            if answer.action == RendezvousAction.LEAVE:
                return self._leave(answer.reason)
            if answer.cycle <= data.order_cycle:
                return []  # an answer for a cycle this process already was in: stale
            self._move(RankPhase.AWAITING_REJOIN, replace(data, answer=answer))
            return [KeepAnswer(answer)]
        if isinstance(event, AskFailed):
            return self._leave(f"the coordinator could not be asked ({event.why})")
        if isinstance(event, Due) and event.timer is Timer.REJOIN:
            return self._leave(
                f"not asked to rejoin within rejoin_timeout_s={self.config.rejoin_timeout_s}"
            )
        return []

    def _in_rejoining(self, event: Event) -> list[Action]:
        data = self.data
        assert isinstance(data, Rejoining)
        if isinstance(event, SpareWaiting):
            self._move(RankPhase.REJOINING, replace(data, waiting_as_spare=True))
            return []
        if isinstance(event, (SpareAssigned, Registered)):  # a slot; its rank in the new group
            self._move(RankPhase.REJOINING, replace(data, waiting_as_spare=False))
            return []
        if isinstance(event, OrderIn):  # the new group's cycle ended before rejoin() returned
            return self._ordered(event)
        if not isinstance(event, RejoinEnded):
            return []
        if not event.joined:  # told to leave, no slot, or it could not join (and said so)
            return self._leave(event.reason)
        if data.held is None:
            self._move(RankPhase.RUNNING, Running())
            return []
        # Signalled while it joined: the new group's first notice evicts it, as any rank -
        # reported once the other members joined too.
        signum, at = data.held
        self._move(RankPhase.SIGNALLED, self._signalled(signum, at))
        return [NoticeAgain(signum, at, event.cycle)]

    # --- shared ----------------------------------------------------------------------------

    def _ordered(self, event: OrderIn) -> list[Action]:
        """The one place an order becomes a teardown (or, for Ray Train, a stop)."""
        order = event.order
        train_fn_saves = isinstance(self.data, (Running, Signalled)) and self.data.train_fn_saves
        if train_fn_saves:
            guard_at = (
                order.deadline - self.config.watchdog_margin_s - self.config.destroy_timeout_s - 1.0
            )
            self._move(RankPhase.STOPPING, Stopping(order, event.at))
            return [StopLoop(), WatchLoop(order, event.at), StartTimer(Timer.GUARD, guard_at)]
        trigger = f"coordinator order ({order.trigger})"
        self._move(RankPhase.TEARING_DOWN, TearingDown(trigger, not order.rejoin, order.cycle))
        teardown = StartTeardown(
            trigger,
            order.deadline,
            order,
            skip_reason=order.skip_reason,
            exit_process=not order.rejoin,
        )
        return [teardown, AwaitRejoin(order)] if order.rejoin else [teardown]

    def _alone(self, trigger: str, deadline: float | None) -> list[Action]:
        self._move(RankPhase.TEARING_DOWN, TearingDown(trigger, True))
        return [StartTeardown(trigger, deadline)]

    def _leave(self, reason: str) -> list[Action]:
        self._move(RankPhase.LEAVING, Leaving(reason))
        return [Leave(reason)]

    def _signalled(self, signum: int, at: float, train_fn_saves: bool = False) -> Signalled:
        """Its wait for an order never so long that the release and the exit no longer fit."""
        config = self.config
        latest = (
            at + config.teardown_timeout_s - config.watchdog_margin_s - config.destroy_timeout_s
        )
        return Signalled(signum, at, latest, train_fn_saves)
