"""Ray Train's warm path: ``step_guard`` ends a step whose collective failed because a peer is
gone - once the coordinator's order came - and lets every other error through.

Through the process's own runtime, its order stood in by the stop event (what the control
channel sets when an order comes). A real crash under Train is ``tests/test_train_warm.py``'s.
"""

from __future__ import annotations

import threading
import time

import pytest

from ray_graceful.train import EmergencyStop, step_guard
from ray_graceful.train import loop as loop_module
from ray_graceful.worker import process_runtime as runtime_module
from ray_graceful.worker.process_runtime import ProcessRuntime

pytestmark = pytest.mark.unit

PEER_GONE = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3464"


@pytest.fixture
def runtime(monkeypatch) -> ProcessRuntime:
    """A warm-path rank's runtime, registered (a control channel), no order yet."""
    fresh = ProcessRuntime()
    fresh.loop.peers_reach_boundary = True
    fresh.control = object()  # type: ignore[assignment]
    monkeypatch.setattr(runtime_module, "_runtime", fresh)
    monkeypatch.setattr(loop_module, "FAILED_STEP_ORDER_WAIT_S", 0.5)
    return fresh


def test_a_failed_collective_ends_the_step_once_the_order_came(runtime):
    ordered = threading.Timer(0.1, runtime.stop_event.set)  # the coordinator saw the loss
    ordered.start()
    step = 7
    with step_guard():
        raise RuntimeError(PEER_GONE)
        step += 1  # never reached: the step did not complete
    assert step == 7 and runtime.stop_event.is_set()


def test_without_an_order_the_error_goes_on_after_the_wait(runtime):
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="Connection closed by peer"), step_guard():
        raise RuntimeError(PEER_GONE)
    assert time.monotonic() - began >= 0.5, "it waited for an order first"


@pytest.mark.parametrize(
    "where", ["not-a-runtime-error", "evicted", "off-the-warm-path", "unregistered"]
)
def test_any_other_error_goes_on_at_once(runtime, where):
    """A bug in the step is no eviction, and an evicted worker's ``EmergencyStop`` (a guard
    around ``carry_on``) is the plugin's own word to leave: never held, never swallowed."""
    runtime.stop_event.set()  # even with an order in
    error: Exception | None = {
        "not-a-runtime-error": ValueError("shape mismatch"),
        "evicted": EmergencyStop("ray_graceful: this worker was evicted at step 7"),
    }.get(where)
    if where == "off-the-warm-path":
        runtime.loop.peers_reach_boundary = False
    if where == "unregistered":
        runtime.control = None
    error = error or RuntimeError(PEER_GONE)
    with pytest.raises(type(error)), step_guard():
        raise error
