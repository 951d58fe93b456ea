"""The rank's machine on its own: event sequences in, actions out - no thread, no Ray, no torch.

It plays for a rank what ``test_machine.py`` plays for the coordinator: each rule of a rank's
life read off the actions - a SIGTERM, an order, a coordinator lost or refusing, a second
signal, Ray Train's guard, a survivor's rejoin and its timeout, a spare.
"""

from __future__ import annotations

import pytest

from ray_graceful import GracefulConfig
from ray_graceful.protocol import Rendezvous, RendezvousAction, TeardownOrder
from ray_graceful.worker.lifecycle import RankMachine
from ray_graceful.worker.rank_events import (
    ArmKernelDeadline,
    AskFailed,
    AwaitRejoin,
    Due,
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
    Registered,
    RejoinBegun,
    RejoinEnded,
    RendezvousIn,
    ReportSigterm,
    Signal,
    SigtermAnswer,
    SpareAssigned,
    SpareDismissed,
    SpareWaiting,
    StartTeardown,
    StartTimer,
    StopLoop,
    TeardownEnded,
    TeardownRequested,
    Timer,
    Told,
    WatchLoop,
)

pytestmark = pytest.mark.unit

T0 = 1_000.0  # every event says when it happened: the machine reads no clock


@pytest.fixture
def config() -> GracefulConfig:
    return GracefulConfig(
        teardown_timeout_s=25.0,
        watchdog_margin_s=1.0,
        destroy_timeout_s=2.0,
        order_wait_s=2.0,
        save_budget_s=15.0,
        rejoin_timeout_s=30.0,
        exit_code=3,
    )


def running(config, train_fn_saves: bool = False) -> RankMachine:
    machine = RankMachine(config)
    assert machine.step(Registered(train_fn_saves)) == []
    assert machine.phase is RankPhase.RUNNING
    return machine


def order(cycle: int = 0, rejoin: bool = False, deadline: float = T0 + 25) -> TeardownOrder:
    return TeardownOrder("job", cycle, f"o{cycle}", deadline, "SIGTERM to rank 1", rejoin=rejoin)


def signalled(config, at: float = T0) -> RankMachine:
    machine = running(config)
    machine.step(Signal(15, 1, at))
    return machine


def kinds(actions) -> list[type]:
    return [type(a) for a in actions]


# --- a SIGTERM and its order ------------------------------------------------------------------


def test_a_signal_before_any_rank_registered_is_not_ours(config):
    machine = RankMachine(config)
    assert not machine.claims_signals()
    assert machine.step(Signal(15, 1, T0)) == []
    assert machine.phase is RankPhase.IDLE


def test_a_first_sigterm_arms_the_kernel_deadline_and_is_reported(config):
    machine = running(config)
    actions = machine.step(Signal(15, 1, T0))
    # the kernel timer: teardown_timeout_s from the signal, less half the watchdog margin
    assert actions == [ArmKernelDeadline(T0 + 25 - 0.5), ReportSigterm(T0)]
    assert machine.phase is RankPhase.SIGNALLED


def test_an_accepted_report_waits_order_wait_s_for_the_order(config):
    machine = signalled(config)
    assert machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 0.01)) == [
        StartTimer(Timer.ORDER_WAIT, T0 + 0.01 + 2.0)
    ]
    actions = machine.step(OrderIn(order(), T0 + 0.3))
    assert actions == [
        StartTeardown("coordinator order (SIGTERM to rank 1)", T0 + 25, order(), skip_reason="")
    ]
    assert not actions[0].alone
    assert machine.phase is RankPhase.TEARING_DOWN
    # the timer that was running comes due after the order: nothing more happens
    assert machine.step(Due(Timer.ORDER_WAIT, T0 + 2.01)) == []


def test_no_order_within_order_wait_s_and_the_rank_goes_alone_from_its_signal(config):
    machine = signalled(config)
    machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 0.01))
    actions = machine.step(Due(Timer.ORDER_WAIT, T0 + 2.01))
    assert kinds(actions) == [StartTeardown]
    assert actions[0].alone and actions[0].save, "alone: it saves its own shards"
    assert actions[0].deadline == T0 + 25, "the deadline still counts from the signal"
    assert "no order from the coordinator within 2.0s" in actions[0].trigger


def test_the_order_wait_never_eats_the_release_and_the_exit(config):
    machine = signalled(config)
    late = T0 + 21.5  # 25 - 1 (watchdog margin) - 2 (destroy) = 22: only 0.5 s left to wait
    assert machine.step(SigtermAnswer(Told.ACCEPTED, late)) == [
        StartTimer(Timer.ORDER_WAIT, T0 + 22.0)
    ]


def test_a_refused_report_goes_alone_at_once_with_the_coordinators_words(config):
    machine = signalled(config)
    actions = machine.step(SigtermAnswer(Told.REFUSED, T0 + 0.01, "cycle 3 is over"))
    assert kinds(actions) == [StartTeardown]
    assert "refused the SIGTERM report: cycle 3 is over" in actions[0].trigger


def test_a_restarting_coordinator_is_waited_for_while_the_ranks_own_save_still_fits(config):
    machine = signalled(config)
    # 22 (the latest start) - 15 (its own save) = T0 + 7
    assert machine.step(SigtermAnswer(Told.RESTARTING, T0 + 0.01)) == [
        StartTimer(Timer.RESTART_WAIT, T0 + 7.0)
    ]
    assert machine.step(OrderIn(order(), T0 + 2.0))[0].order == order(), "the new one ordered"


def test_a_coordinator_not_back_in_time_sends_the_rank_alone(config):
    machine = signalled(config)
    machine.step(SigtermAnswer(Told.RESTARTING, T0 + 0.01))
    actions = machine.step(Due(Timer.RESTART_WAIT, T0 + 7.0, connected=False))
    assert actions[0].alone
    assert "restarted; it was not back while this rank's own save still fit" in actions[0].trigger
    machine = signalled(config)
    machine.step(SigtermAnswer(Told.UNANSWERED, T0 + 0.01))
    actions = machine.step(Due(Timer.RESTART_WAIT, T0 + 7.0))
    assert "did not answer while this rank's own save still fit" in actions[0].trigger


def test_a_restart_during_the_order_wait_extends_it_and_the_report_is_made_again(config):
    machine = signalled(config)
    machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 0.01))
    assert machine.step(LinkChanged(Link.RESTARTING, T0 + 0.5)) == [
        StartTimer(Timer.RESTART_WAIT, T0 + 7.0)
    ]
    assert machine.step(Due(Timer.ORDER_WAIT, T0 + 2.01)) == [], "the longer wait stands"
    assert machine.step(LinkChanged(Link.BACK, T0 + 1.5)) == [ReportSigterm(T0)]
    assert machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 1.6)) == [], "the wait goes on"
    assert machine.step(OrderIn(order(), T0 + 1.8))[0].order == order(), "the new one ordered"


def test_the_restarted_coordinator_giving_no_order_in_time_sends_the_rank_alone(config):
    machine = signalled(config)
    machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 0.01))
    machine.step(LinkChanged(Link.RESTARTING, T0 + 0.5))
    actions = machine.step(Due(Timer.RESTART_WAIT, T0 + 7.0, connected=True))
    assert "restarted; no order from it while" in actions[0].trigger


def test_a_coordinator_lost_while_the_rank_waits_sends_it_alone(config):
    machine = signalled(config)
    machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 0.01))
    actions = machine.step(LinkChanged(Link.LOST, T0 + 0.5))
    assert actions[0].alone and "coordinator unreachable" in actions[0].trigger


def test_a_sigterm_with_no_coordinator_reachable_starts_the_teardown_alone(config):
    machine = running(config)
    actions = machine.step(Signal(15, 1, T0, coordinator_answers=False))
    assert kinds(actions) == [StartTeardown]
    assert actions[0].alone and actions[0].deadline is None
    assert actions[0].trigger == "signal 15 (no coordinator reachable)"


def test_an_order_without_a_signal_tears_down_and_a_second_delivery_does_nothing(config):
    machine = running(config)
    first = machine.step(OrderIn(order(), T0))
    assert kinds(first) == [StartTeardown]
    assert machine.step(OrderIn(order(), T0 + 0.1)) == [], "delivered at least once: idempotent"


def test_a_second_sigterm_ends_the_process_at_once_from_any_phase_that_claims_signals(config):
    for setup in (signalled, lambda c: _tearing_down(c), lambda c: _awaiting_rejoin(c)[0]):
        machine = setup(config)
        assert machine.step(Signal(15, 2, T0 + 1)) == [HardExit(3, "second SIGTERM")]


def test_a_first_sigterm_while_tearing_down_changes_nothing(config):
    machine = _tearing_down(config)
    assert machine.step(Signal(15, 1, T0 + 1)) == []
    assert machine.phase is RankPhase.TEARING_DOWN


def test_a_peer_that_left_alone_releases_the_rank_with_it(config):
    machine = running(config)
    actions = machine.step(PeerLeft("rank 3 left: signal 15", T0))
    assert actions[0].alone and actions[0].trigger == "released by a peer: rank 3 left: signal 15"


def test_a_torn_down_rank_leaves(config):
    machine = _tearing_down(config)
    assert machine.step(TeardownEnded(T0 + 3)) == []
    assert machine.phase is RankPhase.LEAVING
    assert machine.step(OrderIn(order(1), T0 + 4)) == [], "nothing brings a leaving rank back"


# --- Ray Train: the training function saves ------------------------------------------------


def test_ray_train_an_order_stops_the_loop_and_arms_the_guard(config):
    machine = running(config, train_fn_saves=True)
    actions = machine.step(OrderIn(order(deadline=T0 + 25), T0))
    # the guard: before the deadline, less the watchdog margin, the destroy and 1 s
    assert actions == [
        StopLoop(),
        WatchLoop(order(deadline=T0 + 25), T0),
        StartTimer(Timer.GUARD, T0 + 25 - 1 - 2 - 1),
    ]
    assert machine.phase is RankPhase.STOPPING


def test_ray_train_a_stuck_loop_tears_down_without_a_save(config):
    machine = running(config, train_fn_saves=True)
    machine.step(OrderIn(order(), T0))
    actions = machine.step(LoopStuck(T0 + 5))
    assert kinds(actions) == [StartTeardown]
    assert not actions[0].save and "the training loop is stuck" in actions[0].trigger
    assert machine.step(Due(Timer.GUARD, T0 + 21)) == [], "one teardown"


def test_ray_train_the_guard_tears_down_before_the_deadline_whatever_the_loop_does(config):
    machine = running(config, train_fn_saves=True)
    machine.step(OrderIn(order(), T0))
    actions = machine.step(Due(Timer.GUARD, T0 + 21))
    assert not actions[0].save and actions[0].skip_reason.endswith("(Ray Train)")
    assert actions[0].deadline == T0 + 25


def test_ray_train_a_signalled_rank_is_stopped_too(config):
    machine = running(config, train_fn_saves=True)
    machine.step(Signal(15, 1, T0))
    assert kinds(machine.step(OrderIn(order(), T0 + 0.2))) == [StopLoop, WatchLoop, StartTimer]


# --- a survivor's rejoin ----------------------------------------------------------------------


def _tearing_down(config, rejoin: bool = False) -> RankMachine:
    machine = running(config)
    machine.step(OrderIn(order(rejoin=rejoin), T0))
    return machine


def _awaiting_rejoin(config) -> tuple[RankMachine, list]:
    machine = _tearing_down(config, rejoin=True)
    return machine, machine.step(TeardownEnded(T0 + 1))


def join(cycle: int = 1) -> Rendezvous:
    return Rendezvous(RendezvousAction.JOIN, cycle=cycle, group="g", rank=0, world_size=2)


def test_a_survivors_order_tears_down_without_an_exit_and_asks_for_its_rendezvous(config):
    machine = running(config)
    actions = machine.step(OrderIn(order(rejoin=True), T0))
    assert kinds(actions) == [StartTeardown]
    assert not actions[0].exit_process
    assert actions[0].then == AwaitRejoin(order(rejoin=True))


def test_an_order_while_rejoining_ends_the_rank_the_new_group_gave_up(config):
    machine, _ = _awaiting_rejoin(config)
    machine.step(RejoinBegun(T0 + 2))
    actions = machine.step(OrderIn(order(cycle=1), T0 + 3))
    assert kinds(actions) == [StartTeardown] and actions[0].exit_process
    assert machine.step(RejoinEnded(True, T0 + 4, cycle=1)) == [], "its teardown runs on"


def test_a_rejoin_called_while_the_survivors_teardown_runs_waits_for_it(config):
    machine = _tearing_down(config, rejoin=True)
    assert machine.step(RejoinBegun(T0 + 0.5)) == []
    assert machine.phase is RankPhase.REJOINING
    assert machine.step(TeardownEnded(T0 + 1)) == [], "no rejoin timer: the rejoin began"
    assert machine.phase is RankPhase.REJOINING
    leaving = _tearing_down(config)  # a rank that exits: rejoin() is not for it
    leaving.step(RejoinBegun(T0 + 0.5))
    assert leaving.phase is RankPhase.TEARING_DOWN


def test_a_survivors_teardown_ends_without_an_exit_and_waits_to_rejoin(config):
    machine, actions = _awaiting_rejoin(config)
    assert machine.phase is RankPhase.AWAITING_REJOIN
    assert actions == [StartTimer(Timer.REJOIN, T0 + 1 + 30)]


def test_a_survivor_not_called_back_in_time_leaves(config):
    machine, _ = _awaiting_rejoin(config)
    assert machine.step(Due(Timer.REJOIN, T0 + 31)) == [
        Leave("not asked to rejoin within rejoin_timeout_s=30.0", unanswered=True)
    ]
    assert machine.phase is RankPhase.LEAVING


def test_a_survivor_keeps_its_answer_but_never_a_stale_one(config):
    machine, _ = _awaiting_rejoin(config)
    assert machine.step(RendezvousIn(join(cycle=0), T0 + 2)) == [], "the cycle it is leaving"
    assert machine.step(RendezvousIn(join(), T0 + 2)) == [KeepAnswer(join())]
    assert machine.phase is RankPhase.AWAITING_REJOIN


def test_a_survivor_told_to_leave_or_losing_its_coordinator_leaves(config):
    """The coordinator's own word (or none to be had): nothing to tell it back."""
    machine, _ = _awaiting_rejoin(config)
    leave = Rendezvous(RendezvousAction.LEAVE, "no spare free", 1)
    assert machine.step(RendezvousIn(leave, T0 + 2)) == [Leave("no spare free")]
    machine, _ = _awaiting_rejoin(config)
    assert machine.step(AskFailed("ActorDiedError", T0 + 2)) == [
        Leave("the coordinator could not be asked (ActorDiedError)")
    ]


def test_a_sigterm_while_waiting_to_rejoin_leaves(config):
    machine, _ = _awaiting_rejoin(config)
    assert machine.step(Signal(15, 1, T0 + 2)) == [
        Leave("SIGTERM while waiting to rejoin", unanswered=True)
    ], "gone before its answer: it says so, and the coordinator hands its slot out"


def test_a_sigterm_during_the_rejoin_is_held_and_is_the_new_groups_first_notice(config):
    machine, _ = _awaiting_rejoin(config)
    machine.step(RejoinBegun(T0 + 2))
    assert machine.step(Signal(15, 1, T0 + 3)) == [ArmKernelDeadline(T0 + 3 + 24.5)]
    assert machine.step(Signal(15, 1, T0 + 3.1)) == [], "one held"
    assert machine.step(Due(Timer.REJOIN, T0 + 31)) == [], "the rejoin began: no timeout"
    assert machine.step(RejoinEnded(True, T0 + 4, cycle=1)) == [NoticeAgain(15, T0 + 3, 1)]
    assert machine.phase is RankPhase.SIGNALLED
    # from here it is any signalled rank: the deadline counts from the held signal
    actions = machine.step(SigtermAnswer(Told.ACCEPTED, T0 + 4.1))
    assert actions == [StartTimer(Timer.ORDER_WAIT, T0 + 4.1 + 2.0)]


def test_a_sigterm_during_a_survivors_teardown_is_never_dropped_the_survivor_leaves(config):
    machine = _tearing_down(config, rejoin=True)
    assert machine.step(Signal(15, 1, T0 + 0.5)) == [ArmKernelDeadline(T0 + 0.5 + 24.5)]
    assert machine.phase is RankPhase.TEARING_DOWN, "the teardown runs on"
    assert machine.step(TeardownEnded(T0 + 1)) == [
        Leave("signal 15 before its rejoin: its process is going", unanswered=True)
    ]
    # rejoin() called before the teardown ended: it begins holding the signal (and leaves
    # without an answer, ``rejoin._ask``)
    machine = _tearing_down(config, rejoin=True)
    machine.step(Signal(15, 1, T0 + 0.5))
    machine.step(RejoinBegun(T0 + 0.6))
    assert machine.phase is RankPhase.REJOINING and machine.data.held == (15, T0 + 0.5)
    assert machine.held_signal()


def test_a_rank_signalled_before_its_order_said_rejoin_does_not_stay(config):
    """Its SIGTERM reached the coordinator after the plan: the order still says rejoin (the
    coordinator hands its slot out instead, ``WarmRestarts.after_cycle``)."""
    machine = signalled(config)
    actions = machine.step(OrderIn(order(rejoin=True), T0 + 0.1))
    assert kinds(actions) == [StartTeardown]
    assert isinstance(actions[0].then, AwaitRejoin)
    assert machine.step(TeardownEnded(T0 + 1)) == [
        Leave("signal 15 before its rejoin: its process is going", unanswered=True)
    ]


def test_a_rejoin_that_fails_leaves_and_one_that_joins_trains_on(config):
    machine, _ = _awaiting_rejoin(config)
    machine.step(RejoinBegun(T0 + 2))
    assert machine.step(RejoinEnded(False, T0 + 3, reason="load failed")) == [Leave("load failed")]
    assert machine.phase is RankPhase.LEAVING
    machine, _ = _awaiting_rejoin(config)
    machine.step(RejoinBegun(T0 + 2))
    assert machine.step(RejoinEnded(True, T0 + 3)) == []
    assert machine.phase is RankPhase.RUNNING
    assert kinds(machine.step(Signal(15, 1, T0 + 9))) == [ArmKernelDeadline, ReportSigterm]


# --- a spare ----------------------------------------------------------------------------------


def test_a_spare_signalled_while_it_waits_just_stops_waiting(config):
    machine = RankMachine(config)
    machine.step(SpareWaiting())
    assert machine.claims_signals()
    assert machine.step(Signal(15, 1, T0)) == [StopLoop()]
    assert machine.phase is RankPhase.LEAVING
    # its wait returns (it told the coordinator it goes): then it leaves, once
    said = "SIGTERM: this spare is being evicted"
    assert machine.step(SpareDismissed(said)) == [Leave(f"spare/standby exiting: {said}")]
    assert machine.step(SpareDismissed(said)) == []


def test_a_spare_told_the_job_is_over_leaves_through_the_machine(config):
    machine = RankMachine(config)
    machine.step(SpareWaiting())
    assert machine.step(SpareDismissed("job succeeded")) == [
        Leave("spare/standby exiting: job succeeded")
    ]
    assert machine.phase is RankPhase.LEAVING
    assert machine.step(SpareDismissed("again")) == [], "once"


def test_a_spare_inside_its_rejoin_holds_a_signal_and_joins_only_if_handed_a_slot(config):
    """Signalled while it waits for a slot, a spare inside ``rejoin()`` holds the signal, as a
    survivor does: not handed a slot, its wait returns and it leaves; handed one (the decided
    warm restart names it), it joins, and the signal is the new group's first notice."""
    machine = RankMachine(config)
    machine.step(RejoinBegun(T0))  # rejoin() on a spare: it waits for a slot inside
    machine.step(SpareWaiting())
    assert machine.step(Signal(15, 1, T0 + 1)) == [ArmKernelDeadline(T0 + 1 + 24.5)], "held"
    assert machine.held_signal() == (15, T0 + 1), "its wait sees it, and asks to leave the pool"
    left = machine.step(RejoinEnded(False, T0 + 2, reason="SIGTERM: this spare is being evicted"))
    assert left == [Leave("SIGTERM: this spare is being evicted")], "not named: it leaves"

    machine = RankMachine(config)
    machine.step(RejoinBegun(T0))
    machine.step(SpareWaiting())
    machine.step(Signal(15, 1, T0 + 1))
    machine.step(SpareAssigned())  # named: it joins, the signal still held
    assert machine.step(Signal(15, 1, T0 + 1.5)) == [], "one signal held, the first"
    assert machine.step(RejoinEnded(True, T0 + 3, cycle=1)) == [NoticeAgain(15, T0 + 1, 1)]
    assert machine.step(Signal(15, 2, T0 + 4)) == [HardExit(config.exit_code, "second SIGTERM")]


def test_teardown_now_tears_down_alone_once(config):
    machine = running(config)
    actions = machine.step(TeardownRequested("requested", T0, exit_process=False))
    assert actions == [StartTeardown("requested", None, exit_process=False)]
    assert machine.step(TeardownRequested("again", T0 + 1)) == []


def test_a_spare_handed_a_slot_is_a_rank_like_any_other(config):
    machine = RankMachine(config)
    machine.step(SpareWaiting())
    machine.step(Registered())
    assert machine.phase is RankPhase.RUNNING
    assert kinds(machine.step(Signal(15, 1, T0))) == [ArmKernelDeadline, ReportSigterm]


def test_every_phase_is_reached_and_leaving_is_the_end(config):
    seen = set()
    for build in (
        lambda: RankMachine(config),
        lambda: running(config),
        lambda: signalled(config),
        lambda: _tearing_down(config),
        lambda: _awaiting_rejoin(config)[0],
    ):
        machine = build()
        seen |= {machine.phase, *machine.history}
    spare = RankMachine(config)
    spare.step(SpareWaiting())
    stopping = running(config, train_fn_saves=True)
    stopping.step(OrderIn(order(), T0))
    rejoining, _ = _awaiting_rejoin(config)
    rejoining.step(RejoinBegun(T0 + 2))
    leaving = _tearing_down(config)
    leaving.step(TeardownEnded(T0 + 1))
    seen |= {m.phase for m in (spare, stopping, rejoining, leaving)}
    assert seen == set(RankPhase)
