"""Where the training thread is, as the teardown sees it: the loop is found by its code.

The loop is whatever function called ``should_stop(step)`` - wherever it is defined, even in a
module of this package's name (the demo's and the benchmarks' loops are). Inside it the thread
is "in_step"; out of it, "idle"; held in ``should_stop`` by a teardown, "parked".
"""

from __future__ import annotations

import types

import pytest

import ray_graceful
from ray_graceful.worker.process_runtime import process_runtime
from ray_graceful.worker.rank_events import Told
from tests.helpers import wait_for

LOOP_SOURCE = """
import ray_graceful
from ray_graceful.worker.process_runtime import process_runtime

def train(steps, seen):
    for step in range(steps):
        ray_graceful.should_stop(step + 1)
        seen.append(process_runtime().loop.state())
    return step + 1
"""


class SilentControl:
    """A control channel whose coordinator takes the SIGTERM report and never orders."""

    alive = True
    connected = True
    reconnecting = False
    sigterm_refusal = ""
    told = Told.ACCEPTED

    def report_sigterm(self, received_at: float) -> Told:
        return self.told


class KernelTimer:
    """Stands in for this process's kernel timer (``hard_deadline``): it records."""

    def arm(self, at_monotonic: float, code: int) -> bool:
        return True


def signalled_runtime(monkeypatch, config, control, signalled_at):
    """A registered rank's runtime, SIGTERMed at ``signalled_at`` with ``control`` as its link;
    what its teardown was started with (``started``, set once with ``begun``)."""
    import threading
    import time

    from ray_graceful.worker import process_runtime as runtime_module
    from ray_graceful.worker.process_runtime import ProcessRuntime
    from ray_graceful.worker.rank_events import Registered, Signal

    monkeypatch.setattr(runtime_module, "hard_deadline", KernelTimer)
    runtime = ProcessRuntime(config=config)
    runtime.control = control
    started: dict = {}
    begun = threading.Event()

    def begin_teardown(trigger, deadline=None, *args, **kw):
        started.update(at=time.time(), trigger=trigger, deadline=deadline)
        begun.set()

    runtime.begin_teardown = begin_teardown  # type: ignore[method-assign]
    runtime.step(Registered())
    runtime.step(Signal(15, 1, signalled_at, coordinator_answers=True))
    return runtime, started, begun


@pytest.mark.parametrize("module_name", ["user_code.trainer", "ray_graceful.demo_like"])
def test_training_loop_is_busy_inside_and_quiescent_after(module_name):
    module = types.ModuleType(module_name)
    exec(compile(LOOP_SOURCE, f"<{module_name}>", "exec"), module.__dict__)
    seen: list[bool] = []
    assert module.train(3, seen) == 3
    assert seen == ["in_step"] * 3, "inside its loop the thread is inside its step"
    assert process_runtime().loop.state() == "idle", "once the loop returned, a save may start"
    assert process_runtime().loop.step() == 3


def test_wrappers_are_not_taken_for_the_loop():
    runtime = process_runtime()

    def loop() -> None:
        ray_graceful.GracefulWorkerMixin().should_stop(7)  # the mixin's method wraps it

    loop()
    assert runtime.loop.step_site is not None
    assert runtime.loop.step_site[1] is loop.__code__


GARBAGE_WITH_A_LOCAL = """
import gc, threading
from ray_graceful.worker.training_loop import TrainingLoop
from ray_graceful.worker.threads import busy_threads

gc.set_threshold(1)  # a collection at nearly every allocation, as a busy process has some


class Node:
    pass


def garbage():
    a, b = Node(), Node()
    a.b, b.a = b, a
    a.local = threading.local()  # freed by the collector: it takes the thread-list lock
    a.local.x = 1


loop_state = TrainingLoop()
loop_state.step_site = (threading.get_ident(), garbage.__code__)  # a loop that has returned
for _ in range(5000):
    garbage()
    assert loop_state.state() == "idle"
garbage()
assert busy_threads().startswith("MainThread at ")
print("read 5000 times")
"""


def test_reading_the_training_threads_frame_survives_a_collection_of_a_thread_local():
    """The teardown reads the training thread's frame every 2 ms while it waits for a step
    boundary. On CPython 3.11 a collection inside ``sys._current_frames()`` that frees a
    ``threading.local`` deadlocks the process (python/cpython#106883): a saver hung
    mid-teardown and was killed at its deadline without a report (the cycle abandoned)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", GARBAGE_WITH_A_LOCAL],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "read 5000 times" in done.stdout


class _Training:
    """The teardown's view of a training thread, fixed in one state."""

    def __init__(self, state: str, step: int | None = 5) -> None:
        self._state, self._step = state, step

    def state(self) -> str:
        return self._state

    def step(self) -> int | None:
        return self._step


@pytest.mark.parametrize(
    "state,order",
    [
        # At its step boundary: the device finishes its work before any communicator is
        # aborted (no abort cuts NVLink traffic in flight: ai2cm/ace #1438).
        ("parked", ["drain_device", "release_peers"]),
        ("idle", ["drain_device", "release_peers"]),
        # Inside a collective (or never reaching its boundary): a sync would never return.
        ("in_collective", ["release_peers", "drain_device"]),
        ("in_step", ["release_peers", "drain_device"]),
    ],
)
def test_the_abort_order_follows_where_the_training_thread_is(tmp_path, state, order):
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.worker.teardown import Teardown

    config = GracefulConfig(report_dir=str(tmp_path), quiesce_timeout_s=0.2)
    teardown = Teardown(
        config, [], "test", time.time() + 10, training=_Training(state), exit_process=False
    )
    teardown.run()
    names = [s.name for s in teardown.report.phases]
    assert names[:2] == ["stop", "quiesce"]
    assert names[2:4] == order, names
    assert teardown.training_released.is_set(), "a parked thread is let go after the save"


class _FinishingCollective(_Training):
    """A thread inside a collective that finishes it and parks at its boundary a few looks
    later (2 ms apart: well within the time a collective is given to finish)."""

    def __init__(self) -> None:
        super().__init__("in_collective")
        self.looks = 0

    def state(self) -> str:
        self.looks += 1
        return "in_collective" if self.looks <= 3 else "parked"


@pytest.mark.parametrize("needed", [True, False])
def test_a_collective_is_given_time_to_finish_only_when_a_boundary_is_needed(tmp_path, needed):
    """Someone saves or rejoins: the collective may finish, and the rank parks at its boundary
    (device first, then the abort). Nobody does: the peers are released at once."""
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.worker.teardown import Teardown

    config = GracefulConfig(report_dir=str(tmp_path), quiesce_timeout_s=5.0)
    teardown = Teardown(
        config,
        [],
        "test",
        time.time() + 10,
        training=_FinishingCollective(),
        exit_process=False,
        boundary_needed=needed,
    )
    teardown.run()
    names = [s.name for s in teardown.report.phases]
    if needed:
        assert names[2:4] == ["drain_device", "release_peers"], names
        assert teardown.quiescent and teardown.clean_step == 5
    else:
        assert names[2:4] == ["release_peers", "drain_device"], names
        assert teardown.clean_step is None


def test_a_survivors_next_step_runs_once_its_teardown_ended(tmp_path):
    """``start(then)``: a survivor's ask to rejoin runs on the watchdog's thread once the
    teardown is done (that thread has nothing left to watch), not on a thread of its own."""
    import threading
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.worker.teardown import Teardown

    config = GracefulConfig(report_dir=str(tmp_path), quiesce_timeout_s=0.2)
    teardown = Teardown(
        config, [], "test", time.time() + 10, training=_Training("parked"), exit_process=False
    )
    ran: list[tuple[str, bool]] = []
    ended = threading.Event()

    def then() -> None:
        ran.append((threading.current_thread().name, teardown.done.is_set()))
        ended.set()

    teardown.start(then)
    assert ended.wait(10), "the survivor's next step never ran"
    assert ran == [("ray_graceful-watchdog", True)]


def test_a_thread_stuck_in_a_collective_is_timed_from_the_release_not_from_the_exit(
    tmp_path, monkeypatch
):
    """A saver released its peers seconds before it asks Ray to exit: a thread still in its
    collective since then is given up on at once, not after a fresh wait."""
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.worker import teardown as teardown_module

    config = GracefulConfig(report_dir=str(tmp_path), exit_grace_s=5.0)
    teardown = teardown_module.Teardown(config, [], "test", time.time() + 30, exit_process=False)
    threshold = teardown_module.STUCK_IN_COLLECTIVE_S
    monkeypatch.setattr(teardown_module, "thread_in_collective", lambda: True)

    teardown.released_at = time.monotonic() - 2.0
    waited, stuck_s = teardown._wait_for_intended_exit()
    assert stuck_s is not None and stuck_s >= 2.0
    assert waited < threshold, f"waited {waited:.2f}s more for a thread stuck for 2 s"

    teardown.released_at = time.monotonic()  # just released: the thread gets its time
    waited, stuck_s = teardown._wait_for_intended_exit()
    assert stuck_s is not None and threshold <= stuck_s < 5.0

    monkeypatch.setattr(teardown_module, "thread_in_collective", lambda: False)
    teardown.config = GracefulConfig(report_dir=str(tmp_path), exit_grace_s=0.3)
    assert teardown._wait_for_intended_exit()[1] is None, "a thread out of it is not stuck"

    teardown.released_at = None  # no release ran: nothing to call stuck
    monkeypatch.setattr(teardown_module, "thread_in_collective", lambda: True)
    assert teardown._wait_for_intended_exit()[1] is None


def test_the_exit_wait_leaves_once_rays_core_worker_has_stopped(tmp_path, monkeypatch):
    """Ray's exit told the raylet and stopped the core worker: the process leaves at once,
    status 0, instead of living on while Ray's destructor joins gRPC poll threads. Until then
    (or with no way to tell) it waits for Ray as before."""
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.worker import teardown as teardown_module

    class Left(Exception):
        pass

    left: list[int] = []

    def leave(code: int) -> None:
        left.append(code)
        raise Left

    monkeypatch.setattr(teardown_module, "leave_without_finalization", leave)
    config = GracefulConfig(report_dir=str(tmp_path), exit_grace_s=5.0)
    teardown = teardown_module.Teardown(config, [], "test", time.time() + 30, exit_process=False)
    looks = iter([False, False, True])
    with pytest.raises(Left):
        teardown._wait_for_intended_exit(lambda: next(looks))
    assert left == [0]

    teardown.config = GracefulConfig(report_dir=str(tmp_path), exit_grace_s=0.1)
    assert teardown._wait_for_intended_exit(lambda: False)[1] is None
    assert teardown._wait_for_intended_exit(None)[1] is None
    assert left == [0], "still running: nothing to leave early for"


def test_a_sigterm_fallback_deadline_counts_from_the_signal(monkeypatch):
    """No order after reporting the SIGTERM: the rank goes alone, its deadline still counted
    from the signal (it was counted from the moment it gave up: 7 s after the signal for 4 s)."""
    import time

    from ray_graceful import GracefulConfig

    config = GracefulConfig(teardown_timeout_s=4.0, save_budget_s=2.0, order_wait_s=0.3)
    signalled = time.time() - 1.0  # the listener saw the signal a second ago
    _runtime, started, begun = signalled_runtime(monkeypatch, config, SilentControl(), signalled)
    assert begun.wait(5), "the rank never went alone"
    assert started["deadline"] == signalled + 4.0
    assert "no order from the coordinator" in started["trigger"]


class RefusingControl(SilentControl):
    """A coordinator that refuses the SIGTERM report: it does not know this process."""

    sigterm_refusal = "SIGTERM from an unregistered process"
    told = Told.REFUSED


def test_a_refused_sigterm_report_goes_alone_at_once_and_says_why(monkeypatch):
    """No order will follow a refusal: the rank goes alone without waiting ``order_wait_s``, and
    its trigger names the coordinator's reason (it said "no order within 5 s", a wait it never
    made)."""
    import time

    from ray_graceful import GracefulConfig

    signalled = time.time()
    config = GracefulConfig(order_wait_s=5.0)
    _runtime, started, begun = signalled_runtime(monkeypatch, config, RefusingControl(), signalled)
    assert begun.wait(5)
    assert started["at"] - signalled < 1.0, "a refusal is not waited on"
    assert started["trigger"] == (
        "signal 15 (the coordinator refused the SIGTERM report: SIGTERM from an unregistered "
        "process)"
    )


class RestartingControl(SilentControl):
    """A control channel whose coordinator Ray is restarting: the report cannot land."""

    connected = False
    reconnecting = True
    told = Told.RESTARTING


class SilentlyDeadControl(SilentControl):
    """A coordinator SIGKILLed a moment ago: the report times out before Ray finds it dead."""

    told = Told.UNANSWERED


@pytest.mark.parametrize(
    "control_type,order_comes,why",
    [
        (RestartingControl, True, "coordinator order"),
        (RestartingControl, False, "the coordinator restarted; it was not back"),
        (SilentlyDeadControl, False, "the coordinator did not answer"),
    ],
)
def test_a_sigterm_while_the_coordinator_restarts_waits_for_the_new_ones_order(
    monkeypatch, control_type, order_comes, why
):
    """The new coordinator's order (a replica saves every shard) is worth waiting for past
    ``order_wait_s``: the rank waits while going alone afterwards still leaves it its own save
    (here 8 - 1 margin - 2 destroy - 4 save = 1 s), takes the order when it comes, and else goes
    alone then, saying why. A coordinator gone for good (the channel lost) is not waited for."""
    import threading
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.protocol import TeardownOrder
    from ray_graceful.worker.rank_events import Link

    config = GracefulConfig(teardown_timeout_s=8.0, save_budget_s=4.0, order_wait_s=0.1)
    signalled = time.time()
    runtime, started, begun = signalled_runtime(monkeypatch, config, control_type(), signalled)
    if order_comes:  # registered again 0.4 s later, the SIGTERM reported, the order out
        order = TeardownOrder("job", 0, "o-1", signalled + 8.0, "SIGTERM")
        threading.Timer(0.4, runtime.on_order, args=(order,)).start()
    assert begun.wait(5)
    assert why in started["trigger"], started["trigger"]
    # Bounds wide enough for a loaded machine, narrow enough to tell the rival behaviours
    # apart: going alone at once (0.1 s) or waiting out the teardown (about 7 s).
    if order_comes:
        assert 0.4 <= started["at"] - signalled < 1.5
    else:
        assert 0.9 <= started["at"] - signalled < 2.5, started["at"] - signalled

    signalled = time.time()
    runtime, started, begun = signalled_runtime(monkeypatch, config, RestartingControl(), signalled)
    threading.Timer(0.1, runtime.on_link, args=(Link.LOST,)).start()  # no restart left
    assert begun.wait(5)
    assert started["at"] - signalled < 0.4, "nothing to wait for once the link is lost"


def test_a_loop_is_stuck_only_after_three_typical_steps_without_a_boundary(monkeypatch):
    """A guard of a training function that saves (Ray Train) leaves early only when stuck."""
    import time as real_time

    from ray_graceful.worker.training_loop import TrainingLoop

    clock = {"now": 100.0}
    monkeypatch.setattr(real_time, "monotonic", lambda: clock["now"])
    loop = TrainingLoop()
    for step in range(1, 5):  # steps of 1 s
        loop.mark(step)
        clock["now"] += 1.0
    assert loop.typical_step_s() == 1.0
    ordered_at = clock["now"]
    clock["now"] += 2.5
    assert not loop.stuck_since(ordered_at, patience_s=2.0), "within 3 typical steps"
    clock["now"] += 1.0
    assert loop.stuck_since(ordered_at, patience_s=2.0), "3.5 s without a boundary"
    loop.mark(5)
    assert not loop.stuck_since(ordered_at, patience_s=2.0), "it reached should_stop"
    fresh = TrainingLoop()  # no step seen yet: the patience alone counts
    assert not fresh.stuck_since(clock["now"] - 1.0, patience_s=2.0)
    assert fresh.stuck_since(clock["now"] - 2.5, patience_s=2.0)


def test_on_rays_train_warm_path_a_thread_outside_its_loop_is_on_its_way_to_the_boundary():
    """Ray Train's warm path: one training function from ``setup`` to its end. A thread in
    ``setup`` (a new worker that just joined) or in ``carry_on`` was read as "out of its loop"
    and released at once - then it walked into its next step's all-reduce on a destroyed group
    and raised, and Train restarted the whole group (the second notice's fault row). Now it is
    waited for, like a thread in its step, until it parks."""
    import threading

    from ray_graceful.worker.threads import ThreadAt
    from ray_graceful.worker.training_loop import TrainingLoop

    loop = TrainingLoop()
    assert loop.state() is ThreadAt.IDLE, "a hand-built rank with no loop seen: out of it"
    loop.peers_reach_boundary = True
    assert loop.state() is ThreadAt.IN_STEP
    loop.mark(5)  # the site is this thread; it is not parked and not in a step right now
    assert loop.state() is ThreadAt.IN_STEP
    teardown = _unstarted_teardown()
    thread = threading.Thread(target=loop.park, args=(5, teardown))
    thread.start()
    wait_for(lambda: loop.parked_step == 5, timeout=5, what="the thread parked at step 5")
    assert loop.state() is ThreadAt.PARKED
    teardown._let_training_go()
    thread.join(5)
    assert not thread.is_alive()


def _unstarted_teardown():
    """A real teardown, never run: what a parked training thread waits on."""
    import tempfile
    import time

    from ray_graceful import GracefulConfig
    from ray_graceful.worker.teardown import Teardown

    config = GracefulConfig(report_dir=tempfile.mkdtemp())
    return Teardown(config, [], "test", time.time() + 10, exit_process=False)


def test_the_wait_for_an_order_leaves_the_teardown_its_time(monkeypatch):
    """Review defect 7: a 45 s order wait with a 10 s teardown was accepted, and a SIGTERMed
    rank whose coordinator was lost left after 45.1 s, past its deadline (a recorded crash).
    The config refuses it now, and a wait that fits still ends early enough for the release
    and the exit (here: 4 s teardown - 1 s margin - 2 s destroy = 1 s, not 3 s)."""
    import time

    import pytest

    from ray_graceful import GracefulConfig
    from ray_graceful.config import ConfigError

    with pytest.raises(ConfigError, match=r"order_wait_s = 45\.0 does not fit"):
        GracefulConfig(teardown_timeout_s=10.0, order_wait_s=45.0, save_budget_s=5.0)

    config = GracefulConfig(teardown_timeout_s=4.0, save_budget_s=2.0, order_wait_s=3.0)
    signalled = time.time()
    _runtime, started, begun = signalled_runtime(monkeypatch, config, SilentControl(), signalled)
    assert begun.wait(5)
    assert started["deadline"] == signalled + 4.0
    assert started["at"] - signalled < 1.5, f"waited {started['at'] - signalled:.2f}s"


def test_a_parked_step_ends_with_the_release_so_a_later_save_is_labelled_with_its_own_step():
    """A warm restart's survivor parks at step k in one cycle and trains on: the next cycle's
    save must be labelled with the step it parks at then, not k (once, every later save was
    labelled k and a restart resumed from the first cycle's step with newer state)."""
    import threading

    from ray_graceful.worker.training_loop import TrainingLoop

    teardown = _unstarted_teardown()
    loop = TrainingLoop()
    loop.mark(41)
    parked = threading.Thread(target=loop.park, args=(41, teardown))
    parked.start()
    wait_for(lambda: loop.parked_step == 41, 5, "the thread to park")
    assert loop.step() == 41 and loop.state() == "parked", "held at its boundary for the save"
    teardown._let_training_go()
    parked.join(timeout=5)
    assert loop.parked_step is None and loop.state() != "parked"
    loop.mark(81)  # the next cycle, trained on after the rejoin
    assert loop.step() == 81


def test_a_thread_parked_below_the_agreed_stop_step_trains_on_and_parks_there():
    """A rank told just before its boundary k parked there while a peer was already inside
    step k+1: once the group agreed on k+1 (``stop_step.py``) ``should_stop(k)`` returns False
    - train that step - and the boundary k+1 parks until the save is done, as always."""
    import threading

    from ray_graceful.worker.training_loop import TrainingLoop

    teardown = _unstarted_teardown()
    loop = TrainingLoop()
    answers: list[tuple[int, bool]] = []

    def train_from(step: int) -> None:
        while True:
            loop.mark(step)
            stop = loop.park(step, teardown)
            answers.append((step, stop))
            if stop:
                return
            step += 1  # the step the peers are inside of, trained with them

    thread = threading.Thread(target=train_from, args=(7,))
    thread.start()
    wait_for(lambda: loop.parked_step == 7, 5, "the thread to park at 7")
    teardown._run_on_to(8)
    wait_for(lambda: loop.parked_step == 8, 5, "the thread to park at the agreed step 8")
    assert answers == [(7, False)], "it left boundary 7 to train on, and holds at 8"
    teardown._let_training_go()
    thread.join(5)
    assert answers == [(7, False), (8, True)]
    assert not teardown.runs_on_past(7), "once released, nothing runs on"


def test_an_evicted_ray_train_worker_is_left_to_train_once_its_function_raised(
    tmp_path, monkeypatch
):
    """Under Ray Train's replica groups the evicted worker's teardown publishes its report,
    ends, and exits nothing itself once the training function raised out of ``carry_on``: Train
    replaces its group and ends the process (its own exit while Train replaced another worker's
    group failed Train's controller). A function that does not raise - stuck outside
    ``carry_on`` - leaves Train nothing to see: that worker exits as any rank does."""
    import threading
    import time

    from ray_graceful import GracefulConfig, read_reports
    from ray_graceful.worker import teardown as teardown_module

    config = GracefulConfig(report_dir=str(tmp_path))
    teardown = teardown_module.Teardown(config, [], "test", time.time() + 30, train_ends_it=True)
    carry_on = threading.Thread(
        target=lambda: teardown.done.wait(10) and teardown.train_fn_raised.set()
    )
    carry_on.start()
    teardown._finish()  # returns: nothing ended this process
    carry_on.join(10)
    assert (teardown.report.exit_path, teardown.report.exit_code) == ("ray_train", 0)
    assert teardown.report.phases[-1].detail.startswith("left to Ray Train")
    assert [r.exit_path for r in read_reports(str(tmp_path))] == ["ray_train"]

    class Exited(Exception):
        pass

    asked: list[str] = []

    def stop_here(*_args):
        raise Exited

    monkeypatch.setattr(teardown_module, "TRAIN_FN_RAISES_WITHIN_S", 0.1)
    monkeypatch.setattr(teardown_module.ray_adapter, "intended_exit", lambda: asked.append)
    monkeypatch.setattr(teardown_module, "skip_finalization", lambda _code: None)
    monkeypatch.setattr(teardown_module.gc, "freeze", lambda: None)
    stuck = teardown_module.Teardown(config, [], "test", time.time() + 30, train_ends_it=True)
    monkeypatch.setattr(stuck, "_wait_for_intended_exit", stop_here)
    with pytest.raises(Exited):
        stuck._finish()
    assert stuck.done.is_set() and len(asked) == 1, "it asked Ray to end it after all"
    assert stuck.report.exit_path == "ray_intended"
    assert "did not raise within" in stuck.report.phases[-1].detail
