"""How a process leaves: Ray's intended exit where it can, a hard exit where it must.

Everything here is safe on the exit path: writes go through ``os.write`` (never ``logging``,
whose lock a wedged thread may hold), and a hard exit is ``os._exit``. Ray records its
intended exit as INTENDED_SYSTEM_EXIT with status 0; it records any hard exit as a worker crash
(SYSTEM_ERROR) whatever the status - so the teardown takes the hard way only when Ray's does not
end the process in time.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable

from .. import ray_adapter
from ..config import GracefulConfig

# When to call what, on the rank's timers' thread (``timers.Timers.call_at``)
CallAt = Callable[[float, Callable[[], object]], None]


def write_stderr(text: str) -> None:
    """Write to stderr with os.write: safe from any thread, whoever holds logging's lock."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def skip_finalization(code: int = 0) -> None:
    """Once Ray has ended this worker, leave without CPython's finalization.

    Ray's intended exit tells the raylet the exit is intended, stops the core worker and
    returns from the task loop; then ``sys.exit(0)`` runs the interpreter's finalization: a
    collection over every object and every module's teardown - seconds in a process that
    imported transformers (measured with verl's workers: teardown done at 0.25 s, core worker
    down at 0.9 s, process gone at 2.5-6.6 s). Nothing of the rank's work is left by then (the
    report is written, Ray is told), so an ``atexit`` handler, registered last so it runs
    first, leaves with the status Ray chose.
    """
    import atexit

    atexit.register(leave_without_finalization, code)


def leave_without_finalization(code: int) -> None:
    """Flush the standard streams and ``os._exit``: for a process whose work is all done."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def hard_exit(code: int, why: str) -> None:
    write_stderr(f"ray_graceful: hard exit ({why}), status {code}\n")
    os._exit(code)


def request_ray_intended_exit(detail: str) -> bool:
    """Take Ray's intended-exit path now; False where there is none."""
    exit_via_ray = ray_adapter.intended_exit()
    if exit_via_ray is None:
        return False
    try:
        exit_via_ray(detail)
    except Exception as exc:
        write_stderr(f"ray_graceful: Ray's intended exit failed: {exc!r}\n")
        return False
    return True


def exit_when_idle(detail: str, grace_s: float, call_at: CallAt) -> None:
    """End this process with status 0 once the running actor method returned: Ray's intended
    exit, and ``os._exit(0)`` after ``grace_s`` if that never ends it (a method that does not
    return) - a wait on the rank's timers (``call_at``: ``Timers.call_at``), not a thread of its
    own. For a process that leaves without a teardown: a spare, a survivor not rejoining.

    As after a teardown, the interpreter's finalization is skipped: a reference cycle holding an
    ObjectRef (the traceback of a call that met a restarting coordinator, say) collected after
    Ray's core worker shut down would make the exit status 1.
    """
    gc.freeze()
    skip_finalization(0)
    if request_ray_intended_exit(detail):
        call_at(time.time() + grace_s, functools.partial(hard_exit, 0, detail))
    else:
        hard_exit(0, f"{detail} (outside a Ray worker)")


def leave(config: GracefulConfig, reason: str, call_at: CallAt) -> None:
    """Leave as a torn-down rank does, without a teardown (a survivor not rejoining after all):
    Ray's intended exit, a hard exit if that never ends it."""
    write_stderr(f"ray_graceful: leaving: {reason}\n")
    exit_when_idle(f"ray_graceful: {reason}", config.exit_grace_s + 5.0, call_at)
