"""The coordinator's detector of hosts lost without a word: heartbeats, then one probe.

Ray declares a host dead late: 13-15 s after every process of it was killed (its kernel still
answers), about 64 s after it fell silent or was cut off (``../shared/RAY_FACTS.md``); until
then the survivors sit in their collective. So each node agent (``node/heartbeat.py``) holds
one TCP connection to this watch and writes a byte every ``host_heartbeat_s``. A host is

1. **suspected** after ``host_suspect_s`` without a heartbeat, or at once when its connection
   closes (its agent's process died: the kernel said so);
2. **confirmed lost** by one TCP connect to its raylet's port, bounded by ``host_confirm_s``:

   - *accepted*: the host's kernel and the raylet's socket answer - a slow link, a stalled or
     paused host, a garbage-collection pause, an agent that died alone. Not lost; a host still
     silent is probed again after another ``host_suspect_s``;
   - *refused*: the kernel answers and nothing listens - every process of the host is gone;
   - *no answer* within ``host_confirm_s`` (or no route): the host is silent or cut off.

So a host is never declared lost while its kernel accepts a connection within
``host_confirm_s`` (0.5 s by default: 200 ms of added latency, a stall of any length); a silent
or cut-off host is declared lost ``host_suspect_s + host_confirm_s`` after its last heartbeat
(about 1 s), a crashed one with its kernel alive within milliseconds. A host declared lost stays
lost: if it comes back its agent's connection is refused here, and its ranks, fenced by the
cycle prefix, never rejoin the group that moved on. Ray's own verdict remains the backstop
(``watch.py``).

Only the job's own agents are heard. Each asks the coordinator, through Ray, for the watch's
address and a ticket for its node (an HMAC of the node id under a secret this watch made at
start, never written anywhere); its hello names the node and carries the ticket. The raylet it
is probed at is Ray's own record of that node, never an address a sender names, and a node that
has a live connection is not taken over by a second one: a process that can merely open a TCP
connection here cannot have a healthy host declared lost, nor keep a crashed one alive.

The connections and probes are the actor's I/O; what they conclude goes to the cycle machine
as ``HostLost`` through ``on_lost``. The watch also beats back to every agent, so that a host
cut off from the coordinator ends its own ranks in the same bound (``node/heartbeat.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from .. import ray_adapter
from ..config import GracefulConfig

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # an agent says who it is at once; a connection that does not is closed
MAX_HELLO = 4096


@dataclass
class WatchedHost:
    """One host as the watch sees it: its node, its raylet's address, when it was last heard."""

    node_id: str
    raylet: tuple[str, int]
    last_heard: float
    transport: asyncio.BaseTransport | None = None  # its connection: the beat back goes there
    probing: bool = False
    lost: bool = False
    closed_at: float | None = None  # when its agent's connection closed

    @property
    def connected(self) -> bool:
        """Its agent's connection is open: a second one is refused."""
        return self.closed_at is None


@dataclass(frozen=True)
class Probe:
    """What one TCP connect to a host's raylet said."""

    alive: bool
    evidence: str


async def probe_raylet(address: tuple[str, int], timeout_s: float) -> Probe:
    """One TCP connect to ``address``, bounded by ``timeout_s``: does the host answer?

    The verdict is the kernel's, read when the bound expires: a handshake that completed while
    this process waited for a core (the coordinator runs at Ray's worker niceness, 15, and a
    loaded node may leave it none for a second or two) is an answer, even if the event loop
    came to it late. Only a connect still pending at the bound is "no answer"."""
    ip, port = address
    started = time.monotonic()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (ip, port)), timeout_s)
    except (asyncio.TimeoutError, TimeoutError):
        if not _connected(sock):
            return Probe(
                False,
                f"a TCP connect to its raylet at {ip}:{port} had no answer in {timeout_s:g}s: "
                "the host is silent or cut off",
            )
    except ConnectionRefusedError:
        return Probe(
            False,
            f"its raylet's port {ip}:{port} refused a TCP connect: the host's kernel answers, "
            "its processes are gone",
        )
    except OSError as exc:
        return Probe(False, f"its raylet at {ip}:{port} is unreachable ({exc})")
    finally:
        sock.close()
    took = time.monotonic() - started
    return Probe(True, f"its raylet at {ip}:{port} accepted a TCP connect in {took * 1000:.0f}ms")


def _connected(sock: socket.socket) -> bool:
    """Whether a non-blocking connect on ``sock`` has completed, as the kernel says now."""
    _, writable, _ = select.select([], [sock], [], 0)
    return bool(writable) and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


class _Beats(asyncio.Protocol):
    """A watched host's connection once its hello was taken: each arrival only stamps the host
    heard. A callback per read, and no coroutine woken per heartbeat: at 1,000 hosts beating
    every 0.1 s the stream reader's wake-ups were most of the watch's CPU (docs/benchmarks.md,
    host-watch-scale)."""

    def __init__(
        self,
        host: WatchedHost,
        clock: Callable[[], float],
        closed: Callable[[WatchedHost], None],
        stream: asyncio.StreamWriter,
    ) -> None:
        self.host, self.clock, self.closed = host, clock, closed
        self.stream = stream  # held: a StreamWriter garbage-collected closes its transport

    def data_received(self, data: bytes) -> None:
        self.host.last_heard = self.clock()

    def eof_received(self) -> bool:
        return False  # the agent closed its side: close ours (then connection_lost)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed(self.host)


class HostWatch:
    """The listening side of the node agents' heartbeats, and the probe of a silent host."""

    def __init__(
        self,
        heartbeat_s: float,
        suspect_s: float,
        confirm_s: float,
        on_lost: Callable[[str, str], object],
        raylet_of: Callable[[str], tuple[str, int] | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``raylet_of(node_id)``: the node's raylet address as Ray lists it alive (None if it
        does not) - blocking, so asked off the event loop (``ray_adapter.raylet_address``)."""
        self.heartbeat_s, self.suspect_s, self.confirm_s = heartbeat_s, suspect_s, confirm_s
        self.on_lost = on_lost
        self.raylet_of = raylet_of
        self.clock = clock
        self._secret = secrets.token_bytes(32)  # this watch's: a restart makes a new one
        self.refused = 0  # connections turned away (no valid ticket, a node already connected)
        self.hosts: dict[str, WatchedHost] = {}
        self.lost: dict[str, str] = {}  # node id -> the evidence it was declared lost on
        self.alive_after_suspicion = 0  # probes a suspected host answered (not lost)
        self.address: tuple[str, int] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._checker: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    @classmethod
    def of(cls, config: GracefulConfig, on_lost: Callable[[str, str], object]) -> HostWatch:
        """The watch ``config`` sets, probing the raylets Ray lists."""
        timing = (config.host_heartbeat_s, config.host_suspect_s, config.host_confirm_s)
        return cls(*timing, on_lost=on_lost, raylet_of=ray_adapter.raylet_address)

    async def start(self, host_ip: str) -> tuple[str, int]:
        """Listen on ``host_ip`` (an ephemeral port) and start checking; the address agents use."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host=host_ip, port=0)
            port = self._server.sockets[0].getsockname()[1]
            self.address = (host_ip, port)
            self._checker = asyncio.get_running_loop().create_task(self._check_forever())
        assert self.address is not None
        return self.address

    async def ticket_for(self, node_id: str) -> dict:
        """What node ``node_id``'s agent needs: the watch's address (listening from now on, on
        this node's IP) and its ticket."""
        address = await self.start(ray_adapter.node_ip_address())
        return {"address": list(address), "ticket": self.ticket(node_id)}

    def ticket(self, node_id: str) -> str:
        """The credential node ``node_id``'s agent says hello with; handed out only through
        Ray (``Coordinator.host_watch_ticket``), valid for this watch only."""
        return hmac.new(self._secret, node_id.encode(), hashlib.sha256).hexdigest()

    def describe(self) -> dict:
        now = self.clock()
        return {
            "address": list(self.address) if self.address else None,
            "hosts": {
                h.node_id: {"silent_s": round(now - h.last_heard, 3), "lost": h.lost}
                for h in self.hosts.values()
            },
            "lost": dict(self.lost),
            "alive_after_suspicion": self.alive_after_suspicion,
            "refused": self.refused,
        }

    # --- the connections -------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An agent's connection: its hello, read here; then its heartbeats, to ``_Beats``."""
        host = None
        try:
            host = await self._hello(reader)
        except (ConnectionError, OSError):
            pass
        transport = writer.transport  # a socket's: asyncio.Transport (it reads as well)
        gone = reader.at_eof() or transport.is_closing()  # it closed right after its hello
        if host is None or gone or not isinstance(transport, asyncio.Transport):
            writer.close()
            if host is not None:
                self._closed(host)
            return
        host.transport = transport
        transport.set_protocol(_Beats(host, self.clock, self._closed, writer))
        if not transport.is_reading():  # the stream's flow control may have paused it
            transport.resume_reading()

    def _closed(self, host: WatchedHost) -> None:
        """Its agent's connection closed: the kernel said its process died - probe the host."""
        host.closed_at = self.clock()
        if self.hosts.get(host.node_id) is host and not host.lost and not self._closing:
            self._probe_soon(host, "its agent's heartbeat connection closed")

    async def _hello(self, reader: asyncio.StreamReader) -> WatchedHost | None:
        """The agent's first line, ``{"node_id", "ticket"}``: its host, watched from now on;
        None (the connection is closed, nothing recorded) for anything else."""
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            hello = json.loads(line[:MAX_HELLO])
            node_id, ticket = str(hello["node_id"]), str(hello["ticket"])
        except (asyncio.TimeoutError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            return self._refuse(f"a connection without a valid hello: {exc!r}")
        if not hmac.compare_digest(ticket.encode(), self.ticket(node_id).encode()):
            return self._refuse(
                f"a hello for node {node_id[:12]} without this watch's ticket for it: not one "
                "of this job's node agents, or one of a coordinator that was restarted"
            )
        if node_id in self.lost:
            logger.warning(
                "ray_graceful host watch: host %s is back after it was declared lost (%s); its "
                "ranks are fenced by the cycle and leave - it is not watched again",
                node_id[:12],
                self.lost[node_id],
            )
            return None
        live = self.hosts.get(node_id)
        if live is not None and live.connected:
            return self._refuse(
                f"a second connection for node {node_id[:12]}, whose agent's is open: the "
                "first one stands"
            )
        raylet = await asyncio.get_running_loop().run_in_executor(None, self.raylet_of, node_id)
        if raylet is None:
            return self._refuse(f"a hello for node {node_id[:12]}, which Ray does not list alive")
        host = WatchedHost(node_id, raylet, self.clock())
        self.hosts[node_id] = host  # an agent that connects again after its old one closed
        return host

    def _refuse(self, why: str) -> WatchedHost | None:
        """Count and log a refused connection; None, the hello's answer for it."""
        self.refused += 1
        logger.warning("ray_graceful host watch: refused %s", why)
        return None

    # --- suspicion and probe ---------------------------------------------------------------

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                self.check()
            except Exception:  # never let the detector die silently: log and go on
                logger.exception("ray_graceful host watch: check failed")

    def check(self) -> None:
        """Beat back to every agent (its side of the watch: a host cut off from the coordinator
        ends its own ranks, ``node/heartbeat.py``); probe every host silent for ``suspect_s``
        that is not being probed already."""
        now = self.clock()
        for host in list(self.hosts.values()):
            if isinstance(host.transport, asyncio.WriteTransport) and not host.lost:
                with contextlib.suppress(Exception):  # a closed one is _Beats's to see
                    host.transport.write(b".")
            silent = now - host.last_heard
            if not host.lost and not host.probing and silent >= self.suspect_s:
                self._probe_soon(host, f"no heartbeat for {silent:.2f}s")

    def _probe_soon(self, host: WatchedHost, why: str) -> None:
        if host.probing or host.lost:
            return
        host.probing = True
        task = asyncio.get_running_loop().create_task(self._probe(host, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, host: WatchedHost, why: str) -> None:
        try:
            probe = await probe_raylet(host.raylet, self.confirm_s)
        finally:
            host.probing = False
        if probe.alive:
            self.alive_after_suspicion += 1
            logger.info("ray_graceful host watch: %s suspected (%s); %s: not lost",
                        host.node_id[:12], why, probe.evidence)  # fmt: skip
            # A crash ends the host's processes one by one: the raylet may still answer just
            # after the agent's connection closed. Probed again once silent for suspect_s; a
            # host whose agent is gone that long while its raylet answers is Ray's to watch.
            gone_s = self.clock() - host.closed_at if host.closed_at is not None else 0.0
            if gone_s >= self.suspect_s and self.hosts.get(host.node_id) is host:
                del self.hosts[host.node_id]  # its agent is gone, the host is not: Ray's watch
            else:
                host.last_heard = self.clock()  # silent still: probed again after suspect_s
            return
        host.lost = True
        evidence = f"{why}; {probe.evidence}"
        self.lost[host.node_id] = evidence
        logger.warning("ray_graceful host watch: host %s lost: %s", host.node_id[:12], evidence)
        self.on_lost(host.node_id, evidence)

    async def close(self) -> None:
        """Stop listening, checking and probing, and close every agent's connection."""
        self._closing = True
        for task in [self._checker, *self._tasks]:
            if task is not None:
                task.cancel()
        if self._server is not None:
            self._server.close()
        for host in self.hosts.values():
            if host.transport is not None:
                host.transport.close()
