"""Where the training thread is, as the teardown sees it: the loop is found by its code.

The loop is whatever function called ``should_stop(step)`` - wherever it is defined, even in a
module of this package's name (the demo's and the benchmarks' loops are). Inside it the thread
is "in_step"; out of it, "idle"; held in ``should_stop`` by a teardown, "parked".
"""

from __future__ import annotations

import types

import pytest

import ray_graceful
from ray_graceful.worker import _process_runtime

LOOP_SOURCE = """
import ray_graceful
from ray_graceful.worker import _process_runtime

def train(steps, seen):
    for step in range(steps):
        ray_graceful.should_stop(step + 1)
        seen.append(_process_runtime().state())
    return step + 1
"""


@pytest.mark.parametrize("module_name", ["user_code.trainer", "ray_graceful.demo_like"])
def test_training_loop_is_busy_inside_and_quiescent_after(module_name):
    module = types.ModuleType(module_name)
    exec(compile(LOOP_SOURCE, f"<{module_name}>", "exec"), module.__dict__)
    seen: list[bool] = []
    assert module.train(3, seen) == 3
    assert seen == ["in_step"] * 3, "inside its loop the thread is inside its step"
    assert _process_runtime().state() == "idle", "once the loop returned, a save may start"
    assert _process_runtime().step() == 3


def test_wrappers_are_not_taken_for_the_loop():
    runtime = _process_runtime()

    def loop() -> None:
        ray_graceful.GracefulWorkerMixin().should_stop(7)  # the mixin's method wraps it

    loop()
    assert runtime.step_site is not None
    assert runtime.step_site[1] is loop.__code__
