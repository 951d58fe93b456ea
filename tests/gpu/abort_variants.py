"""How long releasing a rank's NCCL groups takes, each way the installed torch offers.

    python tests/gpu/abort_variants.py [--ranks 3] [--reps 2] [--json PATH]

Each repetition of each variant starts ``--ranks`` fresh processes (sharing one GPU when there
are fewer GPUs than ranks: each takes its own ``NCCL_HOSTID``), each with two NCCL groups - the
world and a second group of every rank, as a training and a weight-sync group. Both are warmed
up by one all-reduce. Then rank 0 goes away without a word, and every other rank enqueues an
all-reduce it can never finish on each group, and releases its groups:

- ``sequential``: the backend's ``abort()`` of each group, one after the other (before);
- ``concurrent``: ``ray_graceful.worker.process_groups.release_all`` - every abort at once;
- ``world``: ``distributed_c10d._abort_process_group()`` (torch's private whole-world abort);
- ``shrink``: ``shrink_group([0], shrink_flags=SHRINK_ABORT)`` on the world group, where torch
  and NCCL (>= 2.27) have it: the survivors' new group, without the one that left.

Per rank the seconds the release took; the script prints one line per run and a table.
Needs CUDA; prints why and exits 0 without it (a stage of ``tests/gpu/run.sh``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

VARIANTS = ("sequential", "concurrent", "world", "shrink")


def _rank(rank: int, world: int, port: int, variant: str, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ray_graceful import torch_adapter
    from ray_graceful.worker.process_groups import GroupHandle, release_all

    os.environ["NCCL_HOSTID"] = f"abort-{os.getpid()}"  # several ranks may share one GPU
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
        device_id=device,
    )
    second = dist.new_group(backend="nccl")
    groups = [dist.group.WORLD, second]
    x = torch.ones(1 << 20, device=device)
    for group in groups:
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    dist.barrier(device_ids=[device.index])
    if rank == 0:
        queue.put((rank, variant, None, "left without a word"))
        time.sleep(30)  # present, but in no collective: the others are stuck on it
        os._exit(0)
    for group in groups:
        dist.all_reduce(x, group=group)  # enqueued; never completes without rank 0
    time.sleep(0.5)
    started = time.perf_counter()
    detail = ""
    try:
        if variant == "sequential":
            for group in groups:
                for backend in torch_adapter.process_group_backends(group).values():
                    backend.abort()
        elif variant == "concurrent":
            handles = [
                GroupHandle(f"g{i}", rank, world, g, ("nccl",)) for i, g in enumerate(groups)
            ]
            detail = "; ".join(release_all(handles))
        elif variant == "world":
            c10d._abort_process_group()
        else:
            shrink = getattr(c10d, "shrink_group", None)
            if shrink is None:
                raise RuntimeError("this torch has no shrink_group")
            shrink([0], shrink_flags=c10d.SHRINK_ABORT)
        seconds = time.perf_counter() - started
    except Exception as exc:
        seconds, detail = None, f"{type(exc).__name__}: {exc}"[:200]
    queue.put((rank, variant, seconds, detail))
    os._exit(0)


def run(variant: str, ranks: int, give_up_s: float) -> list[tuple]:
    """Every rank's ``(rank, variant, seconds, detail)``; a rank silent after ``give_up_s``
    (its release hung, or the watchdog ended it) is reported as hung, not waited on."""
    import torch.multiprocessing as mp

    from ray_graceful.worker.process_groups import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, variant, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results, give_up = [], time.monotonic() + give_up_s
    while len(results) < ranks and time.monotonic() < give_up:
        if not queue.empty():
            results.append(queue.get())
        elif all(p.exitcode is not None for p in procs):
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(1)
        if p.is_alive():
            p.kill()
    answered = {r[0] for r in results}
    for rank, p in enumerate(procs):
        if rank not in answered:
            how = f"exit {p.exitcode}" if p.exitcode is not None else "killed"
            results.append(
                (rank, variant, None, f"rank {rank} hung: no answer in {give_up_s:.0f} s ({how})")
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--give-up", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("abort variants: skipped, CUDA is not available here")
        return 0
    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}", flush=True)
    rows: dict[str, list[float]] = {}
    failures: dict[str, list[str]] = {}
    for rep in range(args.reps):
        for variant in args.variants.split(","):
            results = run(variant, args.ranks, args.give_up)
            timed = [r[2] for r in results if r[0] != 0 and r[2] is not None]
            said = sorted({r[3] for r in results if r[0] != 0 and r[3]})
            rows.setdefault(variant, []).extend(timed)
            if len(timed) < args.ranks - 1:
                failures.setdefault(variant, []).extend(said or ["a rank did not report"])
            print(f"  {variant} rep {rep}: {[round(t, 3) for t in timed]} {said}", flush=True)
    print("| variant | ranks timed | p50 s | max s | failed |")
    print("|---|---|---|---|---|")
    for variant, times in rows.items():
        p50 = f"{statistics.median(times):.3f}" if times else "-"
        worst = f"{max(times):.3f}" if times else "-"
        fails = "; ".join(sorted(set(failures.get(variant, [])))) or "-"
        print(f"| {variant} | {len(times)} | {p50} | {worst} | {fails} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": rows, "failures": failures}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
