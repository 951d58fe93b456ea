"""One thread for every wait a rank's machine asks for (``lifecycle.StartTimer``).

The waits that used to have a thread each - for the order after a SIGTERM, for a Ray Train
loop's guard, for a survivor's call to rejoin - are entries in one heap here; the thread sleeps
until the earliest and runs its callback (which steps the machine: ``Due``). A timer is never
cancelled: the machine ignores one that comes due in a phase it no longer concerns.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from .exit_path import write_stderr


class Timers:
    """``call_at(at, fn)``: ``fn()`` on this object's thread at Unix time ``at``."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()  # equal times keep their order; callables never compare
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def call_at(self, at: float, fn: Callable[[], object]) -> None:
        with self._wake:
            heapq.heappush(self._heap, (at, next(self._order), fn))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ray_graceful-timers", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._heap or self._heap[0][0] > time.time():
                    self._wake.wait(self._heap[0][0] - time.time() if self._heap else None)
                _at, _n, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception as exc:  # one callback never stops the others
                write_stderr(f"ray_graceful: a timer's callback failed: {exc!r}\n")
