"""How the actors a coordinator leaves on its job's nodes end: with the coordinator, for good.

The memory tier's keepers (``memory/keeper.py``) and the node agents (``node/agent.py``) are
detached from the process that starts them. A keeper holds checkpoint shards that must outlive a
coordinator crash; a node agent relays its node's ranks, and must outlive the first of them -
the rank process that happened to start it - so that the last rank of a node to tear down still
reports through it. Detached, neither would ever end on its own: each watches its coordinator
and leaves once that is DEAD in the GCS (the job ended, ``Coordinator.shutdown()``, restarts used
up) - not while Ray restarts it.

The look costs the GCS one call, so it is taken only while the actor has nothing to do
(``busy``): a node agent that relays ranks learns of its coordinator's death from its own long
poll, which then fails, and its ranks leave it; at thousands of nodes, a busy agent asks the
GCS nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from . import ray_adapter

logger = logging.getLogger(__name__)

WATCH_S = 2.0  # how often an idle actor asks whether its coordinator is gone for good


def gone_for_good(actor_id: str) -> bool:
    """Whether the GCS lists the actor as DEAD (not restarting: that is ALIVE or RESTARTING)."""
    return actor_id in ray_adapter.dead_actors({actor_id})


def leave_with_coordinator(
    coordinator_id: str,
    what: str,
    busy: Callable[[], bool] = lambda: False,
    every_s: float = WATCH_S,
    is_gone: Callable[[str], bool] = gone_for_good,
    leave: Callable[[], None] = lambda: ray_adapter.call_self("leave"),
) -> threading.Thread:
    """Watch (on a daemon thread) for ``coordinator_id`` gone for good, then ``leave``: by
    default this actor's own ``leave`` method, which ends it (``ray.actor.exit_actor()``).
    ``what`` names the actor in the log."""

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if busy():
                continue
            try:
                gone = is_gone(coordinator_id)
            except Exception as exc:  # the GCS away for a moment: ask again
                logger.warning("ray_graceful %s: cannot see the coordinator: %r", what, exc)
                continue
            if gone:
                logger.info("ray_graceful %s: the coordinator is gone for good; leaving", what)
                leave()
                return

    thread = threading.Thread(target=watch, daemon=True, name=f"{what}-watch")
    thread.start()
    return thread
