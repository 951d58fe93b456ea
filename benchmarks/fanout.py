"""``python -m benchmarks fanout``: a real coordinator and N simulated ranks, the fan-out timed.

Two ways for the ranks to reach the coordinator, measured in the same run:

- ``--ranks-per-node 0``: per rank, as without a node agent. Every simulated process registers
  (one ``Register`` each, on 8 simulated nodes) and holds its own long poll from a few poller
  actors, as N control threads would.
- ``--ranks-per-node K``: through node agents. N/K simulated nodes, each one ``NodeRelay`` - the
  node agent's own code (``node/relay.py``) - holding its node's one long poll, registering its
  K processes in one message and acknowledging together, over real Ray calls to the real
  coordinator, or past ``--group-size`` nodes to the real group agents the coordinator starts
  (``node/group.py``), exactly as a node agent asks for its way up (``TieredUpstream``).
  **Simulated:** the nodes are relay objects inside a few poller actors, not one actor per
  machine; each rank process is a coroutine calling its relay in-process, not a control thread
  one same-node Ray call away (about 1 ms more per order, not counted here). Packing nodes
  together has a cost no real agent pays: a poller holds the state of hundreds of nodes, and
  Python's cyclic collector rescanned all of it in every fan-out - 0.4-0.7 s a poller a cycle,
  measured at 16,384 ranks - where a real agent holds one node's. So each poller freezes what
  its registration built (``gc.freeze``): collections during the fan-out see what the fan-out
  allocates, as each real agent's would. **Real:** the coordinator actor, its cycle machine and
  fan-out, the group agent actors, every call to them.

Then one notice for each of the first 8 nodes: the time from the notice to the moment every
rank holds its order is what a real eviction costs before any rank can act. Also measured: the
time from every rank sending its teardown report (all at once, as real ranks do: through its
node's relay, or one call each per rank) to the cycle's outcome, the time to register every
rank, the coordinator's resident memory with every poll pending, and the calls a second it
serves while the job is idle (each rank, or each node, renews its poll every
``health_interval_s``). Each repetition is a full cycle: orders, a report from every rank, the
outcome, and everyone registered again for the next. Each simulated report is as long as a
real one (a record of each of the seven teardown phases, the rank it held; no shards saved):
the outcome carries every report, and its cost grows with them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from typing import Any

from ray_graceful.config import GracefulConfig
from ray_graceful.protocol import (
    Ack,
    PhaseRecord,
    PhaseStatus,
    PollKind,
    PollState,
    RankSpec,
    Register,
    Reply,
    ReportedRank,
    TeardownPhase,
    TeardownReport,
)

POLLERS = 4
NOTICED_NODES = 8


def _register_message(i: int, n: int, node: str, job_id: str) -> Register:
    return Register(f"p{i}", node, i, "bench", job_id, (RankSpec("g", i, n, str(i), True),))


class Poller:
    """Holds the long polls of many simulated ranks: their own, or their nodes' relays."""

    def __init__(
        self,
        handle: Any,
        ranks: dict[int, str],
        n: int,
        wait_s: float,
        per_node: int,
        group_size: int = 0,
    ) -> None:
        """``group_size``: group relays in this process (0: as the coordinator says)."""
        self.pid = os.getpid()
        self.handle, self.ranks, self.n, self.wait_s = handle, ranks, n, wait_s
        self.relays: dict[str, Any] = {}
        if per_node:
            from ray_graceful.node.group import GroupRelay
            from ray_graceful.node.relay import NodeRelay
            from ray_graceful.node.upstream import RayUpstream, TieredUpstream

            groups: dict[int, GroupRelay] = {}
            for node in sorted(set(ranks.values())):
                k = int(node.split("-")[1])
                if group_size and k >= group_size:  # in-process groups, placed as the
                    g = (k - group_size) // group_size  # coordinator places them
                    if g not in groups:
                        groups[g] = GroupRelay(f"group-{g}-bench", RayUpstream(handle), wait_s)
                    upstream: Any = groups[g]
                elif group_size:
                    upstream = RayUpstream(handle)
                else:  # each asks the coordinator its way up, as a node agent does
                    upstream = TieredUpstream(handle, node)
                self.relays[node] = NodeRelay(f"{node}-bench", upstream, wait_s)

    def process(self) -> int:
        return self.pid

    async def register(self, job_id: str) -> float:
        """Register every rank (per rank, or per node through its relay); seconds it took."""
        gc.unfreeze()  # the last cycle's simulated state may be garbage by now
        start = time.monotonic()

        async def one(i: int, node: str) -> None:
            message = _register_message(i, self.n, node, job_id)
            relay = self.relays.get(node)
            while True:  # as a control thread does: again while the refusal says to retry
                if relay is not None:
                    reply = await relay.register(message)
                else:
                    reply = await self.handle.register.remote(message)
                if reply.accepted:
                    return
                if not reply.retry:
                    raise RuntimeError(f"registration refused: {reply.reason}")
                await asyncio.sleep(0.5)

        await asyncio.gather(*(one(i, node) for i, node in self.ranks.items()))
        took = time.monotonic() - start
        gc.collect()  # the simulated nodes' state, built: out of the collector's way (above)
        gc.freeze()
        return took

    async def hold(self, cycle: int) -> list[float]:
        """Poll for every rank until it has its order; the time each order arrived."""

        async def one(i: int, node: str) -> float:
            relay, process_id = self.relays.get(node), f"p{i}"
            while True:
                if relay is not None:
                    answer = await relay.poll(process_id, cycle, PollState(), self.wait_s)
                else:
                    poll = self.handle.poll.remote(process_id, cycle, PollState(), self.wait_s)
                    answer = await poll
                if answer.kind == PollKind.ORDER:
                    arrived = time.time()
                    ack = Ack(process_id, cycle, answer.order.order_id)
                    await (relay.ack(ack) if relay else self.handle.ack.remote(ack))
                    return arrived
                if answer.kind != PollKind.IDLE:
                    raise RuntimeError(f"{process_id}: {answer.kind} {answer.reason}")

        return list(await asyncio.gather(*(one(i, node) for i, node in self.ranks.items())))

    async def report(self, cycle: int) -> int:
        """Every rank's teardown report, as real ranks send it: through its node's relay, or
        straight to the coordinator."""
        now = time.time()
        # as long as a real one: a record of each of the seven teardown phases, the rank held
        phases = [PhaseRecord(p, PhaseStatus.RAN, "bench", 0.0, 0.001) for p in TeardownPhase]

        async def one(i: int, node: str) -> Reply:
            ranks = [ReportedRank("g", i, self.n)]
            report = TeardownReport(0, "bench", "", "", ranks, "bench", cycle, now, now, phases)
            relay = self.relays.get(node)
            if relay is not None:
                return await relay.report(f"p{i}", report)
            return await self.handle.report_teardown.remote(f"p{i}", report)

        replies = await asyncio.gather(*(one(i, node) for i, node in self.ranks.items()))
        return sum(r.accepted for r in replies)


def _wait_pending(coordinator: Any, n: int, timeout: float) -> float:
    """Until every rank's poll is held open at the coordinator; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if coordinator.stats(timeout=120)["pending_polls"] >= n:
            return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"only some of {n} polls were pending after {timeout}s")


def _group_agent_pids(ray: Any, coordinator: Any, names: set[str]) -> list[int]:
    """The processes of the group agents the coordinator started (each node's place, asked
    again: it keeps it)."""
    places = ray.get([coordinator.handle.join_group.remote(name) for name in names], timeout=120)
    groups = {key: handle for key, handle in filter(None, places)}
    return [d["pid"] for d in ray.get([h.describe.remote() for h in groups.values()], timeout=60)]


def _fanout_once(
    ray: Any,
    coordinator: Any,
    pollers: list[Any],
    nodes: set[str],
    n: int,
    cycle: int,
    idle_window_s: float,
) -> dict:
    from ray_graceful.tools.bench.kit import cpu_seconds, resident_mb

    job_id = ray.get_runtime_context().get_job_id()
    registration_s = max(ray.get([p.register.remote(job_id) for p in pollers], timeout=900))
    held = [p.hold.remote(cycle) for p in pollers]
    _wait_pending(coordinator, n, timeout=600)
    stats = coordinator.stats(timeout=120)
    rss_mb = resident_mb(stats["pid"])
    calls_before, idle_start = stats["poll_calls"], time.monotonic()
    time.sleep(idle_window_s)  # idle: how often does the job renew its polls?
    idle = coordinator.stats(timeout=120)
    idle_rate = (idle["poll_calls"] - calls_before) / (time.monotonic() - idle_start)
    poller_pids = ray.get([p.process.remote() for p in pollers], timeout=60)
    group_pids = _group_agent_pids(ray, coordinator, nodes)
    cpu_before = [cpu_seconds(pid) for pid in (stats["pid"], *poller_pids, *group_pids)]
    t0 = time.time()
    for node in range(NOTICED_NODES):
        reply = coordinator.notify(
            node_id=f"node-{node}", reason="bench", deadline=t0 + 120, source="cli", timeout=120
        )
        if not reply.accepted:
            raise RuntimeError(f"notice refused: {reply.reason}")
    arrivals = [t for times in ray.get(held, timeout=600) for t in times]
    latest = max(arrivals) - t0
    pids = (stats["pid"], *poller_pids, *group_pids)
    cpu = [cpu_seconds(pid) - b for pid, b in zip(pids, cpu_before, strict=True)]
    polled = len(poller_pids)
    calls_before, coordinator_cpu = stats["report_calls"], cpu_seconds(stats["pid"])
    reports_start = time.monotonic()
    reported = sum(ray.get([p.report.remote(cycle) for p in pollers], timeout=600))
    outcome = coordinator.wait_outcome(timeout=300, cycle=cycle)
    reports_s = time.monotonic() - reports_start
    report_calls = coordinator.stats(timeout=120)["report_calls"] - calls_before
    return {
        "registration_s": registration_s,
        "all_ordered_s": latest,
        "first_rank_s": min(arrivals) - t0,
        "median_rank_s": sorted(a - t0 for a in arrivals)[len(arrivals) // 2],
        "rss_mb": rss_mb,
        "idle_calls_per_s": idle_rate,
        # CPU seconds spent while the orders went out (all threads; the pollers measured when
        # every rank had its order, the coordinator at the same moment)
        "coordinator_cpu_s": cpu[0],
        "pollers_cpu_s": sum(cpu[1 : 1 + polled]),
        "group_agents": len(group_pids),
        "group_agents_cpu_s": sum(cpu[1 + polled :]),
        "reported": reported,
        "reports_to_outcome_s": reports_s,
        # what the reports cost the coordinator: its CPU from the first report sent to the
        # outcome, and the calls they came in (gathered by the relays)
        "reports_coordinator_cpu_s": cpu_seconds(stats["pid"]) - coordinator_cpu,
        "report_calls": report_calls,
        "result": outcome.result if outcome else None,
    }


def _one_size(
    ray: Any, args: argparse.Namespace, n: int, per_node: int, group_size: int
) -> list[dict]:
    from ray_graceful.coordinator import Coordinator

    in_process = group_size if args.groups == "in-process" else 0
    config = GracefulConfig(
        coordinator_name=f"fanout-{n}-{per_node}-{group_size}-{os.getpid()}",
        node_group_size=0 if in_process else group_size,
        report_dir=os.path.join(os.path.abspath("bench-output"), "fanout-reports"),
        health_interval_s=args.health_interval,
        notice_gather_s=0.0,
        teardown_timeout_s=60.0,
    )
    coordinator = Coordinator.start(config)
    # rank i on node i // per_node (per rank: on node i % 8, as before); nodes split by poller
    node_of = {
        i: f"node-{i // per_node}" if per_node else f"node-{i % NOTICED_NODES}" for i in range(n)
    }
    nodes = sorted(set(node_of.values()), key=lambda name: int(name.split("-")[1]))
    # a group's nodes live in one poller (in-process groups), else nodes round-robin
    block = in_process or 1
    poller_of = {node: (max(k - in_process, -1) // block) % POLLERS for k, node in enumerate(nodes)}
    poller = ray.remote(Poller).options(num_cpus=0, max_concurrency=1000)
    pollers = [
        poller.remote(
            coordinator.handle,
            {i: node for i, node in node_of.items() if poller_of[node] == k},
            n,
            args.health_interval,
            per_node,
            in_process,
        )
        for k in range(POLLERS)
    ]
    runs = []
    try:
        for rep in range(args.reps):
            # a window of one renewal interval and a second: every poll renews once in it
            window = args.health_interval + 1.0
            runs.append(_fanout_once(ray, coordinator, pollers, set(nodes), n, rep, window))
            how = f"ranks/node={per_node or '-'} group={group_size}"
            print(f"  n={n} {how} rep {rep}: {runs[-1]}", flush=True)
    finally:
        for p in pollers:
            ray.kill(p)
        coordinator.shutdown()
    return runs


def bench_fanout(args: argparse.Namespace) -> dict[str, Any]:
    from ray_graceful.tools.bench.kit import local_cluster, markdown_table, percentile

    rows, results = [], []
    with local_cluster(head_cpus=4) as _cluster:
        import ray

        ways = [(0, 0)] if 0 in args.ranks_per_node else []
        ways += [(k, g) for k in args.ranks_per_node if k for g in args.group_size]
        for per_node, group_size in ways:
            for n in args.sizes:
                runs = _one_size(ray, args, n, per_node, group_size)
                results.append(
                    {"n": n, "ranks_per_node": per_node, "group_size": group_size, "runs": runs}
                )
                rss = [r["rss_mb"] for r in runs]
                rows.append(
                    [
                        _way(per_node, group_size, args.groups),
                        n,
                        percentile([r["registration_s"] for r in runs], 0.5),
                        percentile([r["first_rank_s"] for r in runs], 0.5),
                        percentile([r["all_ordered_s"] for r in runs], 0.5),
                        percentile([r["all_ordered_s"] for r in runs], 0.9),
                        percentile([r["median_rank_s"] for r in runs], 0.5),
                        max(rss),
                        (rss[-1] - rss[0]) / max(len(rss) - 1, 1),
                        percentile([r["idle_calls_per_s"] for r in runs], 0.5),
                        percentile([r["coordinator_cpu_s"] for r in runs], 0.5),
                        percentile([r["pollers_cpu_s"] for r in runs], 0.5),
                        runs[-1]["group_agents"],
                        percentile([r["group_agents_cpu_s"] for r in runs], 0.5),
                        percentile([r["reports_to_outcome_s"] for r in runs], 0.5),
                        percentile([r["reports_coordinator_cpu_s"] for r in runs], 0.5),
                        percentile([r["report_calls"] for r in runs], 0.5),
                    ]
                )
    table = markdown_table(
        [
            "ranks reach the coordinator",
            "ranks",
            "registration p50 s",
            "first rank ordered p50 s",
            "all ordered p50 s",
            "p90 s",
            "median rank s",
            "coordinator RSS MB",
            "RSS MB/cycle",
            "idle calls/s",
            "coordinator CPU s",
            "simulated nodes' CPU s",
            "group agents",
            "group agents' CPU s",
            "every report to the outcome p50 s",
            "its coordinator CPU s",
            "report calls",
        ],
        rows,
    )
    return {"results": results, "table": table}


def _way(per_node: int, group_size: int, where: str) -> str:
    if per_node == 0:
        return "per rank"
    if not group_size:
        return f"agents, {per_node}/node, no groups"
    return f"agents, {per_node}/node, groups of {group_size} ({where})"


def add_fanout_parser(names: Any) -> Any:
    """``python -m benchmarks fanout``'s options."""
    from ray_graceful.tools.arguments import positive_int, positive_ints, positive_seconds

    fanout = names.add_parser("fanout", help="notice to every rank ordered, N simulated ranks")
    fanout.add_argument(
        "--sizes",
        type=positive_ints,
        default="1024,4096,16384",
        help="ranks (default 1024,4096,16384)",
    )
    fanout.add_argument("--reps", type=positive_int, default=5, help="repetitions (default 5)")
    fanout.add_argument(
        "--ranks-per-node",
        type=_counts,
        default="0,8",
        help="ranks per simulated node agent, comma-separated; 0: every rank polls the "
        "coordinator itself (default 0,8: both, in the same run)",
    )
    fanout.add_argument(
        "--group-size",
        type=_counts,
        default="64",
        help="node_group_size, comma-separated: nodes the coordinator answers itself, and per "
        "group agent past that; 0: no group agents (default 64, the config's default)",
    )
    fanout.add_argument(
        "--groups",
        choices=("actors", "in-process"),
        default="actors",
        help="the group agents: real actors the coordinator starts (default), or group relays "
        "inside the poller actors, like the simulated nodes (the node-to-group hop is then "
        "in-process: what the coordinator's side of a tree costs, without 2 cores shared by "
        "every group's process)",
    )
    fanout.add_argument(
        "--health-interval",
        type=positive_seconds,
        default=5.0,
        help="each rank's (or node's) poll renewal interval (default 5, the config's default)",
    )
    return fanout


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 or v > 4096 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}: comma-separated ranks per node, each 0 (per rank) to 4096"
        )
    return values
