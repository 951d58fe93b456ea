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

``ProcessRuntime`` (``process_runtime.py``) steps it under its lock and carries the actions
out; ``tests/test_lifecycle.py`` drives it through event sequences without a thread. Its words -
phases, events, actions - are ``rank_events.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import GracefulConfig
from ..protocol import RendezvousAction
from .rank_events import (
    Action,
    ArmKernelDeadline,
    AskFailed,
    AwaitingRejoin,
    AwaitRejoin,
    Due,
    Event,
    HardExit,
    KeepAnswer,
    Leave,
    Leaving,
    Link,
    LinkChanged,
    LoopStuck,
    NoticeAgain,
    OrderIn,
    PeerLeft,
    PhaseData,
    RankPhase,
    Registered,
    RejoinBegun,
    RejoinEnded,
    Rejoining,
    RendezvousIn,
    ReportSigterm,
    Running,
    Signal,
    Signalled,
    SigtermAnswer,
    SpareAssigned,
    SpareDismissed,
    SpareWaiting,
    StartTeardown,
    StartTimer,
    StopLoop,
    Stopping,
    TeardownEnded,
    TeardownRequested,
    TearingDown,
    Timer,
    Told,
    WatchLoop,
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
            RankPhase.LEAVING: self._in_leaving,
        }.get(self.phase)
        return handler(event) if handler is not None else []

    def _move(self, phase: RankPhase, data: PhaseData = None) -> None:
        if phase is not self.phase:
            self.history.append(self.phase)
        self.phase, self.data = phase, data

    # --- signals, in any phase -----------------------------------------------------------

    def _signal(self, event: Signal) -> list[Action]:
        config = self.config
        if self.phase is RankPhase.IDLE:
            return []  # not ours
        if self.phase is RankPhase.SPARE:
            # nothing to save and no slot: it stops waiting and leaves
            self._move(RankPhase.LEAVING, Leaving("SIGTERM while waiting as a spare", spare=True))
            return [StopLoop()]
        if event.count >= 2:
            return [HardExit(config.exit_code, "second SIGTERM")]
        kernel = ArmKernelDeadline(
            event.at + config.teardown_timeout_s - config.watchdog_margin_s / 2
        )
        if isinstance(self.data, Rejoining):
            # Held, as anywhere in rejoin(). A spare still waiting for its word leaves the pool;
            # one a decided warm restart names joins it, as a signalled survivor does, and the
            # signal is the new group's first notice (``worker/spare_wait.py``).
            if self.data.held is not None:
                return []
            self._move(RankPhase.REJOINING, replace(self.data, held=(event.signum, event.at)))
            return [kernel]
        if self.phase is RankPhase.AWAITING_REJOIN:
            return self._leave("SIGTERM while waiting to rejoin", unanswered=True)
        if isinstance(self.data, TearingDown) and self.data.survivor:
            # A survivor's own process is going now: never dropped - it does not stay
            if self.data.held is None:
                held = replace(self.data, held=(event.signum, event.at))
                self._move(RankPhase.TEARING_DOWN, held)
            return [kernel]
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
        elif isinstance(event, SpareDismissed):
            return self._leave(f"spare/standby exiting: {event.reason}")
        return []

    def _in_leaving(self, event: Event) -> list[Action]:
        """Nothing changes a leaving process, but a signalled spare's wait returning: it goes."""
        data = self.data
        if isinstance(event, SpareDismissed) and isinstance(data, Leaving) and data.spare:
            return self._leave(f"spare/standby exiting: {event.reason}")
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
        if isinstance(event, RejoinBegun) and data.survivor:
            # The driver called rejoin() before the teardown ended: rejoin() waits for it (and
            # leaves without an answer if a SIGTERM came meanwhile).
            self._move(RankPhase.REJOINING, Rejoining(data.held))
            return []
        if not isinstance(event, TeardownEnded):
            return []
        if not data.survivor:
            self._move(RankPhase.LEAVING, Leaving(data.trigger))
            return []
        if data.held is not None:
            why = f"signal {data.held[0]} before its rejoin: its process is going"
            return self._leave(why, unanswered=True)
        assert data.order_cycle is not None  # a survivor's
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
                f"not asked to rejoin within rejoin_timeout_s={self.config.rejoin_timeout_s}",
                unanswered=True,
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
        # Its own SIGTERM came before the order: a survivor's process is going all the same
        held = (self.data.signum, self.data.at) if isinstance(self.data, Signalled) else None
        tearing_down = TearingDown(
            trigger, not order.rejoin, order.cycle, held if order.rejoin else None
        )
        self._move(RankPhase.TEARING_DOWN, tearing_down)
        teardown = StartTeardown(
            trigger,
            order.deadline,
            order,
            skip_reason=order.skip_reason,
            exit_process=not order.rejoin,
            then=AwaitRejoin(order) if order.rejoin else None,
        )
        return [teardown]

    def _alone(self, trigger: str, deadline: float | None) -> list[Action]:
        self._move(RankPhase.TEARING_DOWN, TearingDown(trigger, True))
        return [StartTeardown(trigger, deadline)]

    def _leave(self, reason: str, unanswered: bool = False) -> list[Action]:
        self._move(RankPhase.LEAVING, Leaving(reason))
        return [Leave(reason, unanswered)]

    def _signalled(self, signum: int, at: float, train_fn_saves: bool = False) -> Signalled:
        """Its wait for an order never so long that the release and the exit no longer fit."""
        config = self.config
        latest = (
            at + config.teardown_timeout_s - config.watchdog_margin_s - config.destroy_timeout_s
        )
        return Signalled(signum, at, latest, train_fn_saves)
