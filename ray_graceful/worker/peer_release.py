"""Releasing a group's peers through the group's own store, when no coordinator can.

With a coordinator, a rank that gets SIGTERM reports it and the coordinator orders every peer
out. Without one - none was started, Ray is restarting it, or it is gone for good - a rank that
tears itself down alone used to release only its ring neighbours: gloo fails the pairs whose
sockets close, and a rank further round waits out the collective timeout (30 min on gloo,
10 min on NCCL) while the neighbours raise out of the collective and stay behind idle.

So a rank leaving alone writes one key into the store of each of its groups
(``announce_leaving``), and while no coordinator is reachable every rank watches that key
(``PeerWatch``): a peer that sees it tears itself down too - it leaves, rather than staying
behind raising or blocked. A store that has gone away says the same: the store lives in rank 0's
process (``init_process_group``'s TCPStore), and a group without rank 0 cannot go on.

The watch is one ``check`` per group per interval against the store's host, only while the
coordinator is away. The interval grows with the group (0.25 s plus 0.25 ms per rank), so a
4,096-rank group asks its store about 3,000 times a second at most.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

from .. import torch_adapter
from .process_groups import GroupHandle
from .threads import run_bounded

logger = logging.getLogger(__name__)

LEAVE_KEY = "ray_graceful/leave"
ANNOUNCE_TIMEOUT_S = 0.5  # a store whose host is unreachable must not hold a teardown up
BASE_INTERVAL_S = 0.25
PER_RANK_INTERVAL_S = 0.00025


def watch_interval(world_size: int) -> float:
    """Seconds between two looks at one group's store (grows with the group)."""
    return BASE_INTERVAL_S + PER_RANK_INTERVAL_S * max(world_size, 1)


def announce_leaving(groups: Iterable[GroupHandle], why: str) -> list[str]:
    """Write the leave key into every group's store (bounded); the groups that have it now.

    A key already there (a peer announced first) is left as it is: the first leaver's words
    are the ones its peers report.
    """
    value = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "why": why[:300]})
    handles = list(groups)
    told: list[str] = []

    def write() -> None:
        for handle in handles:
            try:  # nothing here may keep the teardown that announces from starting
                store = torch_adapter.group_store(handle.process_group)
                if store is None:
                    continue
                if not store.check([LEAVE_KEY]):
                    store.set(LEAVE_KEY, value)
                told.append(handle.name)
            except Exception as exc:  # its host is gone: nobody is left to tell there
                logger.info("ray_graceful: could not tell group %r's peers: %r", handle.name, exc)

    try:
        run_bounded(write, ANNOUNCE_TIMEOUT_S, "announce")
    except TimeoutError:  # a store that does not answer: the groups told so far are the answer
        pass
    return list(told)


def read_leave(handle: GroupHandle) -> str | None:
    """Why this group's peers must leave, if they must (its key, or its store gone); else None."""
    store = torch_adapter.group_store(handle.process_group)
    if store is None:
        return None
    try:
        if not store.check([LEAVE_KEY]):
            return None
        raw = bytes(store.get(LEAVE_KEY)).decode("utf-8", "replace")
    except Exception as exc:
        return (
            f"group {handle.name!r}'s store is gone ({type(exc).__name__}): its host, rank 0's "
            "process, ended, and the group cannot go on"
        )
    try:
        said = json.loads(raw)
        who = f"{said['host']}:{said['pid']}"
        return f"a peer in group {handle.name!r} ({who}) left on its own: {said['why']}"
    except (ValueError, KeyError, TypeError):
        return f"a peer in group {handle.name!r} left on its own ({raw[:200]!r})"


class PeerWatch:
    """Watches this process's groups for a peer that left alone, while ``needed()`` holds.

    ``groups()`` gives the groups to watch, ``on_release(why)`` is called once when one must be
    left. ``start()`` is idempotent; the thread ends when ``needed()`` turns false (the
    coordinator is back, or a teardown began) and a later ``start()`` begins a new one.
    """

    def __init__(
        self,
        groups: Callable[[], list[GroupHandle]],
        on_release: Callable[[str], None],
        needed: Callable[[], bool],
    ) -> None:
        self.groups, self.on_release, self.needed = groups, on_release, needed
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        with self._lock:
            if self.watching:
                return
            self._thread = threading.Thread(
                target=self._run, name="ray_graceful-peer-watch", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while self.needed():
            groups = self.groups()
            for handle in groups:
                why = read_leave(handle)
                if why is not None:
                    logger.warning("ray_graceful: released by a peer: %s", why)
                    self.on_release(why)
                    return
            largest = max((g.world_size for g in groups), default=1)
            time.sleep(watch_interval(largest))
