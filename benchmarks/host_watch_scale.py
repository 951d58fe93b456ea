"""``python -m benchmarks host-watch-scale``: what the host watch costs the coordinator.

One real ``HostWatch`` (``coordinator/host_watch.py``) on an event loop of its own, in a
process of its own as the coordinator's actor would hold it, and ``--agents`` heartbeat
connections into it: each says hello with its node's ticket and writes a byte every
``host_heartbeat_s`` (0.1 s), as a node agent does (``node/heartbeat.py``); the watch beats back
on each. Over ``--seconds`` once every agent is connected, the watch process's CPU time (user +
system, of one core) and its resident memory are read from ``/proc``, and the hosts it
suspected, probed and declared lost are counted - with every agent beating, none should be.

Simulated, and said so in the table: the agents are asyncio connections in one other process,
not node agents on hosts; the watch's secret is the benchmark's (so that process can make the
tickets Ray would hand out); every suspected host's raylet is one listener that accepts, in the
benchmark's own process (a probe that gets no answer in ``host_confirm_s`` then means the
watch's own event loop was too late for it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import multiprocessing
import os
import socket
import threading
import time
from typing import Any

SECRET = b"host-watch-scale-benchmark-secret"
HEARTBEAT_S = 0.1


def add_host_watch_scale_parser(names: Any) -> Any:
    """``python -m benchmarks host-watch-scale``'s options."""
    from ray_graceful.tools.arguments import positive_ints, positive_seconds

    parser = names.add_parser(
        "host-watch-scale", help="the host watch's CPU and memory under N agents' heartbeats"
    )
    parser.add_argument(
        "--agents", type=positive_ints, default="1000,10000",
        help="agents per run, comma-separated (default 1000,10000)",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=positive_seconds, default=30.0, help="measured window (default 30)"
    )
    return parser


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _raylet() -> tuple[str, int]:
    """A stand-in for every host's raylet, in this (the benchmark's) process: a listening
    socket that accepts and closes, on a thread - never on the watch's event loop."""
    server = socket.create_server(("127.0.0.1", 0), backlog=4096)

    def serve() -> None:
        while True:
            connection, _ = server.accept()
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    return ("127.0.0.1", server.getsockname()[1])


def _watch(raylet_at: tuple[str, int], port_out: Any, report: Any, stop: Any, counts: Any) -> None:
    """The watch's process: a real HostWatch on its own event loop, as the actor holds it."""
    from ray_graceful.coordinator.host_watch import HostWatch

    async def main() -> None:
        lost: list[str] = []
        watch = HostWatch(HEARTBEAT_S, 0.5, 0.5, lambda node, why: lost.append(node),
                          lambda node: raylet_at)  # fmt: skip
        watch._secret = SECRET  # the benchmark's, so the agents' process can make tickets
        address = await watch.start("127.0.0.1")
        port_out.send(address[1])
        while not report.is_set():  # counted while every agent still beats
            await asyncio.sleep(0.2)
        counts.send(
            {"hosts": len(watch.hosts), "lost": len(lost), "refused": watch.refused,
             "alive_after_suspicion": watch.alive_after_suspicion}
        )  # fmt: skip
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await watch.close()

    asyncio.run(main())


def _agents(port: int, n: int, ready: Any, stop: Any, sent: Any) -> None:
    """``n`` agents' heartbeats from one process: hello, then a byte every HEARTBEAT_S each."""

    async def one(node: str, writers: list) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        ticket = hmac.new(SECRET, node.encode(), hashlib.sha256).hexdigest()
        writer.write(json.dumps({"node_id": node, "ticket": ticket}).encode() + b"\n")
        writers.append((reader, writer))

    async def main() -> None:
        writers: list = []
        for start in range(0, n, 500):  # connect in batches: the listen backlog is finite
            batch = range(start, min(n, start + 500))
            await asyncio.gather(*(one(f"node-{i:06d}", writers) for i in batch))
        ready.set()
        beats = 0
        next_at = time.monotonic()
        while not stop.is_set():
            for reader, writer in writers:
                writer.write(b".")
                if reader._buffer:  # the watch's beats back: drained, as an agent reads them
                    reader._buffer.clear()
            beats += 1
            next_at += HEARTBEAT_S
            await asyncio.sleep(max(next_at - time.monotonic(), 0.0))
        sent.send(beats)

    asyncio.run(main())


def _one_run(n: int, seconds: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    port_in, port_out = ctx.Pipe(duplex=False)
    counts_in, counts_out = ctx.Pipe(duplex=False)
    sent_in, sent_out = ctx.Pipe(duplex=False)
    stop, ready, report = ctx.Event(), ctx.Event(), ctx.Event()
    raylet = _raylet()
    watch = ctx.Process(
        target=_watch, args=(raylet, port_out, report, stop, counts_out), daemon=True
    )
    watch.start()
    port = port_in.recv()
    agents = ctx.Process(target=_agents, args=(port, n, ready, stop, sent_out), daemon=True)
    agents.start()
    if not ready.wait(300):
        raise RuntimeError(f"{n} agents did not connect within 300 s")
    time.sleep(2.0)  # past the hellos and the raylet lookups
    cpu0, wall0 = _cpu_s(watch.pid), time.monotonic()
    time.sleep(seconds)
    cpu1, wall1 = _cpu_s(watch.pid), time.monotonic()
    rss = _rss_mb(watch.pid)
    report.set()
    counts = counts_in.recv()
    stop.set()
    beats = sent_in.recv()
    for process in (agents, watch):
        process.join(30)
    return {
        "agents": n,
        "seconds": round(wall1 - wall0, 2),
        "watch_cpu_percent_of_one_core": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 2),
        "watch_rss_mb": round(rss, 1),
        "heartbeat_rounds_sent": beats,
        **counts,
    }


def bench_host_watch_scale(args: argparse.Namespace) -> dict[str, Any]:
    from ray_graceful.tools.bench.kit import markdown_table

    runs = []
    for n in args.agents:
        print(f"  {n} agents, {args.seconds:g} s ...", flush=True)
        runs.append(_one_run(n, args.seconds))
    table = markdown_table(
        ["agents", "watch CPU % of one core", "watch RSS MB", "hosts watched", "suspected, then "
         "answered", "declared lost", "refused", "heartbeat rounds sent (10/s due)"],
        [[r["agents"], r["watch_cpu_percent_of_one_core"], r["watch_rss_mb"], r["hosts"],
          r["alive_after_suspicion"], r["lost"], r["refused"], r["heartbeat_rounds_sent"]]
         for r in runs],
    )  # fmt: skip
    table += (
        f"\nsimulated agents: asyncio connections in one process on this {os.cpu_count()}-core "
        "machine (a heartbeat every 0.1 s each, hello with a ticket); the watch is the real "
        "HostWatch in a process of its own; every raylet is one listener that accepts, in another "
        "process (a host declared lost: a probe the watch's own loop answered too late)"
    )
    return {"results": runs, "table": table}
