"""Bounded waits: a condition polled until a deadline, and a remote call answered in time.

Every wait in the plugin has a bound - a rank being evicted has seconds, not minutes - and
these two helpers are the only places that spell one out:

- ``wait_until(check, timeout, every)`` polls ``check`` until it holds or the time is up;
- ``call(method, *args, timeout=...)`` calls an actor method and waits at most ``timeout`` for
  its answer. It never raises: a call that gave no answer is a ``NoAnswer`` that says how (the
  wait ran out, the actor is restarting, dead, or the call failed) in words for the log, so
  each caller decides what a missing answer means to it without its own ``except Exception``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .word import Word

T = TypeVar("T")


def wait_until(check: Callable[[], T], timeout: float, every: float) -> T | None:
    """Call ``check`` every ``every`` seconds until it returns something true; that value, or
    None once ``timeout`` seconds passed (``check`` is called once more at the end)."""
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        value = check()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(every, left))


class Why(Word):
    """Why a remote call gave no answer."""

    TIMEOUT = "timeout"  # no answer within the timeout: busy, or dead and not yet found so
    RESTARTING = "restarting"  # ActorUnavailableError: Ray is restarting it, or cannot reach it
    DEAD = "dead"  # the actor died for good
    FAILED = "failed"  # the call raised (the method's own error, a lost object, ...)


@dataclass(frozen=True)
class NoAnswer:
    """A remote call that gave no answer: why, and the error in words."""

    why: Why
    error: str

    def __str__(self) -> str:
        return self.error


def call(method: Any, *args: Any, timeout: float) -> Any:
    """``method.remote(*args)``'s answer within ``timeout`` seconds, or a ``NoAnswer``."""
    import ray

    try:
        return ray.get(method.remote(*args), timeout=max(timeout, 0.0))
    except ray.exceptions.GetTimeoutError as exc:
        return NoAnswer(Why.TIMEOUT, _words(exc))
    except ray.exceptions.ActorUnavailableError as exc:
        return NoAnswer(Why.RESTARTING, _words(exc))
    except ray.exceptions.RayActorError as exc:  # ActorDiedError, or an older Ray's own
        return NoAnswer(Why.DEAD, _words(exc))
    except Exception as exc:
        return NoAnswer(Why.FAILED, _words(exc))


def _words(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]
