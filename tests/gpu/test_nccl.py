"""The GPU paths: NCCL abort, a bounded CUDA drain, NVML against a real driver.

Skipped where ``torch.cuda.is_available()`` is false (CI and the development machines have no
GPU). Run on a GPU machine with ``pytest tests/gpu``; multi-rank NCCL needs two GPUs.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from tests.helpers import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _nccl_rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from ray_graceful.process_groups import release, resolve_group

    torch.cuda.set_device(rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", rank),
    )
    handle = resolve_group("nccl-test")
    queue.put(("backends", rank, handle.backends))
    if rank == 0:
        threading.Timer(1.0, lambda: queue.put(("released", release(handle)))).start()
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4, device="cuda"))  # the peer never joins
            torch.cuda.synchronize()
            queue.put(("rank0", "returned", time.monotonic() - start))
        except Exception as exc:
            queue.put(("rank0", type(exc).__name__, time.monotonic() - start))
    else:
        time.sleep(5)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="multi-rank NCCL needs two GPUs")
@pytest.mark.timeout(120)
def test_nccl_abort_releases_a_blocked_collective():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    events = {}
    while "rank0" not in events:
        item = queue.get(timeout=90)
        events[item[0] if item[0] != "backends" else f"backends{item[1]}"] = item
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert "nccl" in events["backends0"][2]
    assert any("abort" in line for line in events["released"][1]), events["released"]
    assert events["rank0"][2] < 30, "the blocked all-reduce ended soon after the abort"


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
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["release_peers"]["status"] == "ran"
    assert "abort" in steps["release_peers"]["detail"], steps["release_peers"]
    assert steps["drain_device"]["status"] == "ran", steps["drain_device"]
    assert steps["destroy_process_group"]["status"] in ("ran", "failed")


def test_nvml_probe_reads_a_real_driver():
    from ray_graceful.health import UNKNOWN
    from ray_graceful.health.nvml import NvmlProbe

    probe = NvmlProbe(list(range(torch.cuda.device_count())), required=True)
    report = probe.check()
    probe.close()
    assert report.verdict != UNKNOWN or all(r.code == "nvml_error" for r in report.reasons), report
    print(report.summary())
