"""How a survivor of a warm restart leaves after all: in time, and through Ray's intended exit.

A survivor's teardown ends without an exit (``rejoin.py``). It then asks the coordinator for its
answer at once, in the background. If the answer is "leave" (the warm restart fell back), the
coordinator is lost, a SIGTERM arrives, or nothing asks it to rejoin within
``rejoin_timeout_s``, it leaves exactly as a torn-down rank does - never staying behind as an
idle actor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..config import GracefulConfig
from ..protocol import Rendezvous
from .exit_path import exit_when_idle, write_stderr

ASK_WAIT_S = 0.5  # one ask's long poll: short, so a rejoin or a SIGTERM is seen within it


class _Finished(Protocol):
    done: threading.Event

    def remaining(self) -> float: ...


def leave(config: GracefulConfig, reason: str) -> None:
    """Leave as a torn-down rank does: Ray's intended exit, a hard exit if that never ends it."""
    write_stderr(f"ray_graceful: leaving instead of rejoining: {reason}\n")
    exit_when_idle(f"ray_graceful: {reason}", config.exit_grace_s + 5.0)


def leave_unless_rejoined(
    config: GracefulConfig,
    teardown: _Finished,
    rejoining: threading.Event,
    signalled: Callable[[], bool],
    ask: Callable[[float], Rendezvous | None],
    keep: Callable[[Rendezvous], None],
) -> None:
    """After a survivor's teardown: wait for its answer; leave unless a rejoin starts in time.

    ``ask(wait_s)`` asks the coordinator (a short long poll), ``keep`` holds a "join" answer
    for ``rejoin()``. A "leave" answer, a lost coordinator, a SIGTERM or ``rejoin_timeout_s``
    without a rejoin: the process leaves at once, as a torn-down rank does. Once answered it
    keeps asking every ``ASK_WAIT_S`` (answered at once, so cheap): a coordinator lost while the
    driver has not called back yet is seen within that, not at ``rejoin_timeout_s``.
    """

    def watch() -> None:
        teardown.done.wait(max(teardown.remaining(), 0.0) + config.watchdog_margin_s)
        until = time.monotonic() + config.rejoin_timeout_s
        answered_at: float | None = None
        while time.monotonic() < until:
            if rejoining.is_set():
                return
            if signalled():
                leave(config, "SIGTERM while waiting to rejoin")
                return
            if answered_at is not None and time.monotonic() - answered_at < ASK_WAIT_S:
                time.sleep(0.05)
                continue
            try:
                answer = ask(ASK_WAIT_S)
            except Exception as exc:
                if not rejoining.is_set():
                    leave(config, f"the coordinator could not be asked ({type(exc).__name__})")
                return
            if answer is not None and answer.action == "leave" and not rejoining.is_set():
                leave(config, answer.reason)
                return
            if answer is not None:  # ``keep`` drops it once the rejoin began
                keep(answer)
                answered_at = time.monotonic()
        if not rejoining.is_set():
            leave(config, f"not asked to rejoin within rejoin_timeout_s={config.rejoin_timeout_s}")

    threading.Thread(target=watch, name="ray_graceful-rejoin-watch", daemon=True).start()
