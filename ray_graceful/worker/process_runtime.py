"""The one per-process state a rank's machine acts on: registrations, the teardown, the link.

A process may hold several ranks in several groups (verl colocates roles), but it has one
SIGTERM, one teardown and one exit: everything lives in one ``ProcessRuntime`` per process
(``process_runtime()``; a forked child gets a fresh one).

Every event source - the signal listener and its main-thread backstop, the control thread (an
order, the link restarting, back or lost), the timers, the peer watch, ``rejoin()``, the
setup calls - calls ``step(event)``, shaped like the coordinator actor's ``_step``: the rank's
machine (``lifecycle.py``) decides under the lock, and the actions are carried out here,
outside it. A rank leaving with no coordinator reachable tells its peers through the group's
store (``begin_teardown``).

The public setup API that fills it is ``setup.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..bounded import NoAnswer
from ..checkpoint import shard_key
from ..config import GracefulConfig
from ..protocol import RankSpec, Rendezvous, Replacement, TeardownOrder
from .control import ControlChannel, gpu_indices
from .exit_path import hard_exit, leave, write_stderr
from .hard_deadline import hard_deadline
from .late_copy import LateCopies
from .lifecycle import RankMachine
from .peer_release import PeerWatch, announce_leaving
from .process_groups import GroupHandle, SetupError
from .rank_events import (
    Action,
    ArmKernelDeadline,
    AskFailed,
    Due,
    Event,
    HardExit,
    KeepAnswer,
    Leave,
    Link,
    LinkChanged,
    LoopStuck,
    NoticeAgain,
    OrderIn,
    PeerLeft,
    RankPhase,
    RendezvousIn,
    ReportSigterm,
    Signal,
    SigtermAnswer,
    StartTeardown,
    StartTimer,
    StopLoop,
    TeardownEnded,
    Timer,
    Told,
    WatchLoop,
)
from .report_file import write_report_file
from .save_ways import Saver, ShardSave
from .signals import SignalListener, set_claim_check
from .teardown import Teardown
from .timers import Timers
from .training_loop import TrainingLoop

ASK_WAIT_S = 0.5  # a survivor's ask for its rendezvous: short, so a rejoin or a SIGTERM is seen
LOOP_CHECK_S = 0.05  # Ray Train: how often a stopped loop is checked for being stuck


def _on_monotonic_clock(at: float) -> float:
    """A moment the machine names in Unix seconds, on ``time.monotonic()``'s clock."""
    return time.monotonic() + at - time.time()


@dataclass
class Registration:
    """One (group, rank) of this process and how it saves."""

    group: GroupHandle
    shard: str
    saver: Saver | None
    release_only: bool = False  # an extra group registered for abort, not a rank to plan for
    train_fn_saves: bool = False  # the training function saves (Ray Train); see train.py
    state: Callable[[], Any] | None = None  # state_dict=: what the memory tier hands over
    load_state: Callable[[Any], Any] | None = None  # load_state_dict=: a warm restart's restore

    def save_order(
        self,
        root: str,
        shard: str,
        budget_s: float,
        turn: Callable[[float], tuple[bool, str]] | None = None,
        start_by: float = 0.0,
        keepers: tuple[str, ...] = (),
        namespace: str = "",
        hold: bool = False,
    ) -> ShardSave:
        """Save ``shard`` under ``root`` with this rank's saver (which must exist).

        ``turn`` makes it a backup save: done only if the coordinator says so; ``keepers`` a
        memory-tier save (see ShardSave).
        """
        assert self.saver is not None
        return ShardSave(
            root,
            shard,
            budget_s,
            self.saver,
            self.group.name,
            self.group.rank,
            turn,
            start_by,
            keepers,
            self.state,
            namespace,
            hold,
        )


@dataclass
class ProcessRuntime:
    """Per-process state shared by every rank this process holds."""

    config: GracefulConfig | None = None  # given explicitly; one per process
    env_config: GracefulConfig | None = None  # read from RAY_GRACEFUL_* while none was given
    registrations: dict[tuple[str, int], Registration] = field(default_factory=dict)
    stop_event: threading.Event = field(default_factory=threading.Event)
    loop: TrainingLoop = field(default_factory=TrainingLoop)
    teardown: Teardown | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    pid: int = field(default_factory=os.getpid)
    control: ControlChannel | None = None
    node_agent: Any = None  # this node's agent (relay, cloud notices), held while we run
    order: TeardownOrder | None = None  # the coordinator's order, once one arrived
    spare_id: str | None = None  # set while this process waits as a spare or standby
    rendezvous: Rendezvous | None = None  # a survivor's answer, once the coordinator gave it
    peer_watch: PeerWatch | None = None  # while no coordinator is reachable (peer_release.py)
    late: LateCopies = field(default_factory=LateCopies)  # held shards on their way to keepers
    # Who takes this process's slot when it leaves: on Ray Train's warm path
    # (``ray_graceful/train/warm.py``) the worker Train starts there, which the coordinator
    # hands the slot to - or, on a Ray without replica groups, nobody stays at all
    replaced_by: Replacement = Replacement.SPARE
    machine: RankMachine = field(default_factory=lambda: RankMachine(GracefulConfig()))
    timers: Timers = field(default_factory=Timers)

    # --- the rank's machine: every event source steps it -----------------------------------

    def step(self, event: Event) -> None:
        """Decide (``lifecycle.RankMachine``, under the lock), then carry the actions out."""
        with self.lock:
            self.machine.config = self.config_or_default()  # the one given, once it is
            actions = self.machine.step(event)
        for action in actions:
            try:
                self._carry_out(action)
            except Exception as exc:  # one failed action never stops the others
                write_stderr(f"ray_graceful: {type(action).__name__} failed: {exc!r}\n")

    def phase(self) -> RankPhase:
        """Where the machine is, read under the lock: other threads ask (the ask loop, the
        stuck-loop check, ``rejoin()``) while any thread may be stepping it."""
        with self.lock:
            return self.machine.phase

    def claims_signals(self) -> bool:
        """Whether a SIGTERM is ours: a rank registered, a spare waiting, or a rejoin under way."""
        return self.machine.claims_signals()

    def on_sigterm(self, signum: int, count: int) -> bool:
        """Listener-thread callback; whether the signal was this process's."""
        if os.getpid() != self.pid or not self.claims_signals():
            return False
        self.step(Signal(signum, count, time.time(), self._coordinator_answers()))
        return True

    def on_sigterm_main_thread(self, signum: int) -> None:
        """Backstop from the Python-level handler, for a signal the listener did not see."""
        if os.getpid() == self.pid:
            self.step(Signal(signum, 1, time.time(), self._coordinator_answers()))

    def on_link(self, change: Link) -> None:
        """The control channel's word on its link: restarting, back, lost."""
        self.step(LinkChanged(change, time.time()))

    def on_order(self, order: TeardownOrder) -> None:
        """The control thread's: an order came (at least once; the machine takes it once)."""
        self.step(OrderIn(order, time.time()))

    def _coordinator_answers(self) -> bool:
        control = self.control
        return control is not None and (control.connected or control.reconnecting)

    def _carry_out(self, action: Action) -> None:
        config = self.config_or_default()
        match action:
            case ArmKernelDeadline(at):
                hard_deadline().arm(_on_monotonic_clock(at), config.exit_code)
            case ReportSigterm(at):
                self._report_sigterm(at)
            case NoticeAgain(_signum, at, cycle):
                self._notice_again(at, cycle)
            case StartTimer(timer, at):
                self.timers.call_at(at, lambda: self._due(timer))
            case StartTeardown():
                self._start_teardown(action)
            case StopLoop():
                self.stop_event.set()
            case WatchLoop(order, since):
                self.order = order
                self._watch_loop(since)
            case KeepAnswer(answer):
                self.rendezvous = answer
            case Leave(reason, unanswered):
                if unanswered:  # a survivor gone before its answer: its slot must not wait
                    self.left_unanswered(reason)
                # The step the group held must not vanish with this holder: its copy first -
                # taken here if the leave came before the ask to rejoin took it.
                self._hand_over_held()
                self.late.finish(config.save_budget_s)
                if self.replaced_by is Replacement.TRAIN_SLOT:
                    # Ray Train ends this worker: ``carry_on`` raises out of the training
                    # function. An exit of its own while Train replaces another worker's group
                    # failed Train's controller (an ActorDiedError there is not retried).
                    write_stderr(f"ray_graceful: leaving to Ray Train: {reason}\n")
                    return
                leave(config, reason, self.timers.call_at)
            case HardExit(code, why):
                running = self.teardown
                if running is not None:
                    running.report.exit_path = "second-signal"
                    running.report.exit_code = code
                    write_report_file(running.report, config.report_dir)
                hard_exit(code, why)

    def _due(self, timer: Timer) -> None:
        connected = self.control is not None and self.control.connected
        self.step(Due(timer, time.time(), connected))

    def _report_sigterm(self, received_at: float) -> None:
        """Report the SIGTERM on a thread of its own (a call: the listener never waits on it);
        the answer steps the machine."""
        control = self.control

        def report() -> None:
            told = control.report_sigterm(received_at) if control else Told.UNREACHABLE
            refusal = control.sigterm_refusal if control else ""
            self.step(SigtermAnswer(told, time.time(), refusal))

        threading.Thread(target=report, name="ray_graceful-sigterm-report", daemon=True).start()

    def _notice_again(self, received_at: float, cycle: int) -> None:
        """A SIGTERM held while ``rejoin()`` ran: reported once every member of the new group
        joined (a member still registering when the notice's cycle opens is refused, and
        leaves, where the group could have gone on without this one) - for as long as this
        rank's own teardown, with its save, still fits before its deadline."""
        config = self.config_or_default()
        wait_s = min(
            config.rejoin_timeout_s,
            config.teardown_timeout_s
            - config.save_budget_s
            - config.watchdog_margin_s
            - (time.time() - received_at),
        )
        if wait_s > 0 and self.control is not None:
            answer = self.control.wait_rejoined(cycle, wait_s)
            if isinstance(answer, NoAnswer):  # the notice goes out all the same
                write_stderr(
                    f"ray_graceful: the new group's record could not be awaited: {answer}\n"
                )
        self._report_sigterm(received_at)

    def _start_teardown(self, action: StartTeardown) -> None:
        order = action.order
        if order is None:
            self.begin_teardown(action.trigger, action.deadline, exit_process=action.exit_process)
            return
        self.order = order
        if not action.save:
            self.begin_teardown(
                action.trigger,
                order.deadline,
                order.cycle,
                save_orders=[],
                skip_save_reason=action.skip_reason,
            )
            return
        save_orders, skipped = self._save_orders(order)
        skip_reason = "; ".join([order.skip_reason, *skipped]).strip("; ")
        then = self._await_rejoin if action.then else None
        self.begin_teardown(
            trigger=action.trigger,
            deadline=order.deadline,
            cycle=order.cycle,
            save_orders=save_orders,
            skip_save_reason=skip_reason or "the plan has another replica save",
            exit_process=action.exit_process,
            boundary_needed=order.boundary_needed,
            agree_stop_step=order.agree_stop_step,
            then=then,
        )

    def _save_orders(self, order: TeardownOrder) -> tuple[list[ShardSave], list[str]]:
        """The order's saves that this process can make, and why it skips the others."""
        save_orders, skipped = [], []
        for save in order.saves:
            reg = self.registrations.get(save.key)
            if reg is None or reg.saver is None:
                skipped.append(f"{save.shard_key}: this process has no saver for it")
                continue
            turn = self._turn_asker(order.cycle, save.shard_key) if save.is_backup else None
            save_orders.append(
                reg.save_order(
                    save.root,
                    save.shard_key,
                    order.save_budget_s,
                    turn,
                    save.start_by,
                    save.keepers,
                    self.config_or_default().coordinator_namespace,
                    save.hold,
                )
            )
        return save_orders, skipped

    def left_unanswered(self, reason: str) -> None:
        """As a survivor ordered to rejoin, leaving before the coordinator's answer: say so
        (``ControlChannel.left_unanswered``); nothing to say once rejoined or for a spare."""
        order, control = self.order, self.control
        if order is not None and order.rejoin and control is not None and control.connected:
            control.left_unanswered(reason)

    def _hand_over_held(self) -> None:
        """A survivor's held shards, once its teardown ended, to ``late`` (once per cycle):
        from the ask to rejoin, or from a leave that came first - ``rejoin()`` goes on as soon
        as the teardown is done, and may leave before the watchdog's thread asks."""
        teardown, control, order = self.teardown, self.control, self.order
        if teardown is None or control is None or order is None or not teardown.done.is_set():
            return
        wait_s = self.config_or_default().rejoin_timeout_s
        self.late.take(order.cycle, list(teardown.saving.held), control.late_saved, wait_s)

    def _await_rejoin(self) -> None:
        """A survivor whose teardown ended in time (on the teardown watchdog's thread, which has
        nothing left to watch): ask the coordinator for its rendezvous - short long polls, and
        every ``ASK_WAIT_S`` once answered, so that a coordinator lost while the driver has not
        called back yet is seen within that - until it rejoins or leaves."""
        control = self.control
        assert control is not None  # the order came through it
        threading.current_thread().name = "ray_graceful-rejoin-ask"
        # What it holds (``self.order``'s cycle) goes to the keepers once the group trains
        # again (late_copy.py).
        self._hand_over_held()
        self.step(TeardownEnded(time.time()))
        answered_at = None
        while self.phase() is RankPhase.AWAITING_REJOIN:
            if answered_at is not None and time.monotonic() - answered_at < ASK_WAIT_S:
                time.sleep(0.05)
                continue
            answer = control.rendezvous(ASK_WAIT_S)
            if isinstance(answer, NoAnswer):
                self.step(AskFailed(str(answer), time.time()))
                return
            if answer is not None:
                self.step(RendezvousIn(answer, time.time()))
                answered_at = time.monotonic()

    def _watch_loop(self, since: float) -> None:
        """Ray Train: every ``LOOP_CHECK_S``, on the timers' thread, whether the stopped loop
        is stuck before its boundary (it will not reach it to save)."""
        config = self.config_or_default()
        ordered_at = _on_monotonic_clock(since)

        def check() -> None:
            if self.phase() is not RankPhase.STOPPING:
                return
            if self.loop.stuck_since(ordered_at, config.quiesce_timeout_s):
                self.step(LoopStuck(time.time()))
            else:
                self.timers.call_at(time.time() + LOOP_CHECK_S, check)

        self.timers.call_at(time.time() + LOOP_CHECK_S, check)

    def _turn_asker(self, cycle: int, key: str) -> Callable[[float], tuple[bool, str]]:
        """How a backup save asks the coordinator whether it is its turn."""
        control = self.control

        def ask(wait_s: float) -> tuple[bool, str]:
            if control is None or not control.alive:
                return False, "no coordinator to ask: the saver may have saved"
            return control.save_turn(cycle, key, wait_s)

        return ask

    def rank_specs(self) -> tuple[RankSpec, ...]:
        """The ranks this process registers with the coordinator (not the release-only ones)."""
        gpus = tuple(gpu_indices())
        return tuple(
            RankSpec(
                reg.group.name,
                reg.group.rank,
                reg.group.world_size,
                reg.shard,
                reg.saver is not None or reg.train_fn_saves,
                reg.train_fn_saves,
                gpus,
                self.replaced_by,
            )
            for reg in self.registrations.values()
            if not reg.release_only
        )

    # --- peers, while no coordinator is reachable (peer_release.py) ---------------------------

    def watch_peers(self) -> None:
        """Watch the groups' stores for a peer that left alone, while no coordinator answers."""
        with self.lock:
            if self.peer_watch is None:
                self.peer_watch = PeerWatch(
                    lambda: [r.group for r in list(self.registrations.values())],
                    lambda why: self.step(PeerLeft(why, time.time())),
                    self._peers_need_watching,
                )
        self.peer_watch.start()

    def _peers_need_watching(self) -> bool:
        answers = self.control is not None and self.control.connected  # it releases the peers
        return bool(self.registrations) and self.teardown is None and not answers

    # --- teardown --------------------------------------------------------------------------

    def config_or_default(self) -> GracefulConfig:
        """The config given to this process, else one read from the environment (not pinned)."""
        if self.config is not None:
            return self.config
        if self.env_config is None:
            self.env_config = GracefulConfig.from_env()
        return self.env_config

    def begin_teardown(
        self,
        trigger: str,
        deadline: float | None = None,
        cycle: int = 0,
        save_orders: list[ShardSave] | None = None,
        skip_save_reason: str | None = None,
        exit_process: bool = True,
        boundary_needed: bool = True,
        agree_stop_step: bool = False,
        then: Callable[[], None] | None = None,
    ) -> Teardown:
        """Start this process's teardown once; later calls return the one already running.
        ``then`` runs once it ended within its deadline (``Teardown.start``)."""
        with self.lock:
            if self.teardown is not None:
                return self.teardown
            config = self.config_or_default()
            if deadline is None:
                deadline = time.time() + config.teardown_timeout_s
            if save_orders is None and skip_save_reason is None:
                save_orders, skip_save_reason = self._own_save_decision(config, deadline)
            self.teardown = Teardown(
                config,
                [r.group for r in self.registrations.values()],
                trigger=trigger,
                deadline=deadline,
                cycle=cycle,
                save_orders=save_orders,
                skip_save_reason=skip_save_reason or "",
                on_stop=self.stop_event.set,
                on_report=self.control.report if self.control is not None else None,
                on_saved=self.control.save_result if self.control is not None else None,
                late=self.late,
                training=self.loop,
                exit_process=exit_process,
                boundary_needed=boundary_needed,
                train_ends_it=self.replaced_by is Replacement.TRAIN_SLOT,
                # Ray Train's warm path agrees in should_stop's all-reduce already
                agree_in=[r.group for r in self.registrations.values() if not r.release_only]
                if agree_stop_step and not self.loop.peers_reach_boundary
                else None,
            )
            self.teardown.report.last_step = self.loop.last_step
            teardown = self.teardown
        if self.order is None:  # leaving alone: no coordinator tells the peers, so we do
            announce_leaving([r.group for r in self.registrations.values()], trigger)
        teardown.start(then)
        return teardown

    def _own_save_decision(
        self, config: GracefulConfig, deadline: float
    ) -> tuple[list[ShardSave], str]:
        """Without a coordinator's order: save own shards if a directory is configured."""
        if config.checkpoint_dir is None:
            return [], "no coordinator order and no checkpoint_dir configured"
        orders = []
        for reg in self.registrations.values():
            if reg.release_only or reg.saver is None:
                continue
            shard = shard_key(reg.group.name, reg.shard)
            orders.append(reg.save_order(config.checkpoint_dir, shard, config.save_budget_s))
        if not orders:
            return [], "no registered rank of this process has a saver"
        return orders, ""

    # --- registration ----------------------------------------------------------------------

    def adopt_config(self, config: GracefulConfig | None) -> GracefulConfig:
        with self.lock:
            if config is None:
                return self.config_or_default()
            if self.config is not None and config != self.config:
                raise SetupError(
                    "a different GracefulConfig was already given to this process (one process "
                    "has one teardown): pass the same config to every graceful_setup call, or "
                    "none after the first."
                )
            self.config = config
            return config


_runtime = ProcessRuntime()


def process_runtime() -> ProcessRuntime:
    """The runtime of this process (a forked child gets a fresh, empty one)."""
    global _runtime
    if _runtime.pid != os.getpid():
        _runtime = ProcessRuntime()
    return _runtime


def route_signals(listener: SignalListener) -> None:
    """Hand every SIGTERM ``listener`` sees to this process's runtime, the one wiring the setup
    hook, ``graceful_setup`` and ``install_signal_handling`` all take. The runtime claims a
    signal only while this process holds a rank or a spare; otherwise the handler that was in
    place before (Ray's) runs as if the listener were not there."""
    runtime = process_runtime()
    listener.on_signal = runtime.on_sigterm
    listener.on_main_thread_signal = runtime.on_sigterm_main_thread
    set_claim_check(lambda: process_runtime().claims_signals())
