"""What every benchmark shares: a private local cluster, one rank-actor base, percentiles, one
table printer and the results file.

Both sides use it: the package's own diagnostics (``ray-graceful bench release`` / ``save``)
and the project's harnesses in the repository's ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import logging
import math
import os
import platform
import select
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


def machine() -> dict[str, Any]:
    """What the figures were taken on: written into every results file."""
    import ray
    import torch

    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


class BenchError(RuntimeError):
    """A benchmark stage that cannot go on: the message says which rank and why."""


START_LIMIT_S = 60.0  # a rank not placed, or not in its group, by then is named, not waited on


def gpu_count() -> int:
    """The CUDA devices torch sees on this machine (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def rank_gpus(backend: str, ranks: int, gpus: int) -> float:
    """What each rank asks Ray for: nothing on gloo; on NCCL a whole GPU where the node has one
    per rank, else an equal share of them (several ranks on one GPU, ``GPU_SHARE``)."""
    if backend != "nccl":
        return 0.0
    if gpus <= 0:
        raise BenchError("--backend nccl needs a GPU, and torch sees none on this machine")
    if gpus >= ranks:
        return 1.0
    return math.floor(10_000 * gpus / ranks) / 10_000  # Ray counts in 1/10,000ths


def start_ranks(
    ray: Any,
    ranks: list[Any],
    join: Callable[[int, Any], Any],
    asks: str,
    limit_s: float = START_LIMIT_S,
) -> list[Any]:
    """Wait until every rank actor is placed, then for ``join(i, rank)`` of each; their results.

    Each wait is bounded by ``limit_s``: a rank that cannot be placed (it ``asks`` for what no
    node offers: a GPU on a cluster started without one) or does not join its group is named
    with the reason (``BenchError``), instead of a ``ray.get`` waiting out its 600 s.
    """
    ready = {r.__ray_ready__.remote(): i for i, r in enumerate(ranks)}
    _, pending = ray.wait(list(ready), num_returns=len(ready), timeout=limit_s)
    if pending:
        raise BenchError(
            f"rank(s) {sorted(ready[p] for p in pending)} not placed within {limit_s:.0f}s: each "
            f"asks {asks}; the cluster has {ray.available_resources()} free of "
            f"{ray.cluster_resources()}"
        )
    joins = [join(i, r) for i, r in enumerate(ranks)]
    _, pending = ray.wait(joins, num_returns=len(joins), timeout=limit_s)
    if pending:
        late = sorted(joins.index(p) for p in pending)
        raise BenchError(f"rank(s) {late} did not join the group within {limit_s:.0f}s")
    results = []
    for i, ref in enumerate(joins):
        try:
            results.append(ray.get(ref))
        except Exception as exc:
            raise BenchError(f"rank {i} could not join the group: {exc}") from exc
    return results


@contextlib.contextmanager
def local_cluster(
    extra_nodes: int = 0,
    head_cpus: int = 4,
    node_resources: dict[str, float] | None = None,
    object_store_bytes: int | None = None,
    num_gpus: int = 0,
) -> Iterator[tuple[Any, list[Any]]]:
    """A private multi-node Ray cluster on this machine, in its own temp directory, with the
    driver attached. The head carries the resource ``bench_head``, extra node ``i`` carries
    ``bench_n<i>`` (and ``node_resources``), so a benchmark can place each actor.

    ``num_gpus``: what every node offers (the machine's GPUs: the nodes share them). Ray's
    ``Cluster`` starts every node, the head included, with none unless told: an NCCL rank that
    asks for a GPU could never be placed.
    """
    work = tempfile.mkdtemp(prefix="ray-graceful-bench-")
    os.environ["RAY_TMPDIR"] = work
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "include_dashboard": False,
            "resources": {"bench_head": 1000},
            "object_store_memory": object_store_bytes,
            "num_gpus": num_gpus,
        },
    )
    nodes = [
        cluster.add_node(
            num_cpus=2,
            num_gpus=num_gpus,
            resources={f"bench_n{i}": 1000, **(node_resources or {})},
            object_store_memory=object_store_bytes,
        )
        for i in range(extra_nodes)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def nccl_host_id() -> str:
    """This process's own NCCL host id (``BenchRank.join_group``)."""
    return f"bench-{os.uname().nodename}-{os.getpid()}"


class BenchRank:
    """The base of every benchmark's rank actor: joins one process group and trains by
    all-reduces, asking ``should_stop`` at each step boundary.

    Here ``should_stop`` always says no (the job without the plugin); a subclass that adopts
    the plugin lists ``GracefulWorkerMixin`` first, and the plugin's ``should_stop`` answers.
    """

    step = 0
    backend = "gloo"
    extra_groups: tuple[Any, ...] = ()  # of every rank, all-reduced with the default each step

    def should_stop(self, step: int | None = None) -> bool:
        return False

    def update(self) -> None:
        """What a step does after its collectives (nothing here: a harness whose state must
        move, an optimizer's, overrides it)."""

    def join_group(
        self,
        rank: int,
        world: int,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        imports: tuple[str, ...] = (),
        groups: int = 1,
        addr: str = "127.0.0.1",
    ) -> int:
        """``imports`` first (a real training process's import graph, e.g. transformers), then
        ``init_process_group`` over TCP at rank 0's ``addr`` (this host unless the ranks are on
        several, as on ``benchmarks/hosts.py``'s); returns the process id.

        On NCCL each rank takes its own ``NCCL_HOSTID`` first: every rank of a benchmark runs
        on this one machine, several raylets sharing its GPUs, and NCCL refuses two ranks of one
        "host" on one device ("Duplicate GPU detected"). An id inherited from the driver (the
        raylet passes its environment on) would be shared by every rank.
        """
        import importlib

        import torch.distributed as dist

        for module in imports:
            importlib.import_module(module)
        if backend == "nccl":
            os.environ["NCCL_HOSTID"] = nccl_host_id()
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.backend = backend
        timeout = datetime.timedelta(seconds=timeout_s)
        self.extra_groups = tuple(
            dist.new_group(backend=backend, timeout=timeout) for _ in range(groups - 1)
        )
        return os.getpid()

    def train(self, steps: int, elements: int = 1 << 18, pause_s: float = 0.0) -> dict[str, Any]:
        """All-reduce ``elements`` float32s a step (1 MiB by default) until ``steps`` ran or
        ``should_stop`` said stop. A collective that raises ends the loop: what the rank saw
        is returned, not raised."""
        import torch
        import torch.distributed as dist

        tensor = torch.ones(elements, device="cuda" if self.backend == "nccl" else "cpu")
        try:
            for _ in range(steps):
                dist.all_reduce(tensor)
                for group in self.extra_groups:
                    dist.all_reduce(tensor, group=group)
                self.update()
                self.step += 1
                if self.should_stop(self.step):
                    break
                if pause_s:
                    time.sleep(pause_s)
        except Exception as exc:
            return {"released_at": time.time(), "error": str(exc)[-80:], "step": self.step}
        return {"released_at": time.time(), "error": None, "step": self.step}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """Rows as a Markdown table (rich, no colour), ready for docs/benchmarks.md: floats to 3
    decimals."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    grid = Table(box=box.MARKDOWN)
    for name in header:
        grid.add_column(name, justify="right", overflow="fold")
    for row in rows:
        grid.add_row(*(f"{c:.3f}" if isinstance(c, float) else str(c) for c in row))
    out = io.StringIO()
    Console(file=out, width=400, color_system=None, force_terminal=False).print(grid)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines() if line.strip())


class ExitWatch:
    """The moment each of ``pids`` ends, as the kernel reports it (a pidfd turns readable).

    One thread blocks in ``poll`` until a process ends: the harness spends no CPU while it
    waits. Polling ``/proc`` for 16 ranks every 2 ms, with a ``ray.wait`` each time, took a
    share of the two cores the ranks it times were leaving on. Where there are no pidfds
    (not Linux, a kernel before 5.3), the thread polls every 2 ms instead.
    """

    def __init__(self, pids: list[int]) -> None:
        self.gone: dict[int, float] = {}
        self.changed = threading.Event()
        self._stop = False
        self._fds: dict[int, int] = {}
        self._polled: list[int] = []
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                self.gone[pid] = time.time()
            except (AttributeError, OSError):  # no pidfds here: every process is polled
                for fd in self._fds:
                    os.close(fd)
                self._fds, self._polled = {}, [p for p in pids if p not in self.gone]
                break
        self._poll_round()  # one already gone is seen at once, whichever way
        run = self._run if not self._polled else self._poll_proc
        self._thread = threading.Thread(target=run, name="exit-watch", daemon=True)
        self._thread.start()

    def _poll_round(self) -> None:
        for pid in [p for p in self._polled if not process_alive(p)]:
            self._polled.remove(pid)
            self.gone.setdefault(pid, time.time())
            self.changed.set()

    def _poll_proc(self) -> None:
        while self._polled and not self._stop:
            time.sleep(0.002)
            self._poll_round()

    def _run(self) -> None:
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        while self._fds and not self._stop:
            for fd, _events in poller.poll(200):
                now = time.time()
                poller.unregister(fd)
                self.gone.setdefault(self._fds.pop(fd), now)
                os.close(fd)
                self.changed.set()
        for fd in self._fds:
            os.close(fd)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=1.0)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def resident_mb(pid: int) -> float:
    """The resident memory of process ``pid`` in MiB (``VmRSS``); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, every thread) process ``pid`` used so far; 0 when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def recorded_crashes(pids: set[int], wait_s: float = 5.0) -> int:
    """How many of ``pids`` (ended worker processes) Ray recorded as a worker crash
    (SYSTEM_ERROR), waiting up to ``wait_s`` for the GCS to record every end."""
    from ...ray_adapter import worker_exits

    if not pids:
        return 0
    give_up = time.monotonic() + wait_s
    recorded = worker_exits(pids)
    while len(recorded) < len(pids) and time.monotonic() < give_up:
        time.sleep(0.2)  # the GCS records a worker's end a moment after the process is gone
        recorded = worker_exits(pids)
    return sum(kind == "SYSTEM_ERROR" for kind in recorded.values())


def run_and_write(
    run: Callable[[argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
    name: str,
    program: str,
) -> int:
    """Run one benchmark, print its table, and write its results, the command that produced
    them and the machine to ``args.json`` (default ``bench-output/<name>.json``)."""
    command = " ".join([program, *sys.argv[1:]])
    started = time.time()
    out = run(args)
    out.update(
        {
            "benchmark": name,
            "command": command.strip(),
            "machine": machine(),
            "seconds": time.time() - started,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
        }
    )
    print(out["table"])
    path = args.json or os.path.join("bench-output", f"{name}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2, sort_keys=True, default=str)
    print(f"wrote {path}")
    return 0
