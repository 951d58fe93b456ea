"""``ray-graceful bench save``: the emergency save's throughput on a directory of yours,
against the same directory's raw sequential write speed and a plain ``torch.save``, measured
in the same run."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from .kit import markdown_table


def bench_save(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ...checkpoint import fsync_path, save_state_dict, write_shard

    directory = args.dir or tempfile.mkdtemp(prefix="save-")
    os.makedirs(directory, exist_ok=True)
    rows, results = [], []
    for mb in args.sizes:
        state = {f"layer{i}": torch.randn(mb * (1 << 20) // 4 // 16) for i in range(16)}
        nbytes = sum(t.numel() * 4 for t in state.values())
        chunk = bytearray(os.urandom(8 << 20))
        timings: dict[str, list[float]] = {
            "raw": [],
            "torch.save": [],
            "torch.save+fsync": [],
            "ray_graceful": [],
        }
        for rep in range(args.reps):
            path = os.path.join(directory, f"raw-{rep}")
            start = time.perf_counter()
            with open(path, "wb", buffering=0) as f:
                left = nbytes
                while left > 0:
                    left -= f.write(chunk[: min(len(chunk), left)])
                os.fsync(f.fileno())
            timings["raw"].append(time.perf_counter() - start)
            os.remove(path)

            path = os.path.join(directory, f"plain-{rep}.pt")
            start = time.perf_counter()
            torch.save(state, path)
            timings["torch.save"].append(time.perf_counter() - start)
            fsync_path(path)
            os.remove(path)

            path = os.path.join(directory, f"plainsync-{rep}.pt")
            start = time.perf_counter()
            torch.save(state, path)
            fsync_path(path)
            timings["torch.save+fsync"].append(time.perf_counter() - start)
            os.remove(path)

            start = time.perf_counter()

            def save(p: str, _step: int, state: Any = state) -> tuple[int, int]:
                return save_state_dict(state, p)

            record = write_shard(directory, rep, "bench", save)
            timings["ray_graceful"].append(time.perf_counter() - start)
            os.remove(os.path.join(directory, f"step-{rep:08d}", record.file))
        mbs = {k: nbytes / (1 << 20) / statistics.median(v) for k, v in timings.items()}
        results.append({"mb": mb, "bytes": nbytes, "seconds": timings, "mb_per_s": mbs})
        rows.append(
            [
                mb,
                mbs["raw"],
                mbs["torch.save"],
                mbs["torch.save+fsync"],
                mbs["ray_graceful"],
                f"{mbs['ray_graceful'] / mbs['raw'] * 100:.0f}%",
                f"{mbs['ray_graceful'] / mbs['torch.save+fsync'] * 100:.0f}%",
            ]
        )
        state.clear()  # free this size's tensors before the next
    table = markdown_table(
        [
            "MB",
            "raw MB/s",
            "torch.save MB/s",
            "torch.save+fsync MB/s",
            "ray_graceful MB/s",
            "of raw",
            "of torch.save+fsync",
        ],
        rows,
    )
    table += (
        f"\ndirectory: {directory}; ray_graceful = torch.save to a temp name, its fsync beside "
        "a CRC32 read-back, rename, directory fsync"
    )
    return {"results": results, "table": table}
