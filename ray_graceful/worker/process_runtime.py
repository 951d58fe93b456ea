"""The one per-process state an order acts on, and how an order becomes a teardown.

A process may hold several ranks in several groups (verl colocates roles), but it has one
SIGTERM, one teardown and one exit: everything lives in one ``ProcessRuntime`` per process
(``process_runtime()``; a forked child gets a fresh one). The coordinator's order becomes a
teardown in ``carry_out``; a SIGTERM in ``on_sigterm``; a rank leaving with no coordinator
reachable in ``begin_teardown`` (its peers are told through the group's store).

The public setup API that fills it is ``setup.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import shard_key
from ..config import GracefulConfig
from ..protocol import RankSpec, Rendezvous, TeardownOrder
from .control import ControlChannel, gpu_indices
from .emergency_save import Saver, ShardSave
from .exit_path import hard_exit
from .hard_deadline import hard_deadline
from .leaving import leave_unless_rejoined
from .order_wait import await_order
from .peer_release import PeerWatch, announce_leaving
from .process_groups import GroupHandle, SetupError
from .report import write_report_file
from .signals import SignalListener, set_claim_check
from .teardown import Teardown
from .training_loop import TrainingLoop


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
    sigterm_seen: bool = False
    order: TeardownOrder | None = None  # the coordinator's order, once one arrived
    spare_id: str | None = None  # set while this process waits as a spare or standby
    rejoining: threading.Event = field(default_factory=threading.Event)  # rejoin() is running
    rejoin_sigterm: tuple[int, float] | None = None  # (signum, time) of one that came meanwhile
    rendezvous: Rendezvous | None = None  # a survivor's answer, once the coordinator gave it
    peer_watch: PeerWatch | None = None  # while no coordinator is reachable (peer_release.py)

    # --- signals ---------------------------------------------------------------------------

    def claims_signals(self) -> bool:
        """Whether a SIGTERM is ours: a rank registered, a spare waiting, or a rejoin under way."""
        return bool(self.registrations) or self.spare_id is not None or self.rejoining.is_set()

    def _waiting_spare(self) -> bool:
        return not self.registrations and self.spare_id is not None

    def on_sigterm(self, signum: int, count: int) -> bool:
        """Listener-thread callback: first SIGTERM starts the teardown, the second escalates."""
        if os.getpid() != self.pid or not self.claims_signals():
            return False
        if self._waiting_spare():  # nothing to save, no slot yet: just leave
            self.stop_event.set()
            return True
        if count >= 2:
            config = self.config_or_default()
            running = self.teardown
            if running is not None:
                running.report.exit_path = "second-signal"
                running.report.exit_code = config.exit_code
                write_report_file(running.report, config.report_dir)
            hard_exit(config.exit_code, "second SIGTERM")
        self.take_sigterm(signum)
        return True

    def on_sigterm_main_thread(self, signum: int) -> None:
        """Backstop from the Python-level handler, for a signal the listener did not see."""
        if os.getpid() != self.pid:
            return
        if self._waiting_spare():
            self.stop_event.set()
        elif self.registrations or self.rejoining.is_set():
            self.take_sigterm(signum)

    def take_sigterm(self, signum: int, received_at: float | None = None) -> None:
        """A first SIGTERM (received at ``received_at``, default now): held while ``rejoin()``
        runs, else reported to the coordinator for its order, or the teardown starts alone."""
        received_at = time.time() if received_at is None else received_at
        config = self.config_or_default()
        # Armed now: whatever the wait for an order runs into, the process is gone by its deadline.
        left_s = config.teardown_timeout_s - config.watchdog_margin_s / 2
        at = time.monotonic() + left_s - (time.time() - received_at)
        with self.lock:
            if self.rejoining.is_set():  # rejoin() acts on it: it leaves, or it is a notice of
                if self.rejoin_sigterm is None:  # the group it joined (rejoin.py)
                    self.rejoin_sigterm = (signum, received_at)
                    hard_deadline().arm(at, config.exit_code)
                return
            if self.sigterm_seen:
                return
            self.sigterm_seen = True
        control = self.control
        answers = control is not None and (control.connected or control.reconnecting)
        if control is None or not answers or self.teardown is not None:
            self.begin_teardown(trigger=f"signal {signum} (no coordinator reachable)")
            return
        hard_deadline().arm(at, config.exit_code)
        threading.Thread(
            target=self._await_order,
            args=(signum, control, received_at),
            name="ray_graceful-await-order",
            daemon=True,
        ).start()

    # --- a warm restart's rejoin (rejoin.py) -------------------------------------------------

    def begin_rejoin(self) -> None:
        """``rejoin()`` has begun: a survivor's watcher neither leaves nor keeps answers from
        now on, and a SIGTERM is held for ``rejoin()`` (``rejoin_sigterm``) - including one
        that came just before, which the watcher may not have acted on yet."""
        with self.lock:
            self.rejoining.set()
            if self.sigterm_seen and self.rejoin_sigterm is None:
                self.rejoin_sigterm = (signal.SIGTERM, time.time())

    def end_rejoin(self) -> tuple[int, float] | None:
        """``rejoin()`` is over: signals take the normal way again; the SIGTERM it held, if any
        (``take_sigterm`` it once joined). A fresh event: the last cycle's watcher holds the old
        one, which stays set - cleared, the watcher could miss the rejoin and leave."""
        with self.lock:
            self.rejoining = threading.Event()
            held, self.rejoin_sigterm = self.rejoin_sigterm, None
            return held

    def signalled_during_rejoin(self) -> bool:
        return self.rejoin_sigterm is not None

    def _await_order(self, signum: int, control: ControlChannel, received_at: float) -> None:
        """Report the SIGTERM, then wait for the coordinator's order (``order_wait.py``); else
        go alone, the deadline still counted from the signal."""
        config = self.config_or_default()
        why = await_order(control, config, received_at, lambda: self.order is not None)
        # An order for ranks whose training function saves (Ray Train) starts no
        # teardown here: having the order is what counts.
        if why is not None and self.teardown is None and self.order is None:
            deadline = received_at + config.teardown_timeout_s
            self.begin_teardown(trigger=f"signal {signum} ({why})", deadline=deadline)

    def carry_out(self, order: TeardownOrder) -> None:
        """The one place an order becomes a teardown. Idempotent: a second delivery is a no-op."""
        with self.lock:
            if self.order is not None:
                return
            self.order = order
        if any(reg.train_fn_saves for reg in self.registrations.values()):
            self._stop_at_loop_boundary(order)
            return
        save_orders, skipped = [], []
        for save in order.saves:
            reg = self.registrations.get(save.key)
            if reg is None or reg.saver is None:
                skipped.append(f"{save.shard_key}: this process has no saver for it")
                continue
            turn = None
            if save.is_backup:
                turn = self._turn_asker(order.cycle, save.shard_key)
            save_orders.append(
                reg.save_order(
                    save.root,
                    save.shard_key,
                    order.save_budget_s,
                    turn,
                    save.start_by,
                    save.keepers,
                    self.config_or_default().coordinator_namespace,
                )
            )
        skip_reason = "; ".join([order.skip_reason, *skipped]).strip("; ")
        teardown = self.begin_teardown(
            trigger=f"coordinator order ({order.trigger})",
            deadline=order.deadline,
            cycle=order.cycle,
            save_orders=save_orders,
            skip_save_reason=skip_reason or "the plan has another replica save",
            exit_process=not order.rejoin,
            boundary_needed=order.boundary_needed,
        )
        if order.rejoin and not teardown.exit_process:
            control = self.control
            assert control is not None  # an order came through it

            rejoining = self.rejoining  # this cycle's: a rejoin sets it, and it stays set

            def keep(answer: Rendezvous) -> None:
                if answer.action == "join" and answer.cycle <= order.cycle:
                    return  # an answer for a cycle this process already was in: stale
                with self.lock:  # never after rejoin() began (it sets the event under the lock)
                    if not rejoining.is_set():
                        self.rendezvous = answer

            leave_unless_rejoined(
                self.config_or_default(),
                teardown,
                rejoining,
                lambda: self.sigterm_seen,
                control.rendezvous,
                keep,
            )

    def _turn_asker(self, cycle: int, key: str) -> Callable[[float], tuple[bool, str]]:
        """How a backup save asks the coordinator whether it is its turn."""
        control = self.control

        def ask(wait_s: float) -> tuple[bool, str]:
            if control is None or not control.alive:
                return False, "no coordinator to ask: the saver may have saved"
            return control.save_turn(cycle, key, wait_s)

        return ask

    def _stop_at_loop_boundary(self, order: TeardownOrder) -> None:
        """An order for ranks whose training function saves (Ray Train): stop, then guard.

        ``should_stop()`` turns true and the training function saves at its step boundary
        (``ray_graceful.train.emergency_checkpoint``). A guard starts the normal teardown (no
        save) as soon as the loop is found stuck (``TrainingLoop.stuck_since``), else shortly
        before the deadline whatever it does, so the rank still leaves in time.
        """
        config = self.config_or_default()
        ordered_at = time.monotonic()
        self.stop_event.set()
        guard_at = order.deadline - config.watchdog_margin_s - config.destroy_timeout_s - 1.0

        def guard() -> None:
            # Leave as soon as the loop is found stuck (it will not reach its boundary to
            # save); else shortly before the deadline, whatever it does.
            while time.time() < guard_at and self.teardown is None:
                if self.loop.stuck_since(ordered_at, config.quiesce_timeout_s):
                    self.begin_teardown(
                        trigger=f"coordinator order ({order.trigger}); the training loop is "
                        "stuck: it did not reach should_stop() in time",
                        deadline=order.deadline,
                        cycle=order.cycle,
                        save_orders=[],
                        skip_save_reason="the training loop is stuck before its step boundary",
                    )
                    return
                time.sleep(0.05)
            self.begin_teardown(
                trigger=f"coordinator order ({order.trigger}); guard before the deadline",
                deadline=order.deadline,
                cycle=order.cycle,
                save_orders=[],
                skip_save_reason="saving is the training function's (Ray Train)",
            )

        threading.Thread(target=guard, name="ray_graceful-loop-boundary-guard", daemon=True).start()

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
                    lambda why: self.begin_teardown(trigger=f"released by a peer: {why}"),
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
    ) -> Teardown:
        """Start this process's teardown once; later calls return the one already running."""
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
                training=self.loop,
                exit_process=exit_process,
                boundary_needed=boundary_needed,
            )
            self.teardown.report.last_step = self.loop.last_step
            teardown = self.teardown
        if self.order is None:  # leaving alone: no coordinator tells the peers, so we do
            announce_leaving([r.group for r in self.registrations.values()], trigger)
        teardown.start()
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
