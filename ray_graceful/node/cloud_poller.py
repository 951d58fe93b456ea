"""A node's cloud-notice poller: a thread of the node agent (``agent.py``), one per node.

It detects the cloud (or takes the one configured), polls the metadata service every
``cloud_poll_interval_s``, and turns each new event into a notice for the job's coordinator -
with the cloud's own deadline - and, with ``cloud_drain``, a Ray drain of the node with that
deadline (so Ray's autoscaler and Ray Train's preemption handling see it too). Off a cloud it
stops after the detection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..bounded import NoAnswer, call
from ..config import GracefulConfig

logger = logging.getLogger(__name__)


class CloudWatch:
    """The poller's thread and what it saw (``seen()``)."""

    def __init__(self, config: GracefulConfig, node_id: str, coordinator: Any) -> None:
        self.config, self.node_id, self.coordinator = config, node_id, coordinator
        self.cloud: str | None = None
        self.events: list[dict] = []
        threading.Thread(target=self._run, name="ray_graceful-cloud", daemon=True).start()

    def _run(self) -> None:
        from .. import cloud as clouds

        config = self.config
        urls = {c: config.cloud_metadata_url for c in clouds.CLOUDS if config.cloud_metadata_url}
        cloud: str | None = config.cloud_notices
        if cloud == "auto":
            cloud = clouds.detect(urls)
            if cloud is None:
                logger.info("ray_graceful: no cloud metadata service answers on this node")
                return
        assert cloud is not None  # a mode, or what detect() found
        self.cloud = chosen = cloud
        poll_forever(
            lambda: clouds.CloudPoller(chosen, urls.get(chosen)),
            self._tell,
            config.cloud_poll_interval_s,
        )

    def _tell(self, event: Any) -> None:
        from .. import ray_adapter

        self.events.append({"kind": event.kind, "deadline": event.deadline})
        logger.warning("ray_graceful: %s %s on node %s", event.cloud, event.kind, self.node_id)
        notice = {
            "source": "cloud",
            "node_id": self.node_id,
            "reason": f"{event.cloud} {event.kind}: {event.detail}"[:500],
            "deadline": event.deadline,
        }
        reply = call(self.coordinator.notify, notice, timeout=10)
        if isinstance(reply, NoAnswer):
            logger.warning("ray_graceful: could not tell the coordinator: %s", reply)
        elif not reply.accepted:
            logger.warning("ray_graceful: the coordinator refused it: %s", reply.reason)
        if self.config.cloud_drain:
            try:
                ray_adapter.drain_node(self.node_id, event.deadline, f"{event.cloud} {event.kind}")
            except Exception as exc:
                logger.warning("ray_graceful: could not drain the node: %r", exc)

    def seen(self) -> dict:
        return {"cloud": self.cloud, "events": list(self.events)}


def poll_forever(
    make_poller: Callable[[], Any],
    tell: Callable[[Any], None],
    interval_s: float,
    stop: threading.Event | None = None,
) -> None:
    """Poll until ``stop``; a step that raises anyway is logged and the poller is made anew.

    ``CloudPoller.poll_once`` already turns every bad answer into a log line; this is the
    second fence, so that no answer - nor a bug of ours - ends a node's cloud notices for the
    rest of the job (the TERMINATE that follows must still be reported).
    """
    stop = stop or threading.Event()
    poller = make_poller()
    while not stop.is_set():
        try:
            for event in poller.poll_once():
                tell(event)
        except Exception as exc:
            logger.warning(
                "ray_graceful: the cloud poller failed (%s: %s); starting it again",
                type(exc).__name__,
                str(exc)[:300],
            )
            try:
                seen: set[str] = getattr(poller, "seen", set())
                poller = make_poller()
                poller.seen = seen  # an event already told is not told again
            except Exception as again:
                logger.warning("ray_graceful: could not start it again: %r", again)
        stop.wait(interval_s)
