"""``ray-graceful demo``: an eviction handled end to end, on a local multi-node Ray cluster.

Six CPU ranks (gloo) on three worker nodes hold three shards, two replicas each::

    node A: ranks 0, 1 (shards 0, 2)    node B: ranks 2, 3 (shards 0, 1)
    node C: ranks 4, 5 (shards 1, 2)

Mid-training, node A's GPU reports XID 79 through the scripted health probe and, while the
coordinator gathers the notices that belong together, Ray drains node B with a deadline (a
spot reclaim). The coordinator plans both at once - A's ranks never save,
B saves what only it can still save in time, C saves the rest - releases every rank from its
collective and commits the checkpoint. With the memory tier on (the default here), each saver
hands its shard to the keeper of a node that survives (C, or the head), the checkpoint commits
in their memory, and the durable copy lands in the checkpoint directory in the background.

Then the group comes back **warm**: ranks 4 and 5 on node C keep their processes, four spares
started ahead of time on C and the head take ranks 0-3 (each evicted shard's copy already
waits in the keeper on its spare's node), and the group is re-formed in place at the committed
step - no new processes, no new group. The outcome JSON and a timeline PNG land in
``--output``.

``--host-loss`` plays the other ending: node B **crashes** without a word. Every process of it
- its raylet, its ranks, its node agent - is SIGKILLed at once; no drain, no SIGTERM, no notice.
The host watch (``host_watch=True``) hears B's heartbeats stop and finds its raylet's port
refused, and declares the host lost (``host_lost``) in about a second - Ray's own verdict
comes some 15 s later. Shards 0 and 1 are committed from their replicas on A and C, and two
spares take ranks 2 and 3.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from ..checkpoint import latest_committed
from ..config import GracefulConfig
from ..worker.mixin import GracefulWorkerMixin
from ..worker.process_groups import free_port
from .timeline import WayBack, timeline_png, way_back_json

PLACEMENT = ["A", "A", "B", "B", "C", "C"]
SPARES = ["C", "H", "C", "H"]  # started ahead on nodes that get no notice
SCENES = ("drain", "host-loss")
SHARDS = ["0", "2", "0", "1", "1", "2"]
STEP_S = 0.25


class DemoWorker(GracefulWorkerMixin):
    """A hand-built worker as a user writes one: the mixin, and one call after init."""

    def __init__(self) -> None:
        import torch

        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 16)
        self.step = 0

    def start(
        self,
        rank: int,
        world: int,
        port: int,
        shard: str,
        config: GracefulConfig,
    ) -> str:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
        status = self.graceful_setup(
            "demo",
            shard=shard,
            config=config,
            state_dict=self._state,
            load_state_dict=self._load,  # what a warm restart loads into, where it must
        )
        return str(status)

    def rejoin(self, config: GracefulConfig) -> Any:
        """The warm restart, for survivors and spares alike: one call."""
        joined = self.graceful_rejoin(
            state_dict=self._state, load_state_dict=self._load, config=config
        )
        self.step = joined.step if joined.joined else self.step
        return joined

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])

    def train(self, steps: int) -> int:
        import torch
        import torch.distributed as dist

        for _ in range(steps):
            grads = [torch.ones_like(p) for p in self.model.parameters()]
            try:
                for g in grads:
                    dist.all_reduce(g)  # the collective a rank can be stuck in
            except RuntimeError:  # a peer's host crashed: the group is broken, the step undone
                break
            with torch.no_grad():
                for p, g in zip(self.model.parameters(), grads, strict=True):
                    p.sub_(0.001 * g)
            self.step += 1
            if self.should_stop(self.step):
                break
            time.sleep(STEP_S)
        return self.step

    def pid(self) -> int:
        return os.getpid()


class _Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.1f}s] {text}", flush=True)


def _start_group(
    ray: Any, config: GracefulConfig, placement: list[str]
) -> tuple[list[Any], list[str]]:
    port = free_port()
    worker = ray.remote(DemoWorker)
    ranks = [
        worker.options(num_cpus=0, resources={f"demo_{node}": 1}).remote() for node in placement
    ]
    statuses = ray.get(
        [r.start.remote(i, len(ranks), port, SHARDS[i], config) for i, r in enumerate(ranks)],
        timeout=180,
    )
    return ranks, statuses


def run_demo(
    output: str = "demo-output", steps_before: int = 6, cluster: Any = None, scene: str = "drain"
) -> int:
    """Run the demo on a private local cluster, or on nodes added to ``cluster`` (the tests').

    ``scene``: ``"drain"`` (node B drained, node A faulty) or ``"host-loss"`` (node B crashes
    without a notice); see the module docstring.
    """
    if scene not in SCENES:
        raise ValueError(f"scene {scene!r} is not allowed: one of {', '.join(SCENES)}")
    host_loss = scene == "host-loss"
    os.makedirs(output, exist_ok=True)
    # What the run makes - checkpoints, reports - under the output, one run's at a time (a
    # previous run's committed step must not be taken for this one's); Ray's own files in a
    # temp dir of the run's, removed at the end (a socket path must stay short).
    work = os.path.join(os.path.abspath(output), "run")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    ray_dir = tempfile.mkdtemp(prefix="ray-graceful-demo-")
    own_cluster = cluster is None
    if own_cluster:
        os.environ["RAY_TMPDIR"] = ray_dir  # a private cluster: nothing shared with other users
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray
    from ray.cluster_utils import Cluster

    from ..coordinator import Coordinator
    from ..outcome import TerminationOutcome

    clock = _Clock()
    checkpoints = os.path.join(work, "checkpoints")
    config = GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        checkpoint_dir=checkpoints,
        health_probe="scripted",
        health_script_path=os.path.join(work, "faults.json"),
        health_interval_s=0.5,
        notice_gather_s=0.8,
        expected_save_s=2.0,
        teardown_timeout_s=20.0,
        save_budget_s=10.0,
        coordinator_name=f"demo-{os.getpid()}",
        memory_replicas=1,
        memory_budget_mb=64,
        warm_restart=True,
        rejoin_timeout_s=60.0,
        host_watch=host_loss,  # heartbeats from the node agents; a silent host's raylet probed
    )
    if own_cluster:
        clock.say("starting a local Ray cluster: a head node and worker nodes A, B, C")
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "include_dashboard": False,
                "resources": {"demo_H": 100},
            },
        )
        added = "ABC"
    else:
        clock.say("adding nodes A, B, C and H to the running Ray cluster")
        added = "ABCH"
    nodes = {name: cluster.add_node(num_cpus=2, resources={f"demo_{name}": 100}) for name in added}
    cluster.wait_for_nodes()
    if own_cluster:
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    coordinator = None
    crashed_at = 0.0
    try:
        coordinator = Coordinator.start(config)
        clock.say("coordinator started; 6 ranks: 3 shards x 2 replicas, gloo on CPU")
        ranks, statuses = _start_group(ray, config, PLACEMENT)
        print("    " + statuses[0].replace("\n", "\n    "))
        from ..warm_group import WarmGroup

        spares = [
            ray.remote(DemoWorker).options(num_cpus=0, resources={f"demo_{n}": 1}).remote()
            for n in SPARES
        ]
        group = WarmGroup(coordinator, ranks, spares=spares, method="rejoin", args=(config,))
        clock.say("4 spares wait on nodes C and the head (started ahead, imports done)")
        training = [r.train.remote(10_000) for r in ranks]
        _wait_steps(coordinator, steps_before, clock)

        if host_loss:
            _wait_for(lambda: len(coordinator.status()["host_watch"]["hosts"]) >= 3, 30)
            clock.say("the host watch hears heartbeats from nodes A, B and C")
            killed = _crash(nodes["B"])
            crashed_at = time.time()
            clock.say(
                f"CRASH     node B: its {killed} processes SIGKILLed at once - raylet, ranks 2 "
                "and 3, its node agent; no drain, no SIGTERM, no notice"
            )
        else:
            _fault_a_and_drain_b(coordinator, nodes, config, clock)

        def current_or_concluded_plan() -> str | None:
            status = coordinator.status()  # the cycle may be over already: it is that fast
            return status["plan_table"] or (status["last_outcome"] or {}).get("plan_table")

        plan = _wait_for(current_or_concluded_plan, 30)
        clock.say("PLAN")
        print("    " + plan.replace("\n", "\n    "))
        outcome = coordinator.wait_outcome(timeout=60, cycle=0)
        if outcome is None:
            clock.say("no outcome within 60s: see the worker logs")
            return 1
        if host_loss:
            notice = min(outcome.notices, key=lambda n: n["received_at"])
            clock.say(
                f"DETECTED  {notice['source']} +{notice['received_at'] - crashed_at:.2f}s after "
                f"the crash: {notice['reason']}"
            )
        _show_teardown(outcome, clock)
        ray.wait(training, num_returns=len(training), timeout=10)

        if outcome.result not in ("committed", "held"):
            clock.say(f"no committed checkpoint: {outcome.reason}")
            return 1
        names = {node.node_id: name for name, node in nodes.items()}
        names[ray.get_runtime_context().get_node_id()] = "head"
        clock.say(_checkpoint_line(outcome, names))
        last_steps = [int(r["last_step"]) for r in outcome.reports if r.get("last_step")]
        step = int((outcome.committed or {})["step"])  # committed or held: a step, above
        lost = max(last_steps) - step if last_steps else 0

        clock.say(
            "WARM      ranks 0, 1, 4 and 5 on nodes A and C keep their processes; spares take "
            "ranks 2 and 3"
            if host_loss
            else "WARM      ranks 4 and 5 on node C keep their processes; the spares take ranks 0-3"
        )
        restart = group.restart(timeout=60)
        after = {m.rank: names.get(m.node_id, m.node_id[:8]) for m in restart.members}
        for member in restart.members:
            where = names.get(member.node_id, member.node_id[:8])
            print(
                f"    rank {member.rank} ({where}, pid {member.pid}): {member.was}, shard "
                f"{SHARDS[member.rank]}, loaded from {member.loaded_from}"
            )
        record = coordinator.wait_rejoined(outcome.cycle + 1, timeout=30) or {}
        ray.get([r.train.remote(1) for r in group.workers], timeout=120)
        first_step_at = time.time()  # every rank of the new group has taken its first step
        steps = ray.get([r.train.remote(1) for r in group.workers], timeout=120)
        first = min(n["received_at"] for n in outcome.notices)
        resumed = (
            f"resumed at step {restart.step} in the same group, re-formed in place: training "
            f"again +{first_step_at - first:.1f}s after the first notice"
            + (f" (+{first_step_at - crashed_at:.1f}s after the crash)" if host_loss else "")
            + f", trained to step {steps[0]}: {lost} step(s) lost"
        )

        # The durable copy starts once every member rejoined: the keepers served them first.
        durable = coordinator.wait_durable(0, timeout=60) or {}
        committed = latest_committed(checkpoints, verify_checksums=True)
        in_keepers = ((coordinator.durability(0) or {}).get("at") or {}).get("in-keepers")
        # What happened, in the order it happened: a held step may reach the keepers before or
        # after the group's first step.
        said = [(first_step_at, resumed)]
        if in_keepers is not None:
            when = "behind the training" if in_keepers > first_step_at else "before the first step"
            said.append((in_keepers, f"IN KEEPERS the survivors' snapshots reached the keepers "
                                     f"{when}: committed in memory +{in_keepers - first:.1f}s "
                                     "after the first notice"))  # fmt: skip
        for _, text in sorted(said):
            clock.say(text)
        if committed is None or "at" not in durable:
            clock.say(f"the durable copy did not land: {durable}")
            return 1
        clock.say(
            f"DURABLE   the keepers wrote it to disk in the background, "
            f"+{durable['at'] - first:.1f}s after the first notice; manifest last "
            f"({committed.path})"
        )
        coordinator.job_finished(success=True)  # the group is ended on purpose: no eviction
        for r in group.workers:
            ray.kill(r)

        # The outcome as it stands now: a held step's is written again as the step moves on
        # (its disk copy's end reaches the coordinator just after the keepers say so).
        until = time.monotonic() + 10
        while outcome.result == "held" and time.monotonic() < until:
            if (coordinator.durability(outcome.cycle) or {}).get("stage") == "on-disk":
                break
            time.sleep(0.05)
        outcome = coordinator.wait_outcome(timeout=30, cycle=outcome.cycle) or outcome
        path = os.path.join(output, "outcome.json")
        with open(path, "w") as f:
            json.dump(outcome.to_dict(), f, indent=2, sort_keys=True)
        way_back = WayBack(record, first_step_at, durable["at"], in_keepers)
        t0 = min(n["received_at"] for n in outcome.notices)
        with open(os.path.join(output, "timeline.json"), "w") as f:
            json.dump(way_back_json(way_back, t0, PLACEMENT, after), f, indent=2)
        picture = os.path.join(output, "timeline.png")
        png = timeline_png(outcome, picture, PLACEMENT, way_back, after)
        print()
        print("SUMMARY")
        print(
            "  eviction:   node B crashed without a notice, declared lost by the host watch"
            if host_loss
            else "  eviction:   node B drained with a 12 s deadline; node A FAULTY (XID 79)"
        )
        print(f"  plan:       {outcome.plan_table.splitlines()[-1]}")
        leaving = [r for r in outcome.reports if r.get("exit_path")]
        reported = {rank["rank"] for r in outcome.reports for rank in r["ranks"]}
        lost_ranks = sorted(set(range(len(PLACEMENT))) - reported)
        print(
            f"  teardown:   {len(outcome.reports)} ranks released, "
            f"{outcome.timings.get('last_report', 0):.2f}s after the first notice; "
            + (
                f"{len(lost_ranks)} ranks lost with their host ({lost_ranks}); "
                if host_loss
                else "exit status 0 via Ray's intended exit: "
                f"{sum(r['exit_path'] == 'ray_intended' for r in leaving)}/{len(leaving)} leaving; "
            )
            + f"{len(outcome.reports) - len(leaving)} survivors kept their processes"
        )
        spares_joined = sum(m.was.startswith("spare") for m in restart.members)
        behind = in_keepers is not None and in_keepers > first_step_at
        how = (
            "held by the survivors, trained on at once, committed in the keepers "
            + ("behind the training" if behind else "before the first step")
            + ", durable on disk behind the training"
            if outcome.result == "held"
            else "committed in the memory of the surviving nodes, durable in the background"
        )
        print(
            f"  checkpoint: step {committed.step} {how}; resumed there, {lost} lost, by a warm "
            f"restart ({len(restart.members) - spares_joined} survivors, {spares_joined} spares)"
        )
        print(f"  wrote:      {path}" + (f", {png}" if png else ""))
        print(f"  outcome:    {TerminationOutcome.from_dict(outcome.to_dict()).summary()}")
        return 0
    finally:
        if own_cluster:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
        else:
            shutil.rmtree(ray_dir, ignore_errors=True)
            if coordinator is not None:
                coordinator.shutdown()
            for node in nodes.values():
                cluster.remove_node(node)
            if crashed_at:  # the cluster lives on: nothing may be placed on the crashed node
                _until_ray_declares_dead(nodes["B"].node_id, clock)


def _fault_a_and_drain_b(
    coordinator: Any, nodes: dict[str, Any], config: GracefulConfig, clock: _Clock
) -> None:
    """The default scene's eviction: node A reports XID 79; while the coordinator gathers (a
    health verdict keeps the gathering window open), Ray drains node B with a deadline. A
    drain on its own is planned at once (docs/concepts.md); one in the same window as a fault
    is planned with it."""
    from ..health.scripted import write_faults
    from ..ray_adapter import drain_node

    assert config.health_script_path is not None  # the demo's own config sets it
    write_faults(
        config.health_script_path,
        [
            {
                "node": nodes["A"].node_id,
                "gpu": None,
                "verdict": "FAULTY",
                "code": "xid_79",
                "detail": "XID 79: GPU has fallen off the bus (injected)",
            }
        ],
    )
    clock.say("FAULT     node A: XID 79, GPU has fallen off the bus (scripted probe)")
    _wait_for(lambda: coordinator.status()["phase"] == "gathering", 10)
    deadline = time.time() + 12.0
    drain_node(nodes["B"].node_id, deadline, "demo: spot instance reclaimed")
    clock.say("EVICTION  Ray drains node B (a spot reclaim), deadline in 12.0s")


def _crash(node: Any) -> int:
    """Every process of a local node SIGKILLed at once, as a host crash ends them: the ones Ray
    started for it and all their children (its workers, agents). Only this demo's node. The
    processes are reaped; ``cluster.remove_node`` later finds them gone. How many were killed."""
    import psutil

    victims: list[Any] = []
    for infos in node.all_processes.values():
        for info in infos:
            try:
                top = psutil.Process(info.process.pid)
                victims += [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    for infos in node.all_processes.values():
        for info in infos:
            with contextlib.suppress(subprocess.TimeoutExpired):
                info.process.wait(timeout=5)  # reap what this process started
    return len(victims)


def _until_ray_declares_dead(node_id: str, clock: _Clock, timeout: float = 60.0) -> None:
    """A crashed node stays alive to Ray's scheduler until its health checks fail (about 15 s):
    on a cluster that lives on, wait for that, so no later actor is placed on it."""
    from ..ray_adapter import raylet_address

    clock.say("waiting for Ray's own verdict on node B, so nothing is placed on it")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if raylet_address(node_id) is None:  # no longer listed alive
            return
        time.sleep(0.5)


def _wait_for(fn: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"nothing after {timeout}s")


def _wait_steps(coordinator: Any, steps: int, clock: _Clock) -> None:
    shown = 0
    end = time.monotonic() + 120
    while time.monotonic() < end:
        done = [r["last_step"] or 0 for r in coordinator.status()["ranks"]]
        step = min(done) if done else 0
        if step > shown:
            shown = step
            clock.say(f"training  step {step}")
        if step >= steps:
            return
        time.sleep(0.2)
    raise TimeoutError("training did not progress")


def _checkpoint_line(outcome: Any, names: dict[str, str]) -> str:
    """What the cycle left: every shard in a keeper's memory (committed), or - a warm
    restart's survivors parked at the step - some held by the survivors themselves (held)."""
    committed = outcome.committed or {}

    def where(nodes: list[str]) -> str:
        return "+".join(names.get(n, n[:8]) for n in nodes)

    if outcome.result == "held":
        kept = {
            record["shard"]: record["holders"]
            for report in outcome.reports
            for record in report["saved"]
            if record["tier"] == "memory"
        }
        return (
            f"HELD      step {committed['step']}, no survivor wrote its shard: "
            + ", ".join(
                f"{s} held by the survivor on {where(n)}" for s, n in committed["held"].items()
            )
            + "; "
            + ", ".join(f"{s} in the keeper on {where(n)}" for s, n in sorted(kept.items()))
        )
    return f"COMMITTED step {committed['step']} in memory: " + ", ".join(
        f"{shard} held by {where(held)}" for shard, held in sorted(committed["holders"].items())
    )


def _show_teardown(outcome: Any, clock: _Clock) -> None:
    t0 = min(n["received_at"] for n in outcome.notices)
    clock.say("TEARDOWN  each rank, from the first notice:")
    for report in sorted(outcome.reports, key=lambda r: r["ranks"][0]["rank"]):
        rank = report["ranks"][0]["rank"]
        start = report["started_at"] - t0
        steps = ", ".join(
            f"{s['name']} {s['status']}"
            + (f" {s['duration_s'] * 1000:.0f}ms" if s["duration_s"] > 0.001 else "")
            for s in report["phases"]
            if s["name"] != "exit"
        )
        saved = ""
        if report["saved"]:
            record = report["saved"][0]
            held = record["tier"] == "held"
            saved = f" {'HELD' if held else 'SAVED'} {record['shard']}"
            if held:  # its save step held a snapshot: one word for one thing
                steps = steps.replace("save ok", "hold ok")
        print(
            f"    rank {rank} ({PLACEMENT[rank]}): order at +{start:.2f}s, out at "
            f"+{start + (report['finished_s'] or 0):.2f}s{saved}  [{steps}]"
        )


if __name__ == "__main__":
    threading.current_thread().name = "demo"
    sys.exit(run_demo())
