"""The GPU paths: NCCL abort, a bounded CUDA drain, NVML against a real driver.

Skipped where ``torch.cuda.is_available()`` is false (CI and the development machines have no
GPU). Run on a GPU machine with ``bash tests/gpu/run.sh`` (README, "On a GPU"). Several NCCL
ranks share one GPU when each process has its own ``NCCL_HOSTID`` (``GPU_SHARE=1`` in
``../shared/tools/gpu-bundle``'s setup): multi-rank tests need two GPUs or that.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from tests.helpers import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHARED = os.environ.get("GPU_SHARE") == "1"
RANKS_FIT = torch.cuda.is_available() and (torch.cuda.device_count() >= 2 or SHARED)


def _device(rank: int) -> int:
    return rank % torch.cuda.device_count()


def _init_nccl(rank: int, world: int, port: int) -> None:
    """This process as NCCL rank ``rank`` (GPU_SHARE: several ranks on one GPU)."""
    import torch.distributed as dist

    if SHARED:
        os.environ["NCCL_HOSTID"] = f"host-{os.getpid()}"
    torch.cuda.set_device(_device(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", _device(rank)),
    )


def _nccl_rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from ray_graceful.worker.process_groups import release, resolve_group

    _init_nccl(rank, world, port)
    handle = resolve_group("nccl-test")
    extra = dist.new_group(backend="nccl")  # a weight-sync group beside the training group
    extra_handle = resolve_group("weight-sync", process_group=extra)
    queue.put(("backends", rank, handle.backends))
    if rank == 0:
        faulthandler.dump_traceback_later(60)  # a hang shows where, in the test's output

        def release_both() -> None:
            try:
                queue.put(("released", release(handle) + release(extra_handle)))
            except Exception as exc:  # said, not lost in a thread
                queue.put(("released", [f"raised {exc!r}"]))

        releaser = threading.Timer(1.0, release_both)
        releaser.start()
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4, device="cuda"))  # the peer never joins
            torch.cuda.synchronize()
            queue.put(("rank0", "returned", time.monotonic() - start))
        except Exception as exc:
            queue.put(("rank0", type(exc).__name__, time.monotonic() - start))
        releaser.join(60)
        faulthandler.cancel_dump_traceback_later()
    else:
        time.sleep(5)


@pytest.mark.skipif(not RANKS_FIT, reason="multi-rank NCCL needs two GPUs or GPU_SHARE=1")
@pytest.mark.timeout(120)
def test_nccl_abort_releases_a_blocked_collective():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    events = {}
    while not {"rank0", "released"} <= events.keys():  # either may come first
        item = queue.get(timeout=90)
        events[item[0] if item[0] != "backends" else f"backends{item[1]}"] = item
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert {"nccl", "nccl2"} & set(events["backends0"][2]), events["backends0"]
    released = events["released"][1]
    assert sum("abort" in line for line in released) >= 2, ("both groups aborted", released)
    print("released:", released, "rank 0 out after", events["rank0"])
    # Released 1 s after the collective began: out within 1 s of the abort.
    assert events["rank0"][2] < 2.0, "the blocked all-reduce ended within 1 s of the abort"


def _teardown_on_gpu(queue) -> None:
    import torch.distributed as dist

    import ray_graceful
    from ray_graceful import GracefulConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.ones(4, device="cuda"))
    ray_graceful.after_init_process_group("gpu", config=GracefulConfig(report_dir="/tmp/rg-gpu"))
    teardown = ray_graceful.teardown_now("test", exit_process=False)
    teardown.done.wait(30)
    queue.put(teardown.report.to_dict())


@pytest.mark.timeout(120)
def test_teardown_on_a_gpu_aborts_nccl_and_drains_cuda():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_teardown_on_gpu, args=(queue,))
    proc.start()
    report = queue.get(timeout=90)
    proc.join(30)
    steps = {s["name"]: s for s in report["phases"]}
    assert steps["release_peers"]["status"] == "ran"
    assert "abort" in steps["release_peers"]["detail"], steps["release_peers"]
    assert steps["drain_device"]["status"] == "ran", steps["drain_device"]
    assert steps["destroy_process_group"]["status"] in ("ran", "failed")
    # Not stuck (no loop inside a collective): the device is drained before the abort.
    names = [s["name"] for s in report["phases"]]
    assert names.index("drain_device") < names.index("release_peers"), names


def _parked_ahead_rank(rank: int, world: int, port: int, queue) -> None:
    """Rank 1's host runs ahead of its device into all-reduces rank 0 never joins, then its
    teardown runs as at a step boundary (no training loop registered: quiescent)."""
    import torch.distributed as dist

    import ray_graceful
    from ray_graceful import GracefulConfig

    _init_nccl(rank, world, port)
    x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[_device(rank)])
    if rank == 0:
        time.sleep(40)  # present, but in no collective: rank 1's queue never drains
        os._exit(0)
    for _ in range(8):
        dist.all_reduce(x)  # returns at enqueue: the host is ahead of the device
    config = GracefulConfig(report_dir="/tmp/rg-gpu", cuda_sync_timeout_s=1.0)
    ray_graceful.after_init_process_group("parked", config=config)
    started = time.monotonic()
    teardown = ray_graceful.teardown_now("test", exit_process=False)
    finished = teardown.done.wait(30)
    queue.put((finished, time.monotonic() - started, teardown.report.to_dict()))
    queue.close()
    queue.join_thread()  # the put is made by a feeder thread: flushed before the hard exit
    os._exit(0)


@pytest.mark.skipif(not RANKS_FIT, reason="multi-rank NCCL needs two GPUs or GPU_SHARE=1")
@pytest.mark.timeout(120)
def test_a_rank_parked_ahead_of_its_device_is_released_within_the_drain_bound():
    """A loop that never waits on the device parks with collectives still queued that a
    departed peer never joins: the drain gives up at its bound, every communicator is aborted,
    and the teardown ends - it neither hangs nor waits for the watchdog."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_parked_ahead_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        finished, seconds, report = queue.get(timeout=100)
    finally:
        for p in procs:
            p.join(1)
            if p.is_alive():
                p.kill()
    steps = {s["name"]: s for s in report["phases"]}
    print("parked ahead:", seconds, {n: (s["status"], s["detail"][:90]) for n, s in steps.items()})
    assert finished, report
    assert steps["drain_device"]["status"] == "failed", steps["drain_device"]
    assert "had not finished" in steps["drain_device"]["detail"], steps["drain_device"]
    assert steps["release_peers"]["status"] == "ran", steps["release_peers"]
    assert seconds < 6.0, "1 s of drain, then the abort: well inside the teardown's deadline"


def test_our_own_abort_never_makes_the_gpu_faulty():
    """Every NCCL abort logs XID 45; the probe, registered before, must not call it a fault."""
    from ray_graceful.config import GracefulConfig
    from ray_graceful.health import DEGRADED, FAULTY
    from ray_graceful.health.nvml import NvmlProbe

    config = GracefulConfig()
    probe = NvmlProbe(
        [0], config.fatal_xids, config.degraded_xids, config.ignored_xids, required=True
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_teardown_on_gpu, args=(queue,))
    proc.start()
    queue.get(timeout=90)
    proc.join(30)
    time.sleep(1.0)  # the driver logs the XID asynchronously
    report = probe.check()
    probe.close()
    print("after our abort:", report.summary(), report.checks)
    assert report.verdict not in (FAULTY, DEGRADED), report


def test_nvml_probe_reads_a_real_driver():
    """A healthy GPU is HEALTHY, with every check it rests on listed, and the cost measured."""
    from ray_graceful.health import HEALTHY
    from ray_graceful.health.nvml import NvmlProbe

    probe = NvmlProbe(list(range(torch.cuda.device_count())), required=True)
    reports = [probe.check() for _ in range(20)]
    probe.close()
    report = reports[-1]
    print("nvml:", report.summary(), report.checks)
    costs = sorted(r.seconds for r in reports)
    print(f"nvml check cost: p50 {costs[10] * 1000:.2f} ms, max {costs[-1] * 1000:.2f} ms")
    assert report.verdict == HEALTHY, report
    names = {c.split(":")[0].split(".")[-1] for c in report.checks}
    assert {"xid_events", "recovery_action", "ecc", "row_remap", "retired_pages", "nvlink"} <= (
        names
    ), report.checks


def _warm_rank(rank: int, world: int, port: int, store_port: int, queue) -> None:
    """Abort a blocked NCCL collective, destroy the group, re-form it in the same process."""
    import torch.distributed as dist

    from ray_graceful.protocol import Rendezvous
    from ray_graceful.rendezvous import form_group
    from ray_graceful.worker.process_groups import release, resolve_group

    _init_nccl(rank, world, port)
    kept = torch.full((1024,), float(rank), device="cuda")  # lives through the restart
    handle = resolve_group("warm")
    if rank == 0:
        threading.Timer(1.0, lambda: release(handle)).start()
        try:
            dist.all_reduce(torch.ones(4, device="cuda"))  # the peer never joins: aborted
            torch.cuda.synchronize()
        except Exception:
            pass
    else:
        time.sleep(2.0)
        release(handle)
    dist.destroy_process_group()
    start = time.monotonic()
    form_group(
        Rendezvous(
            "join",
            cycle=1,
            group="warm",
            rank=rank,
            world_size=world,
            store_host="127.0.0.1",
            store_port=store_port,
            prefix="ray_graceful/cycle1/warm",
            timeout_s=60,
        ),
        "nccl",
    )
    x = torch.tensor([float(rank + 1)], device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    queue.put((rank, x.item(), kept.sum().item(), time.monotonic() - start))
    dist.destroy_process_group()


@pytest.mark.skipif(not RANKS_FIT, reason="multi-rank NCCL needs two GPUs or GPU_SHARE=1")
@pytest.mark.timeout(180)
def test_nccl_group_reforms_in_the_same_processes_after_an_abort():
    """Warm restart on NCCL: abort, destroy_process_group, init again - CUDA context kept."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_warm_rank, args=(r, 2, port, store.port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=150) for _ in procs)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    print("re-formed:", results)
    assert [r[1] for r in results] == [3.0, 3.0]  # the new group's all-reduce sums 1 + 2
    assert [r[2] for r in results] == [0.0, 1024.0]  # tensors from before are still valid
