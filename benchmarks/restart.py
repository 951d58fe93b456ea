"""``bench restart``: a drained node's ranks come back warm, against today's cold restarts.

One run compares three ways back to training after the same eviction, each repetition with its
own eviction of a fresh node:

- **warm**: ``warm_restart=True``. The survivors keep their processes and hold their own shards
  (a snapshot: they save nothing before training again; the copies reach the keepers, then
  disk, behind the training - ``coordinator/held.py``); spares (started ahead of time on a node
  that gets no notice, with their model allocated) take the evicted slots; the group re-forms
  in place (``WarmGroup.restart``). The evicted shards' memory copies are put on the spares'
  node (``memory/placement.py``);
- **warm-save-first**: the same with ``warm_restart_holds=False``: every saver, survivors too,
  hands its shard to the keepers before the step is committed and anyone trains again (the
  warm restart before 0.2.0);
- **cold-memory**: today's path. Every rank leaves; the driver starts a new group of actors that
  loads the memory tier's checkpoint (``load_latest``: the keeper on its node, else a peer);
- **cold-disk**: no memory tier. Every rank leaves after saving to disk; a new group loads the
  committed checkpoint from disk (its files dropped from the page cache first, as on a node that
  never read them).

Per repetition: a group of N ranks (each its own shard of ``mb`` MB, one memory replica) trains
on node A and on a fresh node B, which hosts N/4 of them (at least one). With ``--replicas 2``
rank r holds shard r mod N/2, so each of node B's shards has a replica on node A that stays:
the warm restart's spares receive those over the new group instead of from the evicted ranks'
hand-offs. Node B is drained
through Ray (``drain_node``) with a deadline (``--notice sigterm``: its ranks' processes are
SIGTERMed instead). The clock starts at that call (the signal) and stops when
every rank of the new group has taken its first step (an all-reduce over a sum of its whole
state); *durable* stops when the step's manifest is on disk. Nothing is simulated: real
raylets (on this one machine), real actors, real gloo. A row that would not fit this machine's
memory is skipped, and the report says so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
import uuid
from typing import Any

from ray_graceful.tools.bench.kit import BenchRank
from ray_graceful.worker.mixin import GracefulWorkerMixin

from .memory import NAMESPACE, STATE_TENSORS

WAYS = ("warm", "warm-save-first", "cold-memory", "cold-disk")


class RestartRank(GracefulWorkerMixin, BenchRank):
    """A rank whose whole state is ``mb`` MB of tensors, allocated (and touched) at start."""

    def __init__(self, mb: int, config: Any, backend: str = "gloo") -> None:
        import torch
        import torch.distributed

        per = max(mb * (1 << 20) // 4 // STATE_TENSORS, 1)
        device = "cuda" if backend == "nccl" else "cpu"
        self.state = {f"layer{i}": torch.ones(per, device=device) for i in range(STATE_TENSORS)}
        self.backend = backend
        self.config = config
        self.marks: dict[str, float] = {"constructed_at": time.time()}

    # --- the group that will be evicted -------------------------------------------------------

    def join(self, rank: int, world: int, port: int, replicas: int = 1) -> int:
        """``init_process_group``, then the plugin's one call (with the loader a rejoin uses).
        ``replicas`` 2: rank r holds shard ``r % (world / 2)``, as its replica does."""
        self.join_group(rank, world, port, self.backend)
        shard = rank % (world // replicas)
        for tensor in self.state.values():
            tensor.fill_(float(shard + 1))
        self.graceful_setup(
            "bench",
            shard=str(shard),
            config=self.config,
            state_dict=lambda: self.state,
            load_state_dict=self.load,
        )
        return os.getpid()

    def load(self, state: dict[str, Any]) -> None:
        """What a model's ``load_state_dict`` does: copy into the tensors it already has."""
        import torch

        for name, value in state.items():
            self.state[name].copy_(torch.as_tensor(value))

    # --- warm: survivors and spares ------------------------------------------------------------

    def rejoin(self) -> Any:
        self.marks["rejoin_called_at"] = time.time()
        joined = self.graceful_rejoin(
            state_dict=lambda: self.state, load_state_dict=self.load, config=self.config
        )
        self.marks["rejoined_at"] = time.time()
        return joined

    def first_step(self) -> dict[str, float]:
        """One training step that reads every byte of the state; the timestamps so far."""
        import torch
        import torch.distributed as dist

        total = torch.stack([t.sum() for t in self.state.values()]).sum().reshape(1)
        dist.all_reduce(total)
        if total.is_cuda:
            torch.cuda.synchronize()  # NCCL's all-reduce returns before it ran
        stepped_at = time.time()
        self.should_stop()  # a step ends at its boundary: a held shard's copy starts there
        return {**self.marks, "stepped_at": stepped_at}

    def raw_barrier(self) -> None:
        """A rank outside the raw transfer's pair: in its barrier, as every rank must be."""
        import torch.distributed as dist

        dist.barrier()

    def raw_transfer(self, peer: int, sending: bool) -> float:
        """The same bytes as this rank's state, sent to (or received from) ``peer`` over the
        group with nothing of the plugin's around it: the floor a spare's receive is held to.
        Seconds, from the first byte posted to the last received (the receiver's clock)."""
        import torch
        import torch.distributed as dist

        total = sum(t.numel() for t in self.state.values())
        buffer = torch.empty(
            total, dtype=torch.float32, device=next(iter(self.state.values())).device
        )
        dist.barrier()
        began = time.perf_counter()
        if sending:
            dist.send(buffer, peer)
        else:
            dist.recv(buffer, peer)
        if buffer.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began

    # --- cold: a new group ---------------------------------------------------------------------

    def start_cold(
        self, rank: int, world: int, port: int, tier: str, replicas: int = 1
    ) -> dict[str, Any]:
        """Join a new group, load the committed shard (``tier``: "memory" or "disk"), step."""
        from ray_graceful.memory.handoff import load_shard
        from ray_graceful.protocol import shard_key
        from ray_graceful.worker.restore import load_latest

        self.marks["called_at"] = time.time()
        self.join_group(rank, world, port, self.backend)
        self.marks["joined_at"] = time.time()
        shard = rank % (world // replicas)
        if tier == "memory":
            loaded = load_latest("bench", shard, self.config)
        else:
            key = shard_key("bench", str(shard))
            loaded = load_shard(key, None, self.config.checkpoint_dir, NAMESPACE)
        if loaded is None:
            raise RuntimeError(f"rank {rank}: nothing committed to load")
        self.load(loaded.state)
        self.marks["loaded_at"] = time.time()
        return {**self.first_step(), "tier": loaded.tier, "step": loaded.step}


def bench_restart(args: argparse.Namespace) -> dict[str, Any]:
    """Warm against cold (memory tier, disk), N ranks, per-rank shard sizes; see the module."""
    import ray

    from ray_graceful.tools.bench.kit import gpu_count, local_cluster

    ways = [w for w in args.ways.split(",") if w]
    runs: list[dict[str, Any]] = []
    rows = [(n, mb) for n in args.ranks for mb in args.sizes]
    fitting = [(n, mb) for n, mb in rows if _row_bytes(n, mb) <= _MACHINE_SHARE * _machine_bytes()]
    for n, mb in sorted(set(rows) - set(fitting)):
        why = (
            f"needs about {_row_bytes(n, mb) / 2**30:.0f} GiB at its peak; this machine has "
            f"{_machine_bytes() / 2**30:.0f} GiB"
        )
        print(f"  N={n} {mb} MB: skipped, {why}", flush=True)
        runs.append({"n": n, "mb": mb, "rep": 0, "way": "all", "skipped": why})
    if not fitting:
        return {"runs": runs, "table": _report(runs, ways, args)}
    # At its peak a node's store holds every shard twice: each saver's own put and its
    # keeper's copy (a saver's copy is dropped once held). Smaller, and Ray spills the
    # hand-offs to disk mid-eviction: a measurement of spilling, not of the restart. Sized
    # for the rows that fit, not for the largest asked: three raylets each count their store
    # off the machine's memory, and too large a store left Ray no memory to place actors in.
    store = max(2 * (mb << 20) * n for n, mb in fitting) + (512 << 20)
    gpus = gpu_count() if args.backend == "nccl" else 0
    with local_cluster(extra_nodes=1, head_cpus=2, object_store_bytes=store, num_gpus=gpus) as (
        cluster,
        nodes,
    ):
        node_a = nodes[0].node_id
        head = ray.get_runtime_context().get_node_id()
        for n, mb in fitting:
            # Repetition -1 is not counted: it faults in the object stores' pages (the
            # first hand-off into an untouched store costs as much as a disk write).
            for rep in range(-1, args.reps):
                for way in ways if rep % 2 == 0 else ways[::-1]:
                    run = {"n": n, "mb": mb, "rep": rep, "way": way}
                    try:
                        run.update(
                            _restart_once(ray, cluster, head, node_a, store, way, n, mb, args)
                        )
                    except Exception as exc:  # a failed run is a result: kept and counted
                        run["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    print(f"  {_line(run)}", flush=True)
                    if rep >= 0:
                        runs.append(run)
                        _keep_partial(args, runs)
    return {"runs": runs, "table": _report(runs, ways, args)}


_MACHINE_SHARE = 0.8  # of the machine's memory a row may take at its peak


def _machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _row_bytes(n: int, mb: int) -> int:
    """A row's peak: N ranks and as many successors (spares, or a cold way's new group), each
    with its state, the keepers' copy of every shard, and ~2 GiB of Ray and torch (a saver's
    own put is dropped once its keeper holds the shard)."""
    return 3 * n * (mb << 20) + (2 << 30)


def _keep_partial(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    """The runs so far, beside the final JSON: a long run cut short still leaves its data."""
    path = (args.json or os.path.join("bench-output", "restart.json")) + ".partial"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(runs, f, default=str)


def _restart_once(
    ray: Any,
    cluster: Any,
    head: str,
    node_a: str,
    store: int,
    way: str,
    n: int,
    mb: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_graceful.config import GracefulConfig
    from ray_graceful.coordinator import Coordinator
    from ray_graceful.ray_adapter import drain_node
    from ray_graceful.tools.bench.kit import gpu_count, rank_gpus, start_ranks
    from ray_graceful.warm_group import WarmGroup
    from ray_graceful.worker.process_groups import free_port

    evicted = max(1, n // 4)
    work = tempfile.mkdtemp(prefix="bench-restart-")
    config = GracefulConfig(
        checkpoint_dir=os.path.join(work, "ckpt"),
        report_dir=os.path.join(work, "reports"),
        coordinator_namespace=NAMESPACE,
        coordinator_name=f"bench-restart-{uuid.uuid4().hex[:8]}",
        memory_replicas=0 if way == "cold-disk" else 1,
        memory_budget_mb=mb * n * 2,
        warm_restart=way.startswith("warm"),
        warm_restart_holds=way == "warm",
        rejoin_timeout_s=120.0,
        drain_poll_interval_s=args.drain_poll,
        health_probe="none",
    )
    machine_gpus = gpu_count() if args.backend == "nccl" else 0
    node_b = cluster.add_node(num_cpus=2, num_gpus=machine_gpus, object_store_memory=store)
    cluster.wait_for_nodes()
    # Up to 2N rank actors live at once (the old group's, leaving, and the new one's).
    gpus = rank_gpus(args.backend, 2 * n, machine_gpus)

    def on(node_id: str) -> Any:
        return ray.remote(RestartRank).options(
            num_cpus=0,
            num_gpus=gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )

    coordinator = Coordinator.start(config, node_id=head)
    actors: list[Any] = []
    try:
        workers = [
            on(node_b.node_id if i < evicted else node_a).remote(mb, config, args.backend)
            for i in range(n)
        ]
        actors += workers
        port = free_port()
        replicas = args.replicas
        pids = start_ranks(
            ray, workers, lambda i, w: w.join.remote(i, n, port, replicas), f"num_gpus={gpus}"
        )
        group = None
        if way.startswith("warm"):
            spares = [on(node_a).remote(mb, config, args.backend) for _ in range(evicted)]
            actors += spares
            ray.get([s.__ray_ready__.remote() for s in spares], timeout=300)  # imports done
            group = WarmGroup(coordinator, workers, spares=spares, method="rejoin")
        running = [w.train.remote(10**6, 1, 0.05) for w in workers]
        _wait_training(coordinator, n)

        t0 = time.time()
        if args.notice == "sigterm":  # node B's ranks signalled, as a preStop or SLURM would
            for pid in pids[:evicted]:
                os.kill(pid, signal.SIGTERM)
        else:
            drain_node(node_b.node_id, t0 + args.deadline, "bench restart: drain")
        ray.wait(running, num_returns=n, timeout=args.deadline + 60)
        calls_ended_at = time.time()
        outcome = coordinator.wait_outcome(timeout=args.deadline + 60, cycle=0)
        committed_at = time.time()
        if outcome is None or outcome.result not in ("committed", "held"):
            raise RuntimeError(f"no commit: {outcome and outcome.summary()}")
        step = int(outcome.committed["step"])
        if group is not None:
            restart = group.restart(timeout=120)
            marks = ray.get([w.first_step.remote() for w in group.workers], timeout=120)
            if restart.step != step or restart.world_size != n:
                raise RuntimeError(f"rejoined at step {restart.step} of {restart.world_size}")
            result = _warm_times(t0, committed_at, restart.members, marks)
            result["raw_s"] = _raw_transfer(ray, group.workers, restart.members, n, args.replicas)
        else:
            if way == "cold-disk":
                _drop_from_page_cache(outcome.committed.get("path") or "")
            new = [on(node_a).remote(mb, config, args.backend) for _ in range(n)]
            actors += new
            port = free_port()
            tier = "memory" if way == "cold-memory" else "disk"
            marks = ray.get(
                [w.start_cold.remote(i, n, port, tier, replicas) for i, w in enumerate(new)],
                timeout=300,
            )
            if {m["step"] for m in marks} != {step}:
                raise RuntimeError(f"loaded steps {sorted({m['step'] for m in marks})}, not {step}")
            result = _cold_times(t0, committed_at, marks)
        durable_s = in_keepers_s = committed_at - t0  # cold-disk: the commit is the manifest
        if way != "cold-disk":  # the durable copy lands before the next run starts
            durable = coordinator.wait_durable(0, timeout=600) or {}
            if "at" not in durable:
                raise RuntimeError(f"step {step} never durable: {durable}")
            durable_s = durable["at"] - t0
            where = coordinator.durability(0) or {}
            in_keepers_s = where.get("at", {}).get("in-keepers", committed_at) - t0
        return {
            "commit_tier": outcome.committed.get("tier"),
            "durable_s": durable_s,
            "in_keepers_s": in_keepers_s,
            "outcome_timings": dict(outcome.timings),
            "teardowns": [
                {s["name"]: round(s.get("duration_s") or 0.0, 3) for s in report["phases"]}
                for report in outcome.reports
            ],
            "notice_received_s": min(n["received_at"] for n in outcome.notices) - t0,
            "calls_ended_s": calls_ended_at - t0,
            **result,
        }
    finally:
        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        coordinator.shutdown()
        cluster.remove_node(node_b)
        shutil.rmtree(work, ignore_errors=True)


def _wait_training(coordinator: Any, n: int, timeout: float = 120.0) -> None:
    """Until every rank reported step 3 or later (its training thread is in the loop)."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        ranks = coordinator.status()["ranks"]
        if len(ranks) == n and all((r["last_step"] or 0) >= 3 for r in ranks):
            return
        time.sleep(0.1)
    raise TimeoutError(f"the group of {n} did not start training within {timeout}s")


def _raw_transfer(ray: Any, workers: list[Any], members: Any, n: int, replicas: int) -> Any:
    """One shard's bytes from a spare's surviving replica to that spare, over the new group,
    bare (``RestartRank.raw_transfer``); None where no spare received its shard so."""
    receiver = next((m.rank for m in members if m.loaded_from == "group-peer"), None)
    if receiver is None or replicas < 2:
        return None
    sender = (receiver + n // replicas) % n  # rank r holds shard r mod N/2, as its replica
    others = [w.raw_barrier.remote() for i, w in enumerate(workers) if i not in (sender, receiver)]
    sent = workers[sender].raw_transfer.remote(receiver, True)
    received = workers[receiver].raw_transfer.remote(sender, False)
    ray.get([sent, *others], timeout=120)
    return float(ray.get(received, timeout=120))


def _warm_times(
    t0: float, committed_at: float, members: Any, marks: list[dict[str, float]]
) -> dict[str, Any]:
    stepped = max(m["stepped_at"] for m in marks)
    rejoined = max(m["rejoined_at"] for m in marks)
    return {
        "back_s": stepped - t0,
        "commit_s": committed_at - t0,
        "rendezvous_s": max(m.seconds.get("rendezvous", 0.0) for m in members),
        "register_s": max(m.seconds.get("register", 0.0) for m in members),
        "load_s": max(m.seconds.get("load", 0.0) for m in members),
        "members": [{"was": m.was, "loaded_from": m.loaded_from, **m.seconds} for m in members],
        "rejoin_s": rejoined - committed_at,
        "first_step_s": stepped - rejoined,
        "loaded_from": dict(collections.Counter(m.loaded_from for m in members)),
    }


def _cold_times(t0: float, committed_at: float, marks: list[dict[str, Any]]) -> dict[str, Any]:
    stepped = max(m["stepped_at"] for m in marks)
    return {
        "back_s": stepped - t0,
        "commit_s": committed_at - t0,
        "start_s": max(m["constructed_at"] for m in marks) - committed_at,
        "rendezvous_s": max(m["joined_at"] - m["called_at"] for m in marks),
        "load_s": max(m["loaded_at"] - m["joined_at"] for m in marks),
        "first_step_s": max(m["stepped_at"] - m["loaded_at"] for m in marks),
        "loaded_from": dict(collections.Counter(m["tier"] for m in marks)),
    }


def _drop_from_page_cache(path: str) -> None:
    from .memory import _drop_page_cache

    for folder, _dirs, files in os.walk(path):
        for name in files:
            _drop_page_cache(os.path.join(folder, name))


def _line(run: dict[str, Any]) -> str:
    where = f"N={run['n']} {run['mb']} MB rep {run['rep']} {run['way']}"
    if "error" in run:
        return f"{where}: FAILED {run['error']}"
    return (
        f"{where}: back in {run['back_s']:.3f} s (outcome at {run['commit_s']:.3f} s, durable "
        f"at {run['durable_s']:.3f} s)"
    )


def _report(runs: list[dict[str, Any]], ways: list[str], args: argparse.Namespace) -> str:
    from ray_graceful.tools.bench.kit import markdown_table

    rows = []
    for n in args.ranks:
        for mb in args.sizes:
            cell = [r for r in runs if r["n"] == n and r["mb"] == mb]
            skipped = next((r["skipped"] for r in cell if "skipped" in r), None)
            if skipped:
                rows.append([n, mb, "skipped", *["-"] * 11, skipped])
                continue
            warm = [r["back_s"] for r in cell if r["way"] == "warm" and "error" not in r]
            for way in ways:
                done = [r for r in cell if r["way"] == way and "error" not in r]
                failed = sum(1 for r in cell if r["way"] == way and "error" in r)
                if not done:
                    rows.append([n, mb, way, *["-"] * 10, failed, "-"])
                    continue
                back = [r["back_s"] for r in done]

                def med(key: str, runs: list[dict[str, Any]] = done) -> Any:
                    values = [r[key] for r in runs if r.get(key) is not None]
                    return statistics.median(values) if values else "-"

                tiers: collections.Counter[str] = collections.Counter()
                for r in done:
                    tiers.update(r["loaded_from"])
                rows.append(
                    [
                        n,
                        mb,
                        way,
                        statistics.median(back),
                        max(back),
                        f"{statistics.median(back) / statistics.median(warm):.1f}x"
                        if warm
                        else "-",
                        med("commit_s"),
                        med("durable_s"),
                        med("start_s"),
                        med("rendezvous_s"),
                        med("load_s"),
                        med("raw_s"),
                        med("first_step_s"),
                        failed,
                        ", ".join(f"{k} {v}" for k, v in sorted(tiers.items())),
                    ]
                )
    table = markdown_table(
        [
            "N",
            "MB/rank",
            "way",
            "back p50 s",
            "max s",
            "vs warm",
            "outcome s",
            "durable s",
            "new processes s",
            "rendezvous s",
            "load s",
            "raw transfer s",
            "first step s",
            "failed",
            "loaded from (ranks)",
        ],
        rows,
    )
    return table + (
        f"\n{args.reps} repetitions per row; "
        + ("each shard on two ranks, one on node A; " if args.replicas == 2 else "")
        + (
            "node B's ranks (N/4, at least 1) SIGTERMed. back = the signal"
            if args.notice == "sigterm"
            else "node B (N/4 of the ranks, at least 1) drained "
            f"through Ray with a {args.deadline:g} s deadline, drain polled every "
            f"{args.drain_poll:g} s. back = the drain call"
        )
        + " -> every rank of the new group took its "
        "first step; outcome = the same start -> the driver holds the outcome (committed, or "
        "held by the warm survivors); durable = the same start -> the step's manifest on disk; "
        "new processes = outcome -> the last new actor constructed (imports, state "
        "allocated); rendezvous = the new process group formed; load = the committed shard in "
        "the rank's tensors; raw transfer = one shard's bytes sent bare between the same two "
        "processes over the new group (warm, --replicas 2: a spare and its shard's survivor); "
        "first step = an all-reduce over a sum of the whole state. Warm: "
        "survivors keep their processes, spares (started ahead, on node A) take the slots."
    )


def add_restart_parser(names: Any) -> Any:
    """``python -m benchmarks restart``'s options."""
    from ray_graceful.tools.arguments import (
        comma_choices,
        positive_int,
        positive_ints,
        positive_seconds,
    )

    restart = names.add_parser(
        "restart", help="warm restart vs cold (memory tier, disk): a drained node to training"
    )
    restart.add_argument("--ranks", type=positive_ints, default="4,8", help="group sizes")
    restart.add_argument(
        "--sizes", type=positive_ints, default="64,1024", help="MB per rank (default 64,1024)"
    )
    restart.add_argument("--reps", type=positive_int, default=5, help="repetitions (default 5)")
    restart.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="nccl: every rank's state on its GPU (a share of one where there are fewer GPUs "
        "than ranks); the warm group's communicator is formed in its rendezvous",
    )
    restart.add_argument(
        "--ways",
        type=comma_choices(*WAYS),
        default=",".join(WAYS),
        help="warm, warm-save-first, cold-memory, cold-disk (default: all)",
    )
    restart.add_argument(
        "--notice",
        choices=("drain", "sigterm"),
        default="drain",
        help="drain (default): node B drained through Ray; sigterm: its ranks' processes "
        "SIGTERMed (the clock starts at the signal)",
    )
    restart.add_argument(
        "--deadline",
        type=positive_seconds,
        default=10.0,
        help="the drain's deadline (default 10 s)",
    )
    restart.add_argument(
        "--replicas",
        type=int,
        choices=(1, 2),
        default=1,
        help="1 (default): each rank its own shard; 2: each shard held by two ranks, one on the "
        "drained node and one on the node that stays, so a spare receives it from the survivor",
    )
    restart.add_argument(
        "--drain-poll",
        type=positive_seconds,
        default=0.25,
        help="the coordinator's drain poll interval (default 0.25 s)",
    )
    return restart
