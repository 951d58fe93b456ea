"""``python -m benchmarks soak --warm``: warm restarts back to back, in the same processes.

The cold soak (``soak.py``) starts its group again each cycle, so a leak in a rank's process
never lives past one cycle. Here the group is started once: 4 gloo ranks (shards 0, 1, 0, 1)
of real actor processes, one coordinator with ``warm_restart`` on, and one spare. Each cycle:

- the group trains (all-reduces) under the plugin;
- rank 0's process gets SIGTERM (the saver of shard 0 in one cycle, a backup in another);
- ``WarmGroup.restart()`` re-forms the group in place: the three survivors keep their
  processes and rebuild their communicators, the spare takes the evicted rank's slot and loads
  its shard from the memory tier;
- a new spare is started for the next cycle.

So ranks 1 to 3 live through every re-form, in the processes they started in: a leak in a
survivor (threads, descriptors, memory, a stale step) grows for the whole run.

``--held``: rank 0 and every spare run on a second node. A SIGTERM evicts that node's rank, so
the survivors on the head hold the step (no save before training again), the spare receives
shard 0 from the survivor that holds it over the new group, and the step becomes durable
behind the training - the held path, each cycle where the survivors parked at the step
(``result`` says ``held``; a survivor released from inside a step saves first: ``committed``).

Nothing is simulated: real processes, signals, gloo groups, keepers and disk.

Per cycle it records: the evicted process out by its deadline (else a hang), the checkpoint
(torn: as the cold soak checks it), Ray-recorded crashes, whether every member joined and at
which step, the time from the signal to the group training again, and the resources of the
coordinator (RSS, threads, file descriptors), of the surviving rank processes (the largest
RSS, threads and descriptors among them) and the live actors in the cluster. A cycle whose
warm restart fails is recorded with the reason and the group is started cold again, so the
soak goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import time
from collections import Counter
from typing import Any

from ray_graceful.checkpoint import latest_committed
from ray_graceful.tools.bench.kit import BenchRank, process_alive, recorded_crashes, resident_mb
from ray_graceful.worker.mixin import GracefulWorkerMixin

from .soak import SHARDS, resources_table, torn_commits

RESOURCES = (
    "coordinator_rss_mb",
    "coordinator_threads",
    "coordinator_fds",
    "rank_rss_mb",
    "rank_threads",
    "rank_fds",
    "live_actors",
)


class WarmSoakRank(GracefulWorkerMixin, BenchRank):
    """A rank whose state is a user's: 256 KiB of weights and their Adam optimizer; it rejoins
    in place.

    Every step all-reduces, then takes one Adam step with a gradient of ones, so the state at
    step k is known exactly: Adam's own step count is k, its first moment ``1 - 0.9**k``. A
    checkpoint on disk whose optimizer is not at its step holds state from another step
    (``_on_disk_is_its_step``) - what a spare that loaded views of a keeper's object used to
    write into the held step."""

    def __init__(self, config: Any) -> None:
        import torch

        self.config = config
        self.weights = torch.nn.Parameter(torch.zeros(1 << 16))
        self.adam = torch.optim.Adam([self.weights], lr=1e-3)

    def join(self, rank: int, world: int, port: int) -> int:
        """A cold start resumes as a user's would: from the committed step, if there is one
        (after a warm restart that could not be made, the group starts again from it)."""
        import torch

        from ray_graceful import load_latest

        pid = self.join_group(rank, world, port, timeout_s=60.0)
        loaded = load_latest("soak", SHARDS[rank], self.config)
        if loaded is None:
            with torch.no_grad():
                self.weights.fill_(float(SHARDS[rank]))
        else:
            self._load(loaded.state)
            self.step = loaded.step
        self.graceful_setup(
            "soak",
            shard=SHARDS[rank],
            config=self.config,
            state_dict=self._state,
            load_state_dict=self._load,
        )
        return pid

    def rejoin(self) -> Any:
        joined = self.graceful_rejoin(
            state_dict=self._state, load_state_dict=self._load, config=self.config
        )
        if joined.joined:
            self.step = joined.step
        return joined

    def update(self) -> None:
        """One Adam step after each step's all-reduce, with a gradient of ones."""
        import torch

        self.weights.grad = torch.ones_like(self.weights)
        self.adam.step()

    def _state(self) -> dict[str, Any]:
        optim = self.adam.state_dict()
        return {"weights": self.weights.detach(), "optim": optim, "step": self.step}

    def _load(self, state: dict[str, Any]) -> None:
        import torch

        with torch.no_grad():
            self.weights.copy_(state["weights"])
        self.adam.load_state_dict(state["optim"])

    def step_now(self) -> int:
        return self.step

    def usage(self) -> dict[str, float]:
        """This process's resident memory, threads and file descriptors."""
        pid = os.getpid()
        return {
            "pid": pid,
            "rss_mb": resident_mb(pid),
            "threads": len(os.listdir(f"/proc/{pid}/task")),
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
        }


def _wait_stepping(coordinator: Any, n: int, past: int) -> int:
    """Until all ``n`` ranks told the coordinator a step boundary beyond ``past`` (they train
    again, not only rejoined); the cycle an eviction now opens."""
    give_up = time.time() + 60
    while time.time() < give_up:
        with contextlib.suppress(Exception):
            ranks = coordinator.status(timeout=5).get("ranks") or []
            steps = [r["last_step"] if r["last_step"] is not None else -1 for r in ranks]
            if len(steps) >= n and min(steps) >= past:
                return int(coordinator.stats(timeout=5)["cycle"])
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator never saw the {n} ranks step past {past}")


def bench_soak_warm(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from ray_graceful.config import GracefulConfig
    from ray_graceful.coordinator import Coordinator
    from ray_graceful.tools.bench.kit import local_cluster

    work = tempfile.mkdtemp(prefix="soak-warm-")
    config = GracefulConfig(
        report_dir=os.path.join(work, "reports"),
        checkpoint_dir=os.path.join(work, "ckpt"),
        health_interval_s=0.5,
        expected_save_s=1.0,
        save_budget_s=args.deadline / 2,
        teardown_timeout_s=args.deadline,
        exit_grace_s=1.0,
        health_probe="none",
        memory_replicas=1,
        warm_restart=True,
        rejoin_timeout_s=60.0,
    )
    cycles: list[dict[str, Any]] = []
    held = getattr(args, "held", False)
    with local_cluster(extra_nodes=1 if held else 0, head_cpus=4) as _cluster:
        rank_actor = ray.remote(WarmSoakRank).options(num_cpus=0, resources={"bench_head": 1})
        # --held: the evicted slot and its spares on a node of their own (see the docstring)
        spare_actor = (
            ray.remote(WarmSoakRank).options(num_cpus=0, resources={"bench_n0": 1})
            if held
            else rank_actor
        )
        coordinator = Coordinator.start(config)
        group = None
        try:
            for number in range(args.cycles):
                if group is None:
                    group = _start_group(ray, rank_actor, spare_actor, coordinator, config)
                cycle, group = _one_cycle(ray, spare_actor, coordinator, config, group, number)
                cycle.update(_resources(ray, coordinator, group), number=number)
                cycles.append(cycle)
                print(f"  warm cycle {number}: {_line(cycle)}", flush=True)
        finally:
            for actor in [*(group.workers if group else ()), *(group.spares if group else ())]:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            coordinator.shutdown()
    return {"results": cycles, "table": _report(cycles, args)}


def _start_group(ray: Any, rank_actor: Any, spare_actor: Any, coordinator: Any, config: Any) -> Any:
    """A cold start: four new ranks and one spare (also after a failed warm restart). Rank 0,
    the one evicted each cycle, is placed as the spares are."""
    from ray_graceful.warm_group import WarmGroup
    from ray_graceful.worker.process_groups import free_port

    workers = [(spare_actor if i == 0 else rank_actor).remote(config) for i in range(len(SHARDS))]
    port = free_port()
    ray.get([w.join.remote(i, len(SHARDS), port) for i, w in enumerate(workers)], timeout=180)
    spares = [_new_spare(ray, spare_actor, config)]
    return WarmGroup(coordinator, workers, spares=spares, method="rejoin")


SPARE_PIDS: dict[Any, int] = {}  # a waiting spare cannot answer a call: its pid, asked before


def _new_spare(ray: Any, rank_actor: Any, config: Any) -> Any:
    spare = rank_actor.remote(config)
    SPARE_PIDS[spare] = int(ray.get(spare.usage.remote(), timeout=120)["pid"])
    return spare


def _end(ray: Any, group: Any) -> None:
    """End the group and its waiting spares by SIGTERM, as an eviction would: a spare leaves
    the coordinator's pool on it (``ray.kill`` would leave it listed, to be handed a slot)."""
    pids = []
    for worker in group.workers:  # a survivor told to leave is gone already
        with contextlib.suppress(Exception):
            pids.append(int(ray.get(worker.usage.remote(), timeout=10)["pid"]))
    pids += [SPARE_PIDS.pop(spare) for spare in group.spares if spare in SPARE_PIDS]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    until = time.time() + 30
    while any(process_alive(pid) for pid in pids) and time.time() < until:
        time.sleep(0.05)
    for actor in [*group.workers, *group.spares]:
        with contextlib.suppress(Exception):
            ray.kill(actor)


def _one_cycle(
    ray: Any, spare_actor: Any, coordinator: Any, config: Any, group: Any, number: int
) -> tuple[dict[str, Any], Any]:
    from ray_graceful.warm_group import WarmRestartFailed

    victim_rank = 0
    pids = [int(u["pid"]) for u in ray.get([w.usage.remote() for w in group.workers], timeout=60)]
    steps = ray.get([w.step_now.remote() for w in group.workers], timeout=60)
    running = [w.train.remote(10**9, 1 << 14, 0.01) for w in group.workers]
    cycle_number = _wait_stepping(coordinator, len(SHARDS), past=max(steps) + 2)
    latest = latest_committed(config.checkpoint_dir)
    before = latest.step if latest else None
    t0 = time.time()
    os.kill(pids[victim_rank], signal.SIGTERM)
    out_by = t0 + config.teardown_timeout_s + 5.0
    while process_alive(pids[victim_rank]) and time.time() < out_by:
        time.sleep(0.02)
    out_s = time.time() - t0
    hangs = int(process_alive(pids[victim_rank]))
    ray.wait(running, num_returns=len(running), timeout=config.teardown_timeout_s + 30)
    record: dict[str, Any] = {"kind": "warm-sigterm", "cycle": cycle_number, "out_s": out_s}
    try:
        restart = group.restart(timeout=120)
        outcome = restart.outcome
        record.update(
            joined=len(restart.members),
            step=restart.step,
            training_again_s=time.time() - t0,
            reason="",
        )
        # One step of the new group: a held step's copies to the keepers start with it, so
        # its durability (checked below) does not wait out rejoin_timeout_s.
        ray.get([w.train.remote(1, 1 << 14, 0.0) for w in group.workers], timeout=60)
        record.update(first_step_s=time.time() - t0)
        group.add_spares([_new_spare(ray, spare_actor, config)])
    except WarmRestartFailed as exc:
        outcome = exc.outcome
        record.update(
            joined=0,
            step=None,
            training_again_s=float("nan"),
            first_step_s=float("nan"),
            reason=exc.reason,
        )
        _end(ray, group)
        group = None
    record.update(
        hangs=hangs,
        result="no outcome" if outcome is None else str(outcome.result),
        torn=torn_commits(coordinator, config.checkpoint_dir, cycle_number, outcome, before),
        crashes=recorded_crashes(set(pids)),
        not_its_step=_on_disk_is_its_step(config.checkpoint_dir),
    )
    return record, group


def _on_disk_is_its_step(root: str) -> list[str]:
    """The newest durable checkpoint's shards whose state is not of its step: Adam's step count
    and first moment (gradient ones: ``1 - 0.9**k``) say which step a shard's state is from."""
    import torch

    from ray_graceful.checkpoint import load_committed_shard

    latest = latest_committed(root, verify_checksums=True)
    if latest is None:
        return []
    wrong = []
    for shard in sorted(latest.shards):
        saved = load_committed_shard(latest, shard)
        step, optim = int(saved["step"]), saved["state"]["optim"]["state"]
        if step == 0 and not optim:
            continue
        adam = optim[0]
        moment = torch.full_like(adam["exp_avg"], 1 - 0.9**step)
        if int(adam["step"]) != step or not torch.allclose(adam["exp_avg"], moment, atol=1e-6):
            wrong.append(f"{shard}@{step}: Adam at step {int(adam['step'])}")
    return wrong


def _resources(ray: Any, coordinator: Any, group: Any) -> dict[str, Any]:
    from ray_graceful.ray_adapter import live_actors

    pid = int(coordinator.stats()["pid"])
    ranks = ray.get([w.usage.remote() for w in group.workers], timeout=60) if group else []
    return {
        "coordinator_rss_mb": resident_mb(pid),
        "coordinator_threads": len(os.listdir(f"/proc/{pid}/task")),
        "coordinator_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "rank_rss_mb": max((r["rss_mb"] for r in ranks), default=0.0),
        "rank_threads": max((r["threads"] for r in ranks), default=0),
        "rank_fds": max((r["fds"] for r in ranks), default=0),
        "live_actors": live_actors(),
        "oldest_rank_pid": min((r["pid"] for r in ranks), default=0),
    }


def _line(c: dict[str, Any]) -> str:
    joined = f"{c['joined']}/4 joined at step {c['step']}" if c["joined"] else c["reason"][:80]
    return (
        f"{c['result']}, evicted out in {c['out_s']:.2f}s, {joined}, training again after "
        f"{c['training_again_s']:.2f}s (first step {c['first_step_s']:.2f}s), hangs {c['hangs']}, "
        f"torn {c['torn']}, not its step {c['not_its_step'] or 0}, crashes "
        f"{c['crashes']}, coordinator {c['coordinator_rss_mb']:.0f} MB, ranks "
        f"{c['rank_rss_mb']:.0f} MB / {c['rank_threads']} threads / {c['rank_fds']} fds, "
        f"{c['live_actors']} actors"
    )


def _report(cycles: list[dict[str, Any]], args: argparse.Namespace) -> str:
    from ray_graceful.tools.bench.kit import markdown_table, percentile

    warm = [c for c in cycles if c["joined"]]
    row = [
        "warm-sigterm",
        len(cycles),
        sum(c["hangs"] for c in cycles),
        sum(c["torn"] for c in cycles),
        f"{sum(1 for c in cycles if not c['not_its_step'])} of {len(cycles)}",
        sum(c["crashes"] for c in cycles),
        f"{len(warm)} re-formed in place, {len(cycles) - len(warm)} failed",
        ", ".join(f"{n} {r}" for r, n in sorted(Counter(c["result"] for c in cycles).items())),
        percentile([c["out_s"] for c in cycles], 0.5),
        percentile([c["training_again_s"] for c in warm], 0.5),
        max((c["training_again_s"] for c in warm), default=float("nan")),
        percentile([c["first_step_s"] for c in warm], 0.5),
    ]
    header = [
        "eviction", "cycles", "hangs", "torn", "on disk = its step", "Ray: crashes",
        "warm restarts", "results",
    ]  # fmt: skip
    timed = ["evicted out p50 s", "training again p50 s", "max s", "first step p50 s"]
    text = markdown_table([*header, *timed], [row])
    text += "\n\n" + resources_table(cycles, RESOURCES, args.warmup)
    oldest = cycles[-1]["oldest_rank_pid"] if cycles else 0
    lived = sum(1 for c in cycles if c["oldest_rank_pid"] == oldest and oldest)
    text += (
        f"\n{len(cycles)} cycles, {len(SHARDS)} ranks and one spare, warm_restart on, "
        f"memory_replicas=1, deadline {args.deadline:.0f}s"
        + (
            "; rank 0 and the spares on a node of their own (--held)"
            if getattr(args, "held", False)
            else ""
        )
        + "; rank resources are the largest of "
        f"the live ranks; the oldest rank process re-formed its group in {lived} of them; "
        f"slopes over cycles {args.warmup + 1}..{len(cycles)}"
    )
    return text
