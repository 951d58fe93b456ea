"""Threads, as the teardown needs to see them: bounded calls, and where the others are.

``run_bounded`` runs a call that may wedge (a CUDA sync, ``destroy_process_group``, a save) on a
daemon thread and stops waiting for it at a deadline. ``thread_in_collective`` and
``busy_threads`` read the other threads' frames: whether one is inside ``torch.distributed``
(so Ray's exit, which waits for the running task, would wait forever), and where each is, for
the report when a save or an exit was held up. Every read of the other threads' frames goes
through ``current_frames``, which keeps the cyclic GC out of it on CPython 3.11.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..protocol.words import Word
from ..torch_adapter import in_torch_distributed


class ThreadAt(Word):
    """Where the training thread is, as the teardown sees it (``TrainingLoop.state``)."""

    PARKED = "parked"  # inside should_stop(step), held there by the teardown
    IDLE = "idle"  # outside the function that calls should_stop: left its loop, or never in one
    IN_COLLECTIVE = "in_collective"  # inside its step, in a torch.distributed call
    IN_STEP = "in_step"  # inside its step

    @property
    def at_boundary(self) -> bool:
        """Whether a save may start: the thread is at its step boundary or out of its loop."""
        return self in (ThreadAt.PARKED, ThreadAt.IDLE)


def run_bounded(fn: Callable[[], Any], timeout: float, name: str) -> Any:
    """Run ``fn`` on a daemon thread; return its result, re-raise its error, or TimeoutError."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"ray_graceful-{name}", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if thread.is_alive():
        raise TimeoutError(f"{name} still running after {timeout:.1f}s; left behind")
    if "error" in box:
        raise box["error"]
    return box.get("result")


# CPython before 3.12: sys._current_frames() holds the runtime's thread-list lock while it makes
# frame objects. An allocation there may start a collection, and a threading.local among the
# garbage takes that same lock to be freed: the thread waits on itself, holding the GIL, and the
# whole process stops for good (python/cpython#106883, fixed in 3.12 only).
_FRAMES_MAY_COLLECT = sys.version_info < (3, 12)
_frames_lock = threading.Lock()  # one reader at a time: a second must not re-enable the GC


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()``, with the cyclic GC held off while it runs where it must be.

    The teardown reads the training thread's frame every few milliseconds while it waits for a
    step boundary; a process whose garbage held a ``threading.local`` (Ray's and torch's
    threads make them) deadlocked there, mid-teardown, until the kernel deadline killed it
    without a report. Collections only wait: nothing is freed later than the next allocation.
    """
    if not _FRAMES_MAY_COLLECT:
        return sys._current_frames()
    with _frames_lock:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return sys._current_frames()
        finally:
            if enabled:
                gc.enable()


def _other_threads() -> list[tuple[str, FrameType]]:
    """(name, current frame) of every thread that is not one of ray_graceful's own."""
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = [(names.get(i, str(i)), frame) for i, frame in current_frames().items()]
    return [(name, frame) for name, frame in threads if not name.startswith("ray_graceful-")]


def thread_in_collective() -> bool:
    """Whether a thread other than ours is inside a ``torch.distributed`` call right now."""
    return any(in_torch_distributed(frame.f_code.co_filename) for _n, frame in _other_threads())


def busy_threads() -> str:
    """Where each non-ray_graceful thread is, innermost frame first: what held the exit."""
    where = []
    for name, frame in _other_threads():
        stack = traceback.extract_stack(frame)[-3:]
        where.append(
            f"{name} at "
            + " <- ".join(
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)
            )
        )
    return "; ".join(where) or "no other thread"
