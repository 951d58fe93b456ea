"""A SIGTERM during a warm restart's rejoin, on the rank's side: never lost, never Ray's.

From ``rejoin()``'s first step to its last, a SIGTERM is claimed (Ray's handler would record a
crash) and held by the rank's machine: before the group forms it leaves, once joined the signal
is the new group's first notice, its deadline counted from the signal. Here through the
process side (``ProcessRuntime.step`` and what it carries out), the kernel timer replaced by a
recorder; the rules alone are ``test_lifecycle.py``'s.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from ray_graceful import GracefulConfig
from ray_graceful.worker import process_runtime as runtime_module
from ray_graceful.worker.process_runtime import ProcessRuntime
from ray_graceful.worker.rank_events import (
    RankPhase,
    Registered,
    RejoinBegun,
    RejoinEnded,
    Signal,
    SpareWaiting,
    Told,
)

pytestmark = pytest.mark.unit


class KernelTimer:
    """Stands in for this process's kernel timer (``hard_deadline``): it records."""

    def __init__(self) -> None:
        self.armed: list[float] = []

    def arm(self, at_monotonic: float, code: int) -> bool:
        self.armed.append(at_monotonic)
        return True


@pytest.fixture
def kernel(monkeypatch) -> KernelTimer:
    timer = KernelTimer()
    monkeypatch.setattr(runtime_module, "hard_deadline", lambda: timer)
    return timer


@pytest.fixture
def left(monkeypatch) -> list[str]:
    """Why the process would have left (``exit_path.leave`` ends this one: recorded instead)."""
    reasons: list[str] = []
    monkeypatch.setattr(runtime_module, "leave", lambda _config, why, _at: reasons.append(why))
    return reasons


@pytest.fixture
def runtime(kernel, left):
    return ProcessRuntime(config=GracefulConfig(teardown_timeout_s=30.0))


class JoinedControl:
    """The new group's control channel: the group joined, the report taken."""

    connected = True
    reconnecting = False
    alive = True
    sigterm_refusal = ""

    def __init__(self) -> None:
        self.waited: list[int] = []
        self.reported: list[float] = []
        self.reported_once = threading.Event()

    def wait_rejoined(self, cycle: int, wait_s: float) -> None:
        self.waited.append(cycle)

    def report_sigterm(self, received_at: float) -> Told:
        self.reported.append(received_at)
        self.reported_once.set()
        return Told.ACCEPTED


def test_a_spare_handed_a_slot_claims_a_sigterm_until_its_rejoin_ends(runtime, kernel, left):
    """Between its assignment and its registration a spare holds no rank and waits as no
    spare: the signal is still claimed, and held for ``rejoin()``."""
    assert not runtime.claims_signals()
    runtime.step(RejoinBegun(time.time()))
    assert runtime.claims_signals()
    assert runtime.on_sigterm(signal.SIGTERM, 1) is True
    assert runtime.machine.held_signal() is not None
    assert len(kernel.armed) == 1, "armed from the signal: gone by its deadline whatever happens"
    assert not runtime.stop_event.is_set() and runtime.teardown is None
    runtime.step(RejoinEnded(False, time.time(), reason="no rendezvous"))
    assert runtime.machine.phase is RankPhase.LEAVING
    assert left == ["no rendezvous"], "a rejoin that did not join leaves"


def test_a_spare_still_waiting_for_a_slot_holds_a_sigterm_for_its_wait_to_see(runtime):
    """Claimed and held, not a stop of the training loop it does not run yet: its wait asks to
    leave the pool (``spare_wait``), or joins the warm restart that named it already."""
    runtime.step(RejoinBegun(time.time()))
    runtime.step(SpareWaiting())
    assert runtime.on_sigterm(signal.SIGTERM, 1) is True
    assert runtime.machine.held_signal() is not None
    assert not runtime.stop_event.is_set(), "a joined spare would stop at its first step"


def test_the_held_sigterm_is_the_new_groups_notice_with_its_deadline_from_the_signal(runtime):
    runtime.step(RejoinBegun(time.time()))
    runtime.step(Registered())  # the spare's rank, in the new group
    received = time.time() - 2.0  # the listener saw it two seconds ago
    runtime.step(Signal(signal.SIGTERM, 1, received))
    runtime.on_sigterm_main_thread(signal.SIGTERM)  # the backstop: the same signal, held once
    assert runtime.machine.held_signal() == (signal.SIGTERM, received)
    control = JoinedControl()
    runtime.control = control  # type: ignore[assignment]
    runtime.step(RejoinEnded(True, time.time(), cycle=3))
    assert control.reported_once.wait(5), "the held SIGTERM was not reported to the coordinator"
    assert control.waited == [3], "reported once every member of the new group joined"
    assert control.reported == [received], "its deadline counts from the signal"
    assert runtime.machine.phase is RankPhase.SIGNALLED


class LeftControl(JoinedControl):
    """A survivor's control channel: records the word that it left before it joined."""

    def __init__(self) -> None:
        super().__init__()
        self.left: list[str] = []

    def left_unanswered(self, reason: str) -> None:
        self.left.append(reason)


def test_a_survivor_that_leaves_before_its_answer_says_so_and_a_spare_does_not(runtime, left):
    """A survivor SIGTERMed before its answer came leaves - and tells the coordinator first,
    which hands its slot out (under Ray Train, to the worker Train starts there next) or ends
    the warm restart: the others would wait for it in the rendezvous. One told to leave by the
    coordinator, and a spare (no slot of its own), have nothing to tell it."""
    from types import SimpleNamespace

    from ray_graceful.worker.rank_events import Leave

    control = LeftControl()
    runtime.control = control  # type: ignore[assignment]
    runtime.order = SimpleNamespace(rejoin=True, cycle=0)  # type: ignore[assignment]
    why = "SIGTERM while waiting to rejoin"
    runtime._carry_out(Leave(why, unanswered=True))
    runtime._carry_out(Leave("no spare free"))  # the coordinator's own word
    assert control.left == [why] and left == [why, "no spare free"]

    spare = ProcessRuntime(config=GracefulConfig(teardown_timeout_s=30.0))
    spare.control = spare_control = LeftControl()  # type: ignore[assignment]
    spare._carry_out(Leave("SIGTERM while waiting as a spare", unanswered=True))
    assert spare_control.left == []
