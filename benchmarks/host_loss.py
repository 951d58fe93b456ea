"""``python -m benchmarks host-loss``: a host lost without a word, from the fault to the outcome.

**Real:** a Ray cluster whose hosts are network namespaces on this machine
(``benchmarks/hosts.py``: own veth, IP and raylet each; needs root and iproute2), real gloo
ranks adopting the plugin, a real coordinator, real faults: a **crash** (every process of the
host SIGKILLed, its kernel - this machine's - still answering), a **partition** (its link down,
its processes alive), a **stall** (every process SIGSTOPped for ``--stall-s``, then SIGCONT).
Every host shares this machine's 2 cores, so the times include CPU contention a real cluster
does not have.

Per repetition: two fresh hosts, ranks 0 and 1 on host A, their replicas 2 and 3 on host B
(``--ranks 4``; two shards), the coordinator on the head; host A fails mid-training. Timed from
the fault: host B's ranks out of their training loop (released), and the cycle's outcome
(committed or not, at which step), for each way:

- ``watch``: the plugin with ``host_watch=True`` (heartbeats, then a probe of the raylet);
- ``ray``: the plugin without it - the coordinator hears of the loss when Ray declares the
  host's actors dead (Ray's own detection, in the same run);
- no plugin at all is not run: its survivors wait out the collective's timeout (gloo: 30 min).

``--warm-reps N`` runs, per fault, a group with ``warm_restart=True`` and times the fault to
``WarmGroup.restart()`` returning and to the first step of the re-formed group: two ranks
(rank 0 on host A, its replica on host B, a spare on host C), or with ``--warm-hosts 4`` the
issue's shape - eight ranks, two on each of four hosts, each shard's replicas on different
hosts, two spares on a fifth. ``--stalls N`` then keeps one job
training and stalls host A N times, and ``--slow-links N`` another whose host A is put behind a
``--slow-ms`` link N times (``HostCluster.slow``): each time the host watch declares the host
lost is a false alarm.
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
from typing import Any

from ray_graceful import GracefulConfig, GracefulWorkerMixin
from ray_graceful.tools.bench.kit import BenchRank

SHARDS = ("0", "1", "0", "1")
FAULTS = ("crash", "partition")
WAYS = ("watch", "ray")


class HostLossRank(GracefulWorkerMixin, BenchRank):
    """A rank holding its shard's weights (64 KiB), saved when ordered."""

    def setup(self, rank: int, world: int, addr: str, port: int, config: Any) -> int:
        import torch

        shard = SHARDS[rank % len(SHARDS)]
        self.weights = torch.full((1 << 14,), float(shard))
        pid = self.join_group(rank, world, port, timeout_s=600.0, addr=addr)
        self.graceful_setup("hostloss", shard=shard, config=config, state_dict=self._state)
        return pid

    def _state(self) -> dict[str, Any]:
        return {"weights": self.weights, "step": self.step}


class WarmHostRank(GracefulWorkerMixin, BenchRank):
    """A rank of a warm group holding one replicated shard; a spare until it joins one."""

    def __init__(self, config: Any) -> None:
        import torch

        self.config = config
        self.weights = torch.zeros(1 << 14)

    def setup(self, rank: int, world: int, addr: str, port: int, shard: str = "0") -> int:
        self.weights.fill_(1.0 + int(shard))
        pid = self.join_group(rank, world, port, timeout_s=600.0, addr=addr)
        self.graceful_setup(
            "warm",
            shard=shard,
            config=self.config,
            state_dict=self._state,
            load_state_dict=self._load,
        )
        return pid

    def _state(self) -> dict[str, Any]:
        return {"weights": self.weights, "step": self.step}

    def _load(self, state: dict[str, Any]) -> None:
        self.weights.copy_(state["weights"])

    def rejoin(self) -> Any:
        joined = self.graceful_rejoin(
            state_dict=self._state, load_state_dict=self._load, config=self.config
        )
        self.step = joined.step if joined.joined else self.step
        return joined


def add_host_loss_parser(names: Any) -> Any:
    from ray_graceful.tools.arguments import comma_choices, count, positive_int, positive_seconds

    p = names.add_parser("host-loss", help="a host lost without a word: watch vs Ray's verdict")
    p.add_argument("--reps", type=count, default=5, help="per fault and way (default 5; 0: none)")
    p.add_argument("--faults", type=comma_choices(*FAULTS), default=",".join(FAULTS))
    p.add_argument("--ways", type=comma_choices(*WAYS), default=",".join(WAYS))
    p.add_argument("--stalls", type=count, default=20, help="stalls for false alarms (default 20)")
    p.add_argument("--stall-s", type=positive_seconds, default=2.0, help="each stall (default 2)")
    p.add_argument(
        "--slow-links", type=count, default=20, help="slow links for false alarms (default 20)"
    )
    p.add_argument(
        "--slow-ms",
        type=_delay_ms,
        default=200,
        help="each slow link's added delay to the host, ms (1-60000; default 200)",
    )
    p.add_argument(
        "--slow-back-ms",
        type=_delay_ms,
        help="and from the host, ms (1-60000; default: none)",
    )
    p.add_argument(
        "--warm-reps",
        type=count,
        default=5,
        help="per fault: a warm group (see --warm-hosts), timed to training again "
        "(default 5; 0: none)",
    )
    p.add_argument(
        "--warm-hosts",
        type=positive_int,
        default=1,
        help="the warm group's hosts: 1 (default) - rank 0 on the failed host, its replica on "
        "another, a spare on a third; N >= 2 - two ranks on each of N hosts, replicas on "
        "different hosts, two spares on one more host",
    )
    return p


def _delay_ms(text: str) -> int:
    """argparse type: a link's added delay, 1 to 60,000 ms."""
    import argparse

    from ray_graceful.tools.arguments import positive_int

    value = positive_int(text)
    if value > 60_000:
        raise argparse.ArgumentTypeError(f"{text!r}: a delay of at most 60000 ms")
    return value


def wait_watched(coordinator: Any, hosts: int, timeout_s: float = 30.0) -> None:
    """Until the coordinator's host watch hears ``hosts`` hosts' heartbeats (their agents
    start with the first rank on each); ``RuntimeError`` with what it heard after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while len((watch := coordinator.status()["host_watch"])["hosts"]) < hosts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the host watch heard {len(watch['hosts'])} of {hosts} hosts")
        time.sleep(0.1)


def _config(tmp: str, tag: str, watch: bool) -> GracefulConfig:
    return GracefulConfig(
        report_dir=f"{tmp}/reports-{tag}",
        checkpoint_dir=f"{tmp}/ckpt-{tag}",
        health_probe="none",
        teardown_timeout_s=90.0,  # past Ray's verdict on a partitioned host (about 64 s)
        save_budget_s=10.0,
        host_watch=watch,
        coordinator_namespace=f"rg-{tag}",
    )


def add_pair(hosts: Any) -> tuple[Any, Any, str]:
    """Two fresh hosts for one ``_Job``, and the tag their resources are named with."""
    tag = uuid.uuid4().hex[:8]
    a = hosts.add_host(num_cpus=2, resources={f"A-{tag}": 1})
    b = hosts.add_host(num_cpus=2, resources={f"B-{tag}": 1})
    return a, b, tag


class _Job:
    """Two fresh hosts (or ``pair``, from ``add_pair``), a coordinator, four ranks training;
    ``end`` removes all of it."""

    def __init__(self, hosts: Any, tmp: str, watch: bool, pair: Any = None) -> None:
        import ray

        from ray_graceful import Coordinator

        self.hosts = hosts
        self.a, self.b, tag = pair or add_pair(hosts)
        self.config = _config(tmp, tag, watch)
        self.coordinator = Coordinator.start(self.config)
        actor = ray.remote(num_cpus=0)(HostLossRank)
        env = {"env_vars": {"GLOO_SOCKET_IFNAME": "eth0"}}
        on = [f"A-{tag}", f"A-{tag}", f"B-{tag}", f"B-{tag}"]
        self.ranks = [actor.options(resources={r: 0.1}, runtime_env=env).remote() for r in on]
        port = random.randint(20000, 40000)
        ray.get(
            [r.setup.remote(i, 4, self.a.ip, port, self.config) for i, r in enumerate(self.ranks)],
            timeout=120,
        )
        ray.get([r.train.remote(3, 1 << 10) for r in self.ranks], timeout=60)
        if watch:
            wait_watched(self.coordinator, 2)
        self.training = [r.train.remote(10**7, 1 << 10, 0.01) for r in self.ranks]

    def end(self) -> None:
        import ray

        for rank in self.ranks:
            ray.kill(rank)
        self.coordinator.shutdown()
        self.hosts.remove_host(self.a)
        self.hosts.remove_host(self.b)


def _one(hosts: Any, tmp: str, fault: str, way: str, pair: Any = None) -> dict[str, Any]:
    job = _Job(hosts, tmp, watch=way == "watch", pair=pair)
    try:
        return time_fault(job, fault, way)
    finally:
        job.end()


def time_fault(job: _Job, fault: str, way: str) -> dict[str, Any]:
    """Fail the job's host A now: seconds to the survivors' release and to the outcome."""
    import ray

    started = time.monotonic()
    job.hosts.fail(job.a, fault)
    released_s = None
    done, _ = ray.wait(job.training[2:], num_returns=2, timeout=120)
    if len(done) == 2:
        released_s = time.monotonic() - started
    outcome = job.coordinator.wait_outcome(timeout=120, cycle=0)
    outcome_s = time.monotonic() - started
    return {
        "fault": fault,
        "way": way,
        "released_s": released_s,
        "outcome_s": outcome_s if outcome is not None else None,
        "result": outcome.result if outcome else None,
        "step": (outcome.committed or {}).get("step") if outcome else None,
        "source": outcome.notices[0]["source"] if outcome and outcome.notices else None,
    }


def _warm_one(hosts: Any, tmp: str, fault: str, rank_hosts: int) -> dict[str, Any]:
    """Host A fails; the host watch declares it lost, the replicas elsewhere hold or save its
    shards, spares on a host of their own take its slots: seconds from the fault to
    ``restart()`` and to the first step of the re-formed group.

    ``rank_hosts`` 1: the small shape - rank 0 on host A, its replica on host B, a spare on a
    third. Otherwise the issue's shape: two ranks on each of ``rank_hosts`` hosts, shard
    ``rank % (world / 2)`` so that each shard's two replicas sit on different hosts, and two
    spares on one more host."""
    import ray

    from ray_graceful import Coordinator, WarmGroup, WarmRestartFailed

    tag = uuid.uuid4().hex[:8]
    small = rank_hosts == 1
    names = ["A", "B", "S"] if small else [*"ABCDEFGH"[:rank_hosts], "S"]
    made = [hosts.add_host(num_cpus=2, resources={f"{h}-{tag}": 1}) for h in names]
    a = made[0]
    config = _config(tmp, tag, watch=True).replace(warm_restart=True, rejoin_timeout_s=30.0)
    coordinator = Coordinator.start(config)
    actor = ray.remote(num_cpus=0)(WarmHostRank)
    env = {"env_vars": {"GLOO_SOCKET_IFNAME": "eth0"}}
    on = names[:2] if small else [h for h in names[:-1] for _ in range(2)]
    world = len(on)
    shape = f"{world} ranks on {len(names) - 1} host(s)"
    shards = ["0"] * world if small else [str(r % (world // 2)) for r in range(world)]

    def placed(h: str) -> Any:
        return actor.options(resources={f"{h}-{tag}": 0.1}, runtime_env=env).remote(config)

    ranks = [placed(h) for h in on]
    spares = [placed("S") for _ in range(1 if small else 2)]
    try:
        port = random.randint(20000, 40000)
        setups = [r.setup.remote(i, world, a.ip, port, shards[i]) for i, r in enumerate(ranks)]
        ray.get(setups, timeout=180)
        group = WarmGroup(coordinator, ranks, spares=spares, method="rejoin")
        ray.get([r.train.remote(3, 1 << 10) for r in ranks], timeout=60)
        wait_watched(coordinator, len(names) - 1)  # the ranks' hosts (a spare's has no agent)
        training = [r.train.remote(10**7, 1 << 10, 0.01) for r in ranks]
        time.sleep(0.5)  # a few steps in
        started = time.monotonic()
        hosts.fail(a, fault)
        try:
            restart = group.restart(timeout=90)
        except WarmRestartFailed as exc:  # said in the row; the next repetition still runs
            summary = exc.outcome.summary() if exc.outcome is not None else ""
            print(f"  warm restart failed: {exc.reason}\n  {summary}", flush=True)
            return {"fault": fault, "shape": shape, "failed": f"{exc.reason}; {summary}"[:600]}
        back_s = time.monotonic() - started
        ray.get([w.train.remote(1, 1 << 10) for w in group.workers], timeout=60)
        trained_s = time.monotonic() - started
        ray.wait(training[2:], timeout=5)
        return {
            "fault": fault,
            "shape": shape,
            "back_s": back_s,
            "trained_s": trained_s,
            "step": restart.step,
            "members": [m.was for m in restart.members],
            "source": restart.outcome.notices[0]["source"],
        }
    finally:
        for r in [*ranks, *spares]:
            ray.kill(r)
        coordinator.shutdown()
        for host in made:
            hosts.remove_host(host)


def _false_alarms(hosts: Any, tmp: str, times: int, hold: Any) -> dict[str, Any]:
    """One job with the host watch; ``hold(job)`` ``times`` times (a stall, a slow link), each
    followed by twice the detector's bound: the hosts it declared lost, the probes that found
    host A alive, and whether all four ranks still train."""
    import ray

    job = _Job(hosts, tmp, watch=True)
    try:
        for _ in range(times):
            hold(job)
            time.sleep(2 * (job.config.host_suspect_s + job.config.host_confirm_s))
        watch = job.coordinator.status()["host_watch"]
        return {
            "times": times,
            "false_alarms": len(watch["lost"]),
            "probed_alive": watch["alive_after_suspicion"],
            "still_training": not ray.wait(job.training, timeout=0)[0],
        }
    finally:
        job.end()


def _stalled(hosts: Any, seconds: float) -> Any:
    def hold(job: _Job) -> None:
        hosts.stall(job.a, seconds=seconds)
        time.sleep(seconds)

    return hold


def _slowed(hosts: Any, delay_ms: int, back_ms: int | None) -> Any:
    """Host A behind a link ``delay_ms`` slower to it (``back_ms`` from it) for four detector
    bounds, then healed."""

    def hold(job: _Job) -> None:
        hosts.slow(job.a, delay_ms=delay_ms, from_host_ms=back_ms or 0)
        time.sleep(4 * (job.config.host_suspect_s + job.config.host_confirm_s))
        hosts.heal(job.a)

    return hold


def bench_host_loss(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from benchmarks.hosts import HostCluster, netem_unavailable, unavailable
    from ray_graceful.tools.bench.kit import markdown_table, percentile

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"host-loss needs network namespaces: {reason}")
    runs, alarms, slow_alarms = [], None, None
    with tempfile.TemporaryDirectory(prefix="rg-host-loss-") as tmp, HostCluster() as hosts:
        for rep in range(args.reps):
            for fault in args.faults.split(","):
                for way in args.ways.split(","):
                    run = _one(hosts, tmp, fault, way)
                    print(f"  rep {rep} {fault} {way}: {run}", flush=True)
                    runs.append(run)
        warm = []
        for rep in range(args.warm_reps):
            for fault in args.faults.split(","):
                run = _warm_one(hosts, tmp, fault, args.warm_hosts)
                print(f"  warm rep {rep} {fault}: {run}", flush=True)
                warm.append(run)
        if args.stalls:
            alarms = _false_alarms(hosts, tmp, args.stalls, _stalled(hosts, args.stall_s))
            print(f"  stalls: {alarms}", flush=True)
        if args.slow_links:
            slowed = _slowed(hosts, args.slow_ms, args.slow_back_ms)
            slow_alarms = _false_alarms(hosts, tmp, args.slow_links, slowed)
            print(f"  slow links: {slow_alarms}", flush=True)
    rows = []
    for fault in args.faults.split(","):
        for way in args.ways.split(","):
            mine = [r for r in runs if r["fault"] == fault and r["way"] == way]
            if not mine:
                continue
            rel = [r["released_s"] for r in mine if r["released_s"] is not None]
            out = [r["outcome_s"] for r in mine if r["outcome_s"] is not None]
            committed = sum(r["result"] == "committed" for r in mine)
            rows.append([
                fault, way, len(mine),
                f"{percentile(rel, 0.5):.2f} / {max(rel):.2f}" if rel else "-",
                f"{percentile(out, 0.5):.2f} / {max(out):.2f}" if out else "-",
                f"{committed}/{len(mine)}",
                ", ".join(sorted({str(r["source"]) for r in mine})),
            ])  # fmt: skip
    header = ["fault", "way", "runs", "released p50 / max s", "outcome p50 / max s",
              "committed", "noticed by"]  # fmt: skip
    table = markdown_table(header, rows)
    if warm:
        warm_rows = []
        for fault in args.faults.split(","):
            tried = [r for r in warm if r["fault"] == fault]
            mine = [r for r in tried if "failed" not in r]
            back = [r["back_s"] for r in mine] or [float("nan")]
            trained = [r["trained_s"] for r in mine] or [float("nan")]
            warm_rows.append([
                fault, f"{len(mine)} of {len(tried)}",
                f"{percentile(back, 0.5):.2f} / {max(back):.2f}",
                f"{percentile(trained, 0.5):.2f} / {max(trained):.2f}",
                ", ".join(sorted({r["source"] for r in mine})),
            ])  # fmt: skip
        shape = f"{warm[0]['shape']}, spares on a host of their own"
        table += f"\n\nWarm, {shape} (seconds from the fault):\n\n" + (
            markdown_table(
                ["fault", "re-formed", "restart() p50 / max s", "first step p50 / max s", "by"],
                warm_rows,
            )
        )
    link = "tc netem" if netem_unavailable() is None else "a relay through user space"
    for what, found in (
        (f"Stalls of {args.stall_s:g} s", alarms),
        (
            f"Links {args.slow_ms} ms slower to the host"
            + (f" and {args.slow_back_ms} ms from it" if args.slow_back_ms else "")
            + f" ({link})",
            slow_alarms,
        ),
    ):
        if found is not None:
            table += (
                f"\n\n{what}: {found['false_alarms']} false alarms in {found['times']}; "
                f"probed and found alive {found['probed_alive']} times; the ranks "
                f"{'still training' if found['still_training'] else 'NOT training'} after."
            )
    return {
        "table": table,
        "runs": runs,
        "warm": warm,
        "false_alarms": alarms,
        "slow_false_alarms": slow_alarms,
    }
