"""The host watch on its own: heartbeats over real local sockets, and the probe's verdicts.

A host is lost only when it went silent *and* its raylet's port refused or did not answer;
a silent host whose kernel still accepts (a stall, a GC pause, a slow link) is not. The
timeout verdict needs a host that drops packets: ``tests/hosts`` (a partitioned namespace).
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time

import pytest

from ray_graceful.config import ConfigError, GracefulConfig
from ray_graceful.coordinator.host_watch import HostWatch, probe_raylet

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def listening() -> socket.socket:
    """A socket that accepts connections (its kernel answers), as a live raylet's port does."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def closed_port() -> int:
    """A port nothing listens on: a connect is refused, as on a host whose processes died."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


class Raylets(dict):
    """Ray's view of the nodes' raylets for these tests: node id -> a local port."""

    def __call__(self, node_id: str) -> tuple[str, int] | None:
        port = self.get(node_id)
        return None if port is None else ("127.0.0.1", port)


async def agent(w: HostWatch, node_id: str, raylet_port: int, beats: int, interval: float = 0.05):
    """An agent's heartbeat: the hello with its ticket, ``beats`` bytes, then its writer (still
    open). ``raylet_port`` is where Ray lists the node's raylet."""
    w.raylet_of[node_id] = raylet_port
    _, writer = await asyncio.open_connection(*w.address)
    writer.write(json.dumps({"node_id": node_id, "ticket": w.ticket(node_id)}).encode() + b"\n")
    for _ in range(beats):
        writer.write(b".")
        await writer.drain()
        await asyncio.sleep(interval)
    return writer


def watch(lost: list, suspect_s: float = 0.3) -> HostWatch:
    return HostWatch(
        0.05, suspect_s, 0.5, lambda node, why: lost.append((node, why)), raylet_of=Raylets()
    )


def test_a_beating_host_is_never_suspected():
    async def scenario():
        lost: list = []
        w = watch(lost)
        await w.start("127.0.0.1")
        writer = await agent(w, "n1", closed_port(), beats=30, interval=0.05)  # 1.5 s
        seen = (list(lost), w.alive_after_suspicion, w.describe()["hosts"]["n1"]["silent_s"])
        writer.close()
        await w.close()
        return seen

    lost, probed, silent_s = asyncio.run(scenario())
    assert lost == [] and probed == 0, "five suspicion windows of beats: never probed"
    assert silent_s < 0.3


def test_a_host_is_still_heard_after_the_watch_collected_its_garbage():
    """Once the hello is taken the heartbeats go to a protocol callback; the hello's stream
    objects must not close the connection when they are collected (a StreamWriter does). A
    closed connection is probed at once, and the raylet's port here refuses: it would be lost.
    (A suspicion window of 5 s: a full collection in a big test process may take a while.)"""

    async def scenario():
        lost: list = []
        w = watch(lost, suspect_s=5.0)
        await w.start("127.0.0.1")
        writer = await agent(w, "n1", closed_port(), beats=4)
        for _ in range(3):  # beats, each after a collection
            gc.collect()
            writer.write(b".")
            await writer.drain()
            await asyncio.sleep(0.05)
        seen = (list(lost), w.alive_after_suspicion, w.hosts["n1"].connected)
        writer.close()
        await w.close()
        return seen

    lost, probed, connected = asyncio.run(scenario())
    assert lost == [] and probed == 0, (lost, probed)
    assert connected, "the watch closed the agent's connection"


def test_a_silent_host_whose_kernel_accepts_is_not_lost():
    """A stall or a GC pause: no heartbeat for 1 s, but the raylet's port accepts."""
    raylet = listening()

    async def scenario():
        lost: list = []
        w = watch(lost)
        await w.start("127.0.0.1")
        writer = await agent(w, "n1", raylet.getsockname()[1], beats=2)
        await asyncio.sleep(1.2)  # silent: suspected, probed, alive - more than once
        described = w.describe()
        writer.close()
        await w.close()
        return lost, w.alive_after_suspicion, described

    lost, probed_alive, described = asyncio.run(scenario())
    raylet.close()
    assert lost == [], lost
    assert probed_alive >= 2, "suspected and probed again while still silent"
    assert described["hosts"]["n1"]["lost"] is False


def test_a_host_whose_processes_died_is_lost_at_once_with_the_evidence():
    """Its agent's connection closes (the kernel says so) and its raylet's port refuses."""

    async def scenario():
        lost: list = []
        w = watch(lost, suspect_s=5.0)  # the close alone must be enough, long before 5 s
        await w.start("127.0.0.1")
        writer = await agent(w, "n1", closed_port(), beats=2)
        started = time.monotonic()
        writer.close()
        while not lost and time.monotonic() - started < 3:
            await asyncio.sleep(0.01)
        return lost, time.monotonic() - started

    lost, took = asyncio.run(scenario())
    assert [node for node, _ in lost] == ["n1"]
    assert "connection closed" in lost[0][1] and "refused" in lost[0][1], lost
    assert took < 1.0


def test_an_agent_that_died_alone_leaves_its_live_host_unwatched_not_lost():
    raylet = listening()

    async def scenario():
        lost: list = []
        w = watch(lost)
        await w.start("127.0.0.1")
        writer = await agent(w, "n1", raylet.getsockname()[1], beats=2)
        writer.close()
        await asyncio.sleep(0.8)
        return lost, w.describe()["hosts"]

    lost, hosts = asyncio.run(scenario())
    raylet.close()
    assert lost == [] and "n1" not in hosts


def test_a_raylet_that_ends_just_after_its_agent_is_still_seen_lost():
    """A crash ends the host's processes one by one: the agent's connection closes while its
    raylet still answers the first probe, and the raylet ends a moment later. The host stays
    watched (probed again once silent for suspect_s) and is declared lost - not handed to Ray's
    watch, whose verdict takes 12-65 s (failed in CI's real-host run before)."""
    raylet = listening()

    async def scenario():
        lost: list = []
        w = watch(lost)
        await w.start("127.0.0.1")
        writer = await agent(w, "n1", raylet.getsockname()[1], beats=2)
        writer.close()
        await asyncio.sleep(0.1)  # the close's probe: the raylet answers
        answered = w.alive_after_suspicion
        raylet.close()  # then the raylet ends too
        for _ in range(40):
            if lost:
                break
            await asyncio.sleep(0.05)
        await w.close()
        return answered, lost

    answered, lost = asyncio.run(scenario())
    assert answered == 1, "the first probe found the raylet alive"
    assert [node for node, _ in lost] == ["n1"], lost


def test_a_host_declared_lost_that_comes_back_is_not_watched_again():
    async def scenario():
        lost: list = []
        w = watch(lost, suspect_s=5.0)
        await w.start("127.0.0.1")
        port = closed_port()
        (await agent(w, "n1", port, beats=1)).close()
        while not lost:
            await asyncio.sleep(0.01)
        back = await agent(w, "n1", port, beats=0)
        await asyncio.sleep(0.2)
        return lost, w.describe()["hosts"], back

    lost, hosts, _ = asyncio.run(scenario())
    assert len(lost) == 1, "declared once"
    assert hosts["n1"]["lost"] is True, "the old record stays: the host is not watched again"


def test_a_malformed_hello_is_closed_without_a_record():
    async def scenario():
        w = watch([])
        address = await w.start("127.0.0.1")
        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"not json\n")
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5)
        return closed, w.describe()["hosts"]

    closed, hosts = asyncio.run(scenario())
    assert closed == b"" and hosts == {}


def test_the_probe_tells_accepted_from_refused():
    raylet = listening()
    alive = asyncio.run(probe_raylet(("127.0.0.1", raylet.getsockname()[1]), 1.0))
    gone = asyncio.run(probe_raylet(("127.0.0.1", closed_port()), 1.0))
    raylet.close()
    assert alive.alive and "accepted" in alive.evidence
    assert not gone.alive and "refused" in gone.evidence


def test_a_probe_answered_while_the_watch_waited_for_a_core_is_an_answer():
    """The coordinator runs at Ray's worker niceness (15): on a loaded node its event loop may
    get no core for longer than ``host_confirm_s`` (the loaded 8-host run declared 4 healthy
    hosts lost so, docs/benchmarks.md). A handshake the kernel completed meanwhile is an answer:
    the probe reads the kernel's verdict at its bound, not the loop's."""
    raylet = listening()
    port = raylet.getsockname()[1]

    async def scenario():
        probe = asyncio.ensure_future(probe_raylet(("127.0.0.1", port), 0.2))
        for _ in range(3):  # the probe's connect is sent
            await asyncio.sleep(0)
        time.sleep(0.6)  # then the loop gets no core until well past the bound
        return await probe

    try:
        verdicts = [asyncio.run(scenario()) for _ in range(5)]
    finally:
        raylet.close()
    assert all(v.alive for v in verdicts), [v.evidence for v in verdicts]


def test_a_suspicion_no_longer_than_the_heartbeat_is_refused():
    with pytest.raises(ConfigError, match=r"host_suspect_s = 0\.1 must be longer"):
        GracefulConfig(host_heartbeat_s=0.1, host_suspect_s=0.1)


def test_an_agent_whose_coordinator_is_slow_is_not_cut_off_and_one_gone_is_reconnected():
    """The agent's side of the same probe: a silent coordinator whose port accepts is slow (no
    cut-off); one whose port refuses is gone and restarting (raised: connect anew)."""
    from ray_graceful.node.heartbeat import cut_off_evidence

    coordinator = listening()
    assert cut_off_evidence(("127.0.0.1", coordinator.getsockname()[1]), 0.5, 0.6) is None
    coordinator.close()
    with pytest.raises(ConnectionRefusedError):
        cut_off_evidence(("127.0.0.1", closed_port()), 0.5, 0.6)


# --- only the job's own agents are heard -------------------------------------------------------


async def _send_hello(address, hello: dict) -> bytes:
    """One raw connection: ``hello`` as its first line; what the watch sent before it closed."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(json.dumps(hello).encode() + b"\n")
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def test_a_forged_hello_for_a_real_node_cannot_have_it_declared_lost():
    """Any process that can open a TCP connection: one line naming a real node id and a closed
    raylet port, then a close. It used to be probed at that port, refused, and the healthy host
    declared lost - every rank there ordered out without a save."""
    raylet = listening()  # the node's real raylet: alive

    async def scenario():
        lost: list = []
        w = watch(lost, suspect_s=5.0)
        address = await w.start("127.0.0.1")
        w.raylet_of["n1"] = raylet.getsockname()[1]
        forged = [
            {"node_id": "n1", "raylet_ip": "127.0.0.1", "raylet_port": closed_port()},
            {"node_id": "n1", "ticket": "0" * 64},
            {"node_id": "n1", "ticket": w.ticket("n2")},  # another node's ticket
        ]
        answers = [await _send_hello(address, hello) for hello in forged]
        await asyncio.sleep(0.3)  # a probe, had one started, refuses within milliseconds
        return lost, w.describe(), answers

    lost, described, answers = asyncio.run(scenario())
    raylet.close()
    assert lost == [] and described["hosts"] == {}, described
    assert described["refused"] == 3 and answers == [b""] * 3


def test_a_host_is_probed_at_the_raylet_ray_lists_never_one_a_sender_names():
    """A hello with a valid ticket that also names a closed port: the close is probed at the
    raylet Ray lists for the node (alive), so the host is not lost."""
    raylet = listening()

    async def scenario():
        lost: list = []
        w = watch(lost, suspect_s=5.0)
        address = await w.start("127.0.0.1")
        w.raylet_of["n1"] = raylet.getsockname()[1]
        hello = {"node_id": "n1", "ticket": w.ticket("n1"), "raylet_port": closed_port()}
        _, writer = await asyncio.open_connection(*address)
        writer.write(json.dumps(hello).encode() + b"\n")
        await writer.drain()
        while "n1" not in w.describe()["hosts"]:
            await asyncio.sleep(0.01)
        writer.close()
        while w.alive_after_suspicion == 0 and not lost:
            await asyncio.sleep(0.01)
        return lost, w.alive_after_suspicion

    lost, alive = asyncio.run(asyncio.wait_for(scenario(), 10))
    raylet.close()
    assert lost == [] and alive == 1


def test_a_second_connection_for_a_connected_node_is_refused_and_the_first_stands():
    """A second hello for a node whose agent's connection is open - even one with the ticket -
    is turned away: it cannot take the host's place, beat for a crashed host, or close it."""

    async def scenario():
        lost: list = []
        w = watch(lost, suspect_s=5.0)
        address = await w.start("127.0.0.1")
        first = await agent(w, "n1", closed_port(), beats=1)
        second = await _send_hello(address, {"node_id": "n1", "ticket": w.ticket("n1")})
        await asyncio.sleep(0.2)
        before = (list(lost), w.describe()["refused"])
        first.close()  # the real agent's process dies: its host is lost
        while not lost:
            await asyncio.sleep(0.01)
        return before, second, lost

    (lost_before, refused), second, lost = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert second == b"" and refused == 1
    assert lost_before == [], "the second connection's close is not the host's"
    assert [node for node, _ in lost] == ["n1"] and "refused" in lost[0][1]


def test_a_hello_for_a_node_ray_does_not_list_alive_is_refused():
    async def scenario():
        w = watch([])
        address = await w.start("127.0.0.1")
        answer = await _send_hello(address, {"node_id": "gone", "ticket": w.ticket("gone")})
        return answer, w.describe()

    answer, described = asyncio.run(scenario())
    assert answer == b"" and described["hosts"] == {} and described["refused"] == 1
