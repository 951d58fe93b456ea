"""The node agent's heartbeat: one TCP connection to the coordinator's host watch.

The coordinator learns that a host went silent from these bytes stopping
(``coordinator/host_watch.py``), not from Ray, whose verdict on a silent host takes about a
minute. A plain socket on a thread of its own: the agent's event loop may be busy relaying
polls, and a heartbeat must not queue behind them. A heartbeat delayed by the agent's own stall
or a garbage-collection pause is what the coordinator's probe of the host's raylet tells apart
from a lost host.

The first line says who is beating: the node id, and the ticket the coordinator gave for it
through Ray (the watch hears nobody else, and probes the raylet Ray lists for that node); then
one byte every ``host_heartbeat_s``. Where the coordinator cannot be reached, or restarts
on another port, the address is asked again and the connection made anew.

The coordinator beats back. Silent for ``host_suspect_s``, it is probed the same way the
coordinator probes a host - one TCP connect to its watch, bounded by ``host_confirm_s``:
accepted, it is only slow; refused, its process is gone (Ray restarts it: connect again); no
answer, **this host is cut off** from the coordinator, and so from the peers on its side. The
coordinator is declaring it lost at the same moment and its replicas elsewhere save; the ranks
here can prove no committed step and would sit in their collectives until the timeout. So
``on_cut_off`` is told once, with the evidence: the agent orders its ranks out, saving nothing
(``agent.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

RETRY_S = 1.0  # after a failed connection, or a coordinator that did not answer
ASK_TIMEOUT_S = 10.0


class Heartbeat:
    """Beats for ``node_id`` to ``coordinator``'s host watch until ``stop()``."""

    def __init__(
        self,
        coordinator: Any,
        node_id: str,
        interval_s: float,
        suspect_s: float = 0.5,
        confirm_s: float = 0.5,
        on_cut_off: Callable[[str], object] = lambda evidence: None,
    ) -> None:
        self.coordinator, self.node_id, self.interval_s = coordinator, node_id, interval_s
        self.suspect_s, self.confirm_s, self.on_cut_off = suspect_s, confirm_s, on_cut_off
        self.beats = 0
        self.connections = 0
        self.cut_off: str | None = None  # the evidence, once this host was found cut off
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ray_graceful-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                asked = self._ask_ticket()
                if asked is None:
                    return  # the coordinator runs no host watch
                address, ticket = asked
                self._beat(address, ticket)
                if self.cut_off:
                    return  # its ranks are ordered out; the coordinator declared it lost
            except Exception as exc:
                logger.debug("ray_graceful heartbeat: %r; again in %.1fs", exc, RETRY_S)
            self._stop.wait(RETRY_S)

    def _ask_ticket(self) -> tuple[tuple[str, int], str] | None:
        """The watch's address and this node's ticket (None: no host watch), asked anew at
        every connection: a restarted coordinator listens elsewhere, with a new secret."""
        import ray

        answer = ray.get(
            self.coordinator.host_watch_ticket.remote(self.node_id), timeout=ASK_TIMEOUT_S
        )
        if answer is None:
            return None
        ip, port = answer["address"]
        return (str(ip), int(port)), str(answer["ticket"])

    def _beat(self, address: tuple[str, int], ticket: str) -> None:
        hello = {"node_id": self.node_id, "ticket": ticket}
        with socket.create_connection(address, timeout=5.0) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(json.dumps(hello).encode() + b"\n")
            sock.setblocking(False)  # the beat never waits on the network
            self.connections += 1
            heard = next_beat = time.monotonic()
            while not self._stop.is_set():
                with contextlib.suppress(BlockingIOError):
                    sock.send(b".")
                    self.beats += 1
                heard = heard if not _drained(sock) else time.monotonic()
                if time.monotonic() - heard >= self.suspect_s:
                    if self._cut_off_from(address, time.monotonic() - heard):
                        return
                    heard = time.monotonic()  # alive: suspected again after suspect_s
                next_beat += self.interval_s
                self._stop.wait(max(0.0, next_beat - time.monotonic()))

    def _cut_off_from(self, address: tuple[str, int], silent_s: float) -> bool:
        """The coordinator went quiet: probe it. True once this host is found cut off (told to
        ``on_cut_off``, and the beat ends); raises when the coordinator's process is gone."""
        evidence = cut_off_evidence(address, self.confirm_s, silent_s)
        if evidence is None:
            return False  # it answers: slow, not gone
        self.cut_off = evidence
        logger.warning("ray_graceful heartbeat: %s", evidence)
        self.on_cut_off(evidence)
        return True


def cut_off_evidence(address: tuple[str, int], confirm_s: float, silent_s: float) -> str | None:
    """Probe a coordinator silent for ``silent_s``: None if it accepts a TCP connect within
    ``confirm_s`` (slow, not gone); why this host is cut off if nothing answers. A refusal
    (its process is gone, the kernel answers: Ray restarts it) is raised."""
    try:
        socket.create_connection(address, timeout=confirm_s).close()
        return None
    except ConnectionRefusedError:
        raise
    except OSError as exc:
        return (
            f"no beat from the coordinator for {silent_s:.2f}s, and a TCP connect to it at "
            f"{address[0]}:{address[1]} had no answer in {confirm_s:g}s ({exc!r}): this host "
            "is cut off"
        )


def _drained(sock: socket.socket) -> bool:
    """Read whatever the coordinator sent (never blocking); whether anything came.
    A closed connection raises, as a reset does: the caller connects anew."""
    came = False
    while True:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return came
        if not data:
            raise ConnectionResetError("the coordinator closed the heartbeat connection")
        came = True
