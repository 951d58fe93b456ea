"""``python -m benchmarks replies``: what one coordinator reply to a node agent costs in Ray.

The fan-out through node agents answers one held poll per node. This isolates that reply: an
async actor (as the coordinator is) holds ``--nodes`` polls from 4 poller actors and answers
them all at once; the time runs from the answers to the last poller holding its reply. The
payload is, in turn:

- ``none``: nothing - Ray's own cost of a reply;
- ``objects``: a node's reply of 8 ``PollAnswer``s with their ``TeardownOrder``s, returned as
  objects (Ray serializes them with cloudpickle, which calls back into Python per object);
- ``packed``: the same reply packed by ``protocol/wire.py`` (pickle's C path) and unpacked by
  the poller, as the coordinator and the node agent do.

Nothing is simulated but the coordinator's other work: real actors, real Ray calls.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

MODES = ("none", "objects", "packed")


def _node_reply(node: int) -> dict[str, Any]:
    from ray_graceful.protocol import PollAnswer, PollKind, SaveAssignment, TeardownOrder

    def order(i: int) -> TeardownOrder:
        save = SaveAssignment("g", i, f"g/{i}", "/ckpt", keepers=("keeper-a", "keeper-b"))
        return TeardownOrder("job", 0, f"x-{i}", 1e9, "cli: bench (node-1)", (save,), "", 10.0)

    return {f"p{node * 8 + i}": PollAnswer(PollKind.ORDER, order(node * 8 + i)) for i in range(8)}


class Answerer:
    """Holds polls and answers them all at once, as the coordinator's fan-out does."""

    def __init__(self) -> None:
        self.held: list[tuple[int, asyncio.Future]] = []

    async def poll(self, node: int) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.held.append((node, future))
        return await future

    def pending(self) -> int:
        return len(self.held)

    def answer_all(self, mode: str) -> float:
        from ray_graceful.protocol import wire

        started = time.time()
        for node, future in self.held:
            reply = None if mode == "none" else _node_reply(node)
            future.set_result(wire.pack(reply) if mode == "packed" else reply)
        self.held = []
        return started


class Asker:
    """Holds many nodes' polls, as the fan-out benchmark's pollers do."""

    def __init__(self, answerer: Any) -> None:
        self.answerer = answerer

    async def hold(self, nodes: list[int], mode: str) -> list[float]:
        from ray_graceful.protocol import wire

        async def one(node: int) -> float:
            reply = await self.answerer.poll.remote(node)
            if mode == "packed":
                wire.unpack(reply, dict, "poll")
            return time.time()

        return list(await asyncio.gather(*(one(n) for n in nodes)))


def bench_replies(args: argparse.Namespace) -> dict[str, Any]:
    from ray_graceful.tools.bench.kit import local_cluster, markdown_table, percentile

    rows, results = [], []
    with local_cluster(head_cpus=4) as _cluster:
        import ray

        answerer = ray.remote(Answerer).options(num_cpus=0, max_concurrency=1 << 14).remote()
        askers = [
            ray.remote(Asker).options(num_cpus=0, max_concurrency=1 << 12).remote(answerer)
            for _ in range(4)
        ]
        for mode in MODES:
            times = []
            for _ in range(args.reps):
                held = [
                    a.hold.remote(list(range(k, args.nodes, 4)), mode) for k, a in enumerate(askers)
                ]
                while ray.get(answerer.pending.remote(), timeout=60) < args.nodes:
                    time.sleep(0.05)
                started = ray.get(answerer.answer_all.remote(mode), timeout=120)
                times.append(max(t for got in ray.get(held, timeout=300) for t in got) - started)
            results.append({"mode": mode, "nodes": args.nodes, "seconds": times})
            p50 = percentile(times, 0.5)
            rows.append([mode, args.nodes, p50, max(times), p50 / args.nodes * 1000])
            print(f"  {mode}: {times}", flush=True)
    header = ["reply", "nodes", "all received p50 s", "max s", "ms per reply"]
    return {"results": results, "table": markdown_table(header, rows)}


def add_replies_parser(names: Any) -> Any:
    """``python -m benchmarks replies``'s options."""
    from ray_graceful.tools.arguments import positive_int

    replies = names.add_parser("replies", help="one coordinator reply to a node agent, in Ray")
    replies.add_argument("--nodes", type=positive_int, default=2048, help="held polls (2048)")
    replies.add_argument("--reps", type=positive_int, default=3, help="repetitions (default 3)")
    return replies
