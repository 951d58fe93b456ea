"""``python -m benchmarks save --format dcp``: the emergency DCP save against PyTorch's own
collective save.

One run, per state size (the whole state, 16 float32 tensors sharded by rows over ``--ranks``
ranks as DTensors - FSDP2's layout), each repetition in alternating order:

- **emergency dcp**: each rank's ``dcp_saver`` through ``write_shard`` (its local chunks, no
  collective, fsynced, renamed into place - what a rank's teardown runs), then ``commit`` (the
  global ``.metadata`` assembled, the manifest last - what the coordinator runs). Its time is
  the slowest rank's save plus the commit;
- **dcp.save**: ``torch.distributed.checkpoint.save`` of the same state - collective: every rank
  plans, rank 0 writes ``.metadata`` (``FileSystemWriter``'s default ``sync_files=True``). It
  needs every rank alive, which is what an eviction does not give. Its time is the slowest
  rank's;
- **default saver**: each rank's local tensors with ``torch.save`` through ``write_shard``
  (today's ``state_dict=`` saver; not loadable at another world size).

After each size's last repetition the emergency checkpoint is loaded with ``dcp.load`` into a
fresh state sharded over ``--load-ranks`` ranks, and every tensor is compared bitwise with the
state that was saved (regenerated from its seed).

Real: gloo processes (``torch.multiprocessing``), DCP, the file system, fsync. Ray is not
involved: the save path is the rank's and the commit the coordinator's, called directly - a
cluster would add the order's delivery, not save time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from ray_graceful.tools.bench.kit import markdown_table

WAYS = ("emergency dcp", "dcp.save", "default saver")
TENSORS = 16
COLUMNS = 1024  # float32: 4 KiB a row


def bench_save_dcp(args: argparse.Namespace) -> dict[str, Any]:
    """Every way at every size in one run; see the module."""
    root = args.dir or tempfile.mkdtemp(prefix="save-dcp-")
    os.makedirs(root, exist_ok=True)
    try:
        return _run(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from ray_graceful.worker.process_groups import free_port

    context = mp.get_context("spawn")
    rows, results = [], []
    for mb in args.sizes:
        queue = context.SimpleQueue()
        mp.spawn(
            _save_rank,
            args=(args.ranks, free_port(), root, mb, args.reps, queue),
            nprocs=args.ranks,
        )
        timings, checkpoint = queue.get()
        queue = context.SimpleQueue()
        mp.spawn(
            _load_rank,
            args=(args.load_ranks, free_port(), checkpoint, mb, queue),
            nprocs=args.load_ranks,
        )
        equal, load_s = queue.get()
        shutil.rmtree(os.path.dirname(os.path.dirname(checkpoint)), ignore_errors=True)
        medians = {way: statistics.median(timings[way]) for way in WAYS}
        results.append(
            {"mb": mb, "seconds": timings, "load_bitwise_equal": equal, "load_s": load_s}
        )
        for way in WAYS:
            rows.append(
                [
                    mb,
                    way,
                    medians[way],
                    max(timings[way]),
                    mb / medians[way],
                    f"{(medians[way] / medians['dcp.save'] - 1) * 100:+.0f}%",
                    ("yes" if equal else "NO") if way == "emergency dcp" else "",
                ]
            )
    table = markdown_table(
        [
            "MB",
            "way",
            "p50 s",
            "max s",
            "MB/s",
            "vs dcp.save",
            f"dcp.load at {args.load_ranks} ranks bitwise",
        ],
        rows,
    )
    table += (
        f"\n{args.ranks} saving ranks, {args.reps} repetitions, order alternated; directory "
        f"{root}. emergency dcp = slowest rank's save + the commit (metadata assembly, manifest)"
    )
    return {"results": results, "table": table}


def _state(mb: int, mesh: Any, placements: Any) -> dict[str, Any]:
    """The benchmark's state: each tensor from its own seed, sharded over ``mesh``."""
    from torch.distributed.tensor import distribute_tensor

    return {f"layer{i}": distribute_tensor(_full(mb, i), mesh, placements) for i in range(TENSORS)}


def _rows(mb: int) -> int:
    """Rows of each tensor: ``mb`` MB in all, over ``TENSORS`` tensors of ``COLUMNS`` floats."""
    return mb * (1 << 20) // 4 // TENSORS // COLUMNS


def _full(mb: int, index: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(mb * 1000 + index)
    return torch.randn(_rows(mb), COLUMNS, generator=generator)


def _save_rank(rank: int, world: int, port: int, root: str, mb: int, reps: int, queue: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from ray_graceful.checkpoint import commit, save_state_dict, write_shard
    from ray_graceful.dcp import dcp_saver

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mb, mesh, [Shard(0)])
    local = {k: v.to_local() for k, v in state.items()}
    saver = dcp_saver(lambda: state)
    timings: dict[str, list[float]] = {way: [] for way in WAYS}
    keep = ""
    for rep in range(reps):
        order = WAYS if rep % 2 == 0 else WAYS[::-1]
        for way in order:
            where = os.path.join(root, f"{way.replace(' ', '-').replace('.', '-')}-{rep}")
            dist.barrier()
            started = time.perf_counter()
            if way == "dcp.save":
                dcp.save(state, checkpoint_id=where)
            elif way == "emergency dcp":
                record = write_shard(where, rep, f"state/{rank}", saver)
            else:
                record = write_shard(
                    where, rep, f"state/{rank}",
                    lambda p, step: save_state_dict({"step": step, "state": local}, p),
                )  # fmt: skip
            elapsed = time.perf_counter() - started
            slowest = [0.0] * world
            dist.all_gather_object(slowest, elapsed)
            records = [None] * world
            dist.all_gather_object(records, record if way != "dcp.save" else None)
            if rank == 0:
                total = max(slowest)
                if way == "emergency dcp":
                    started = time.perf_counter()
                    path = commit(where, rep, [f"state/{r}" for r in range(world)], records, 0)
                    total += time.perf_counter() - started
                timings[way].append(total)
                if way == "emergency dcp" and rep == reps - 1:
                    keep = os.path.join(os.path.dirname(path), "dcp-state")
                else:
                    shutil.rmtree(where, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        queue.put((timings, keep))
    dist.destroy_process_group()


def _load_rank(rank: int, world: int, port: int, checkpoint: str, mb: int, queue: Any) -> None:
    """A fresh zero state sharded over ``world`` ranks, ``dcp.load``-ed, compared bitwise."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    state = {
        f"layer{i}": distribute_tensor(torch.zeros(_rows(mb), COLUMNS), mesh, [Shard(0)])
        for i in range(TENSORS)
    }
    started = time.perf_counter()
    dcp.load(state, checkpoint_id=checkpoint)
    load_s = time.perf_counter() - started
    equal = True
    for i in range(TENSORS):
        whole = state[f"layer{i}"].full_tensor()  # a collective: every rank calls it
        if rank == 0:
            equal = equal and torch.equal(whole, _full(mb, i))
    if rank == 0:
        queue.put((equal, load_s))
    dist.destroy_process_group()
