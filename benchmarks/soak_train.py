"""``python -m benchmarks soak --train``: Ray Train's warm path, warm restarts back to back.

One real ``TorchTrainer`` for the whole run: three CPU workers on three nodes, gloo, SGD with
momentum (``train_job.warm_train_func``), ``GracefulTorchConfig`` and ``GracefulTrainCallback``
as docs/train.md has them. Each cycle SIGTERMs one worker - ranks 1 and 2 in turn, so rank 0's
process lives through every cycle, and each of the others through every other one - and waits
until Train's new worker joined the survivors and every rank trained a step past the join.

So a leak in a survivor (threads, descriptors, memory) grows over the whole run in rank 0's
process, and one in the coordinator in its.

Per cycle it records: the SIGTERMed process out by its deadline (else a hang), the warm
restart's result (``rejoined``, or its reason), the step joined at and where the new worker's
step came from, the time from the signal to every rank training again, whether the other two
workers kept their processes, the workers Ray recorded as crashes (the SIGTERMed one leaves
through Ray's intended exit), a torn checkpoint (the newest committed step does not verify),
and the resources of rank 0's process and of the coordinator. At the end of the run: whether
every rank ran every step exactly once, and whether every rank ended with the same model and
optimizer.

Nothing is simulated: real Train workers, signals, gloo groups, disk (and keepers with
``--memory-replicas 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from .soak import resources_table

WORKERS = 3
RESOURCES = (
    "rank0_rss_mb",
    "rank0_threads",
    "rank0_fds",
    "coordinator_rss_mb",
    "coordinator_threads",
    "coordinator_fds",
    "live_actors",
)
STEP_S = 0.1


def _lines(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [line.split() for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _pids(attempts: str) -> dict[int, int]:
    """Each rank's newest process (the attempt file: rank, "start", step, time, pid, ...)."""
    return {int(a[0]): int(a[4]) for a in _lines(attempts)}


def bench_soak_train(args: argparse.Namespace) -> dict[str, Any]:
    from ray_graceful.coordinator import Coordinator
    from ray_graceful.tools.bench.kit import local_cluster

    from .train_job import callback_config

    work = tempfile.mkdtemp(prefix="soak-train-")
    names = ("progress", "attempts", "final", "stop")
    files = {name: os.path.join(work, name) for name in names}
    config = callback_config(
        work,
        checkpoint_dir=os.path.join(work, "ckpt"),
        memory_replicas=args.memory_replicas,
        teardown_timeout_s=args.deadline,
        save_budget_s=args.deadline / 2,
    )
    cycles: list[dict[str, Any]] = []
    with local_cluster(extra_nodes=WORKERS, head_cpus=2, node_resources={"bench_slot": 1}):
        fit, box = _fit(work, files, config)
        coordinator = None
        try:
            _wait(lambda: len(_pids(files["attempts"])) == WORKERS, fit, 180, "the first start")
            coordinator = Coordinator.connect(config)
            for number in range(args.cycles):
                cycle = _one_cycle(coordinator, config, files, fit, number)
                cycle.update(_resources(coordinator, files["attempts"]), number=number)
                cycles.append(cycle)
                print(f"  train cycle {number}: {_line(cycle)}", flush=True)
            open(files["stop"], "w").close()  # every rank stops at one step, and the run ends
            fit.join(300)
        finally:
            if fit.is_alive():  # the run did not end: its actors go with the cluster
                print("  the run did not end within its time", flush=True)
    end = _the_end(box, files, fit.is_alive())
    return {"results": cycles, "end": end, "table": _report(cycles, end, args)}


def _fit(work: str, files: dict[str, str], config: Any) -> tuple[threading.Thread, dict[str, Any]]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_graceful.train import GracefulTorchConfig, GracefulTrainCallback

    from .train_job import warm_train_func

    trainer = TorchTrainer(
        warm_train_func,
        train_loop_config={
            "total": 10**9,  # until the soak's stop file
            "stop_file": files["stop"],
            "step_s": STEP_S,
            "progress": files["progress"],
            "attempt_file": files["attempts"],
            "final": files["final"],
        },
        scaling_config=ScalingConfig(
            num_workers=WORKERS, resources_per_worker={"CPU": 0, "bench_slot": 1}
        ),
        torch_config=GracefulTorchConfig(),
        run_config=RunConfig(
            storage_path=os.path.join(work, "storage"),
            name="soak",
            callbacks=[GracefulTrainCallback(config)],
            # Each replacement is one failure to Train (docs/train.md): one per cycle
            failure_config=FailureConfig(max_failures=-1),
        ),
    )
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = trainer.fit()
        except Exception as exc:  # recorded: the soak reports it
            box["error"] = f"{type(exc).__name__}: {exc}"

    fit = threading.Thread(target=run, name="soak-train-fit", daemon=True)
    fit.start()
    return fit, box


def _wait(condition: Any, fit: threading.Thread, timeout: float, what: str) -> None:
    until = time.monotonic() + timeout
    while not condition():
        if not fit.is_alive():
            raise RuntimeError(f"the run ended before {what}")
        if time.monotonic() > until:
            raise RuntimeError(f"not within {timeout:.0f}s: {what}")
        time.sleep(0.05)


def _one_cycle(
    coordinator: Any, config: Any, files: dict[str, str], fit: threading.Thread, number: int
) -> dict[str, Any]:
    from ray_graceful.checkpoint import latest_committed
    from ray_graceful.tools.bench.kit import process_alive, recorded_crashes

    victim = 1 + number % 2
    # Every rank trains: a step past the newest start (the previous cycle's join)
    past = max(int(a[2]) for a in _lines(files["attempts"])) + 3
    _wait(
        lambda: all(
            any(int(p[0]) == r and int(p[1]) >= past for p in _lines(files["progress"]))
            for r in range(WORKERS)
        ),
        fit,
        120,
        f"every rank past step {past}",
    )
    before = _pids(files["attempts"])
    t0 = time.time()
    os.kill(before[victim], signal.SIGTERM)
    out_by = t0 + config.teardown_timeout_s + 5.0
    while process_alive(before[victim]) and time.time() < out_by:
        time.sleep(0.02)
    record: dict[str, Any] = {"victim": victim, "out_s": time.time() - t0}
    record["hangs"] = int(process_alive(before[victim]))
    rejoined = coordinator.wait_rejoined(number + 1, timeout=120) or {}
    record["result"] = str(rejoined.get("result", "no warm restart"))
    record["reason"] = str(rejoined.get("reason", ""))[:120]
    record["step"] = rejoined.get("resume_step")
    loaded = {m["member"]: m.get("loaded_from") for m in rejoined.get("members", [])}
    record["new_worker_from"] = str(loaded.get(f"ray-train:train/{victim}", "-"))
    again = _training_again(files, fit, victim, before[victim], t0)
    record["training_again_s"] = again - t0 if again else float("nan")
    after = _pids(files["attempts"])
    record["kept"] = sum(1 for r in range(WORKERS) if r != victim and after[r] == before[r])
    record["crashes"] = recorded_crashes({before[victim]})
    record["durable_s"] = float("nan")
    if record["result"] == "rejoined" and config.memory_replicas > 0:
        with contextlib.suppress(Exception):  # the step the evicted cycle held, on disk
            durable = coordinator.wait_durable(number, timeout=60) or {}
            record["durable_s"] = float(durable["at"]) - t0 if "at" in durable else float("nan")
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    step = record["step"]
    record["torn"] = int(step is not None and (latest is None or latest.step < int(step)))
    return record


def _training_again(
    files: dict[str, str], fit: threading.Thread, victim: int, old_pid: int, t0: float
) -> float | None:
    """When every rank had done a step after the signal, the victim's in its new process."""
    until = time.monotonic() + 180
    while time.monotonic() < until and fit.is_alive():
        progress = [p for p in _lines(files["progress"]) if float(p[2]) > t0]
        firsts = {}
        for p in progress:
            rank, pid = int(p[0]), int(p[3])
            if rank == victim and pid == old_pid:
                continue  # its last steps before it parked
            firsts.setdefault(rank, float(p[2]))
        if len(firsts) == WORKERS:
            return max(firsts.values())
        time.sleep(0.05)
    return None


def _resources(coordinator: Any, attempts: str) -> dict[str, Any]:
    from ray_graceful.ray_adapter import live_actors
    from ray_graceful.tools.bench.kit import resident_mb

    pid = int(coordinator.stats()["pid"])
    rank0 = _pids(attempts)[0]
    return {
        "rank0_pid": rank0,
        "rank0_rss_mb": resident_mb(rank0),
        "rank0_threads": len(os.listdir(f"/proc/{rank0}/task")),
        "rank0_fds": len(os.listdir(f"/proc/{rank0}/fd")),
        "coordinator_rss_mb": resident_mb(pid),
        "coordinator_threads": len(os.listdir(f"/proc/{pid}/task")),
        "coordinator_fds": len(os.listdir(f"/proc/{pid}/fd")),
        "live_actors": live_actors(),
    }


def _the_end(box: dict[str, Any], files: dict[str, str], hung: bool) -> dict[str, Any]:
    """How the run ended: Train's error, each step once on every rank up to the step they all
    stopped at, and equal final states."""
    result = box.get("result")
    error = box.get("error") or (str(result.error) if result is not None and result.error else "")
    final = _lines(files["final"])
    last = int(final[0][1]) if final else -1
    progress = _lines(files["progress"])
    once = bool(final) and all(
        sorted(int(p[1]) for p in progress if int(p[0]) == r) == list(range(1, last + 1))
        for r in range(WORKERS)
    )
    equal = len(final) == WORKERS and len({(f[1], f[2]) for f in final}) == 1
    return {
        "hung": hung,
        "error": error[:300],
        "last_step": last,
        "every_step_once": once,
        "equal_final": equal,
    }


def _line(c: dict[str, Any]) -> str:
    why = f" ({c['reason']})" if c["reason"] else ""
    return (
        f"rank {c['victim']} SIGTERMed: out in {c['out_s']:.2f}s, {c['result']}{why} at step "
        f"{c['step']}, new worker's step from {c['new_worker_from']}, training again after "
        f"{c['training_again_s']:.2f}s (on disk after {c['durable_s']:.2f}s), kept "
        f"{c['kept']}/2, hangs {c['hangs']}, torn {c['torn']}, crashes {c['crashes']}; "
        f"rank 0 {c['rank0_rss_mb']:.0f} MB / "
        f"{c['rank0_threads']} threads / {c['rank0_fds']} fds, coordinator "
        f"{c['coordinator_rss_mb']:.0f} MB / {c['coordinator_threads']} threads"
    )


def _report(cycles: list[dict[str, Any]], end: dict[str, Any], args: argparse.Namespace) -> str:
    from ray_graceful.tools.bench.kit import markdown_table, percentile

    warm = [c for c in cycles if c["result"] == "rejoined"]
    row = [
        "train-warm-sigterm",
        len(cycles),
        sum(c["hangs"] for c in cycles),
        sum(c["torn"] for c in cycles),
        sum(c["crashes"] for c in cycles),
        f"{len(warm)} rejoined, {len(cycles) - len(warm)} not",
        f"{sum(c['kept'] for c in cycles)} of {2 * len(cycles)}",
        ", ".join(
            f"{n} {w}" for w, n in sorted(Counter(c["new_worker_from"] for c in cycles).items())
        ),
        percentile([c["training_again_s"] for c in warm], 0.5),
        max((c["training_again_s"] for c in warm), default=float("nan")),
    ]
    header = [
        "eviction", "cycles", "hangs", "torn", "Ray: crashes", "warm restarts",
        "survivors kept", "new worker's step from", "training again p50 s", "max s",
    ]  # fmt: skip
    text = markdown_table(header, [row])
    text += "\n\n" + resources_table(cycles, RESOURCES, args.warmup)
    lived = sum(1 for c in cycles if cycles and c["rank0_pid"] == cycles[-1]["rank0_pid"])
    text += (
        f"\n{len(cycles)} cycles, {WORKERS} Train workers on {WORKERS} nodes, "
        f"memory_replicas={args.memory_replicas}, deadline {args.deadline:.0f}s; rank 0's "
        f"process lived through {lived} of them; slopes over cycles "
        f"{args.warmup + 1}..{len(cycles)}. The run: "
        + ("did not end" if end["hung"] else f"Train's error: {end['error'] or 'none'}")
        + f"; {end['last_step']} steps, each once on every rank: {end['every_step_once']}; "
        "every rank's final "
        f"model and optimizer equal: {end['equal_final']}"
    )
    return text
