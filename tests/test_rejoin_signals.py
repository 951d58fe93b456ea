"""A SIGTERM during a warm restart's rejoin, on the rank's side: never lost, never Ray's.

From ``rejoin()``'s first step to its last, a SIGTERM is claimed (Ray's handler would record a
crash) and held for ``rejoin()``: before the group forms it leaves, once joined the signal is
the new group's first notice, its deadline counted from the signal.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from ray_graceful import GracefulConfig
from ray_graceful.worker.hard_deadline import hard_deadline
from ray_graceful.worker.process_runtime import ProcessRuntime

pytestmark = pytest.mark.unit


@pytest.fixture
def runtime():
    """A runtime whose signals arm this test process's kernel timer: disarmed after."""
    yield ProcessRuntime(config=GracefulConfig(teardown_timeout_s=30.0))
    hard_deadline().cancel()


class ConnectedControl:
    connected = True
    reconnecting = False


def test_a_spare_handed_a_slot_claims_a_sigterm_until_its_rejoin_ends(runtime):
    """Between its assignment and its registration a spare holds no rank and waits as no
    spare: the signal is still claimed, and held for ``rejoin()``."""
    assert not runtime.claims_signals()
    runtime.begin_rejoin()
    assert runtime.claims_signals()
    assert runtime.on_sigterm(signal.SIGTERM, 1) is True
    assert runtime.signalled_during_rejoin()
    assert not runtime.stop_event.is_set() and runtime.teardown is None
    held = runtime.end_rejoin()
    assert held is not None and held[0] == signal.SIGTERM
    assert not runtime.claims_signals(), "after its rejoin, a process with no rank claims nothing"


def test_a_spare_still_waiting_for_a_slot_stops_waiting_on_a_sigterm(runtime):
    runtime.begin_rejoin()
    runtime.spare_id = "spare-1"
    assert runtime.on_sigterm(signal.SIGTERM, 1) is True
    assert runtime.stop_event.is_set()
    assert not runtime.signalled_during_rejoin()


def test_a_sigterm_seen_just_before_the_rejoin_began_is_held_for_it(runtime):
    """The survivor's watcher may not have looked yet when ``rejoin()`` begins: the signal it
    has not acted on is not lost (it was, when the rejoin cleared ``sigterm_seen``)."""
    runtime.sigterm_seen = True
    runtime.begin_rejoin()
    assert runtime.signalled_during_rejoin()


def test_the_held_sigterm_is_the_new_groups_notice_with_its_deadline_from_the_signal(runtime):
    runtime.begin_rejoin()
    received = time.time() - 2.0
    runtime.take_sigterm(signal.SIGTERM, received)
    runtime.take_sigterm(signal.SIGTERM, time.time())  # the main-thread backstop: same signal
    held = runtime.end_rejoin()
    assert held == (signal.SIGTERM, received)

    reported = threading.Event()
    seen: dict = {}

    def await_order(signum, control, received_at):
        seen.update(signum=signum, received_at=received_at)
        reported.set()

    runtime._await_order = await_order  # type: ignore[method-assign]
    runtime.control = ConnectedControl()  # type: ignore[assignment]
    runtime.take_sigterm(*held)
    assert reported.wait(5), "the held SIGTERM was not reported to the coordinator"
    assert seen == {"signum": signal.SIGTERM, "received_at": received}
    assert runtime.sigterm_seen
