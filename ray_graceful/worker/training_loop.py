"""The thread that trains, as the teardown needs to know it: where it is, and its step.

``should_stop(step)`` marks the step boundary: it records the step and which function called it
(the training loop, found by its code object, past Ray's and ray_graceful's own wrappers). From
that the teardown reads where the thread is - ``state()`` - and the step a save holds -
``step()``. Once a teardown began, ``park`` holds the thread inside ``should_stop`` until this
rank's save is done: the rule that makes a save hold exactly the state of the step it is
labelled with (docs/worker.md, "Step boundaries and saving").
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from types import CodeType
from typing import TYPE_CHECKING

from ..torch_adapter import in_torch_distributed
from .threads import ThreadAt, current_frames, thread_in_collective

if TYPE_CHECKING:
    from .teardown import Teardown


class TrainingLoop:
    """One process's training loop (``teardown.TrainingThread``)."""

    def __init__(self) -> None:
        self.last_step: int | None = None
        # Where the loop last called should_stop(step): (thread id, its code object).
        self.step_site: tuple[int, CodeType] | None = None
        self.parked_step: int | None = None  # the step the thread is parked at, if it is
        self.marked_at: float | None = None  # time.monotonic() of the last boundary
        self.step_times: deque[float] = deque(maxlen=8)  # seconds between recent boundaries
        # Every peer heads for the same boundary (Ray Train's warm path agrees on the stop step
        # before anyone parks): a collective in flight will end, and a thread outside its loop
        # is on its way into it, so the teardown waits for the thread to park (bounded by
        # ``quiesce_timeout_s``) instead of releasing it from inside its step
        self.peers_reach_boundary = False

    def mark(self, step: int) -> None:
        """A step boundary: ``step`` steps are done (called by ``should_stop(step)``)."""
        now = time.monotonic()
        if self.marked_at is not None and step != self.last_step:
            self.step_times.append(now - self.marked_at)
        self.last_step, self.marked_at = step, now
        self.step_site = (threading.get_ident(), _caller_code())

    def typical_step_s(self) -> float | None:
        """The median of the recent step times, or None before two boundaries were seen."""
        if not self.step_times:
            return None
        ordered = sorted(self.step_times)
        return ordered[len(ordered) // 2]

    def stuck_since(self, since: float, patience_s: float) -> bool:
        """No step boundary since ``since`` (monotonic) for longer than the patience allows.

        Patience: three typical steps, and at least ``patience_s``. A loop that took that long
        to reach its next boundary after a stop order is blocked (a collective whose peer
        hangs, a stalled data loader): waiting for it to save only costs the grace window.
        """
        typical = self.typical_step_s()
        patience = max(patience_s, 3 * typical if typical is not None else 0.0)
        reached = self.marked_at is not None and self.marked_at >= since
        return not reached and self.parked_step is None and time.monotonic() - since > patience

    def state(self) -> ThreadAt:
        """Where the training thread is (``ThreadAt``): inside its step, and in a collective
        when a ``torch.distributed`` call is on its stack; else parked or out of its loop."""
        if self.parked_step is not None:
            return ThreadAt.PARKED
        if self.peers_reach_boundary:
            # Ray Train's warm path: one training function from setup to its end, so a thread
            # not in its loop now (in setup, in carry_on's rejoin) is on its way into it - to
            # the step boundary every peer heads for. Never "out of its loop".
            return ThreadAt.IN_STEP
        site = self.step_site
        if site is None:  # no loop known: any thread inside a collective counts
            return ThreadAt.IN_COLLECTIVE if thread_in_collective() else ThreadAt.IDLE
        thread_id, code = site
        frame = current_frames().get(thread_id)
        in_collective = False
        while frame is not None:
            if frame.f_code is code:
                return ThreadAt.IN_COLLECTIVE if in_collective else ThreadAt.IN_STEP
            in_collective = in_collective or in_torch_distributed(frame.f_code.co_filename)
            frame = frame.f_back
        return ThreadAt.IDLE

    def step(self) -> int | None:
        return self.parked_step if self.parked_step is not None else self.last_step

    def park(self, step: int, teardown: Teardown | None) -> bool:
        """Hold the training thread at its step boundary while this rank's teardown saves.

        The rule users can rely on: once a teardown began, ``should_stop(step)`` does not return
        until the emergency save (if this rank makes one) is done, so the saved state is exactly
        the state after ``step``; then it returns True. Bounded by the deadline.

        False - train on - where the group agreed to stop at a later step (``stop_step.py``):
        the thread leaves this boundary, runs its next step with its peers, and parks there.
        """
        if teardown is None or teardown.training_released.is_set():
            return True
        if teardown.runs_on_past(step):
            return False
        self.parked_step = step
        try:
            return teardown.hold_at(step)
        finally:
            # Released: the thread trains on (a warm restart's survivor) or leaves. A parked
            # step kept past here would label every later save with this step.
            self.parked_step = None


# Modules whose frames sit between a training loop and ``setup.should_stop``: the public
# ``should_stop`` wrappers, and Ray's method wrappers. Named exactly, not by the package prefix:
# a loop may itself live in a ``ray_graceful.*`` module (the demo, ``bench``'s rank actors).
_WRAPPER_MODULES = (
    "ray_graceful.worker.training_loop",
    "ray_graceful.worker.mixin",
    "ray_graceful.worker.setup",
    "ray_graceful.train",
    "ray_graceful.train.cold",
    "ray_graceful.train.warm",
)


def _caller_code() -> CodeType:
    """The code of the user's function that called should_stop (Ray may wrap the method)."""
    frame = sys._getframe(3)  # past mark() and should_stop()
    while frame.f_back is not None:
        module = frame.f_globals.get("__name__", "")
        if module not in _WRAPPER_MODULES and not module.startswith("ray."):
            break
        frame = frame.f_back
    return frame.f_code
