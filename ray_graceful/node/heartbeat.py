"""The node agent's heartbeat: one TCP connection to the coordinator's host watch.

The coordinator learns that a host went silent from these bytes stopping
(``coordinator/host_watch.py``), not from Ray, whose verdict on a silent host takes about a
minute. A plain socket on a thread of its own: the agent's event loop may be busy relaying
polls, and a heartbeat must not queue behind them. A heartbeat delayed by the agent's own stall
or a garbage-collection pause is what the coordinator's probe of the host's raylet tells apart
from a lost host.

The first line says who is beating (the node id, and its raylet's address for that probe);
then one byte every ``host_heartbeat_s``. Where the coordinator cannot be reached, or restarts
on another port, the address is asked again and the connection made anew.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from .. import ray_adapter

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed connection, or a coordinator that did not answer
ASK_TIMEOUT_S = 10.0


class Heartbeat:
    """Beats for ``node_id`` to ``coordinator``'s host watch until ``stop()``."""

    def __init__(self, coordinator: Any, node_id: str, interval_s: float) -> None:
        self.coordinator, self.node_id, self.interval_s = coordinator, node_id, interval_s
        self.beats = 0
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ray_graceful-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        raylet = None
        while not self._stop.is_set():
            try:
                raylet = raylet or ray_adapter.raylet_address(self.node_id)
                address = self._ask_address()
                if address is None:
                    return  # the coordinator runs no host watch
                if raylet is None:
                    raise RuntimeError(f"Ray lists no live raylet for node {self.node_id[:12]}")
                self._beat(tuple(address), raylet)
            except Exception as exc:
                logger.debug("ray_graceful heartbeat: %r; again in %.1fs", exc, RETRY_S)
            self._stop.wait(RETRY_S)

    def _ask_address(self) -> tuple[str, int] | None:
        import ray

        return ray.get(self.coordinator.host_watch_address.remote(), timeout=ASK_TIMEOUT_S)

    def _beat(self, address: tuple[str, int], raylet: tuple[str, int]) -> None:
        hello = {"node_id": self.node_id, "raylet_ip": raylet[0], "raylet_port": raylet[1]}
        with socket.create_connection(address, timeout=5.0) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(json.dumps(hello).encode() + b"\n")
            self.connections += 1
            next_beat = time.monotonic()
            while not self._stop.is_set():
                sock.sendall(b".")
                self.beats += 1
                next_beat += self.interval_s
                self._stop.wait(max(0.0, next_beat - time.monotonic()))
