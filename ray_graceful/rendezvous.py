"""The store a warm restart re-forms its groups through: one per job, outliving every group.

Measured on these machines (``docs/concepts.md``, "Warm restart"): destroying and re-forming a
gloo group of 8 CPU ranks in the same processes takes 78 ms at p50 when every cycle goes
through one long-lived ``TCPStore`` under its own ``PrefixStore``; a new store per cycle,
hosted by rank 0, took about 5 s one cycle in ten (a client that connects before the new server
listens backs off). So the coordinator hosts one store, on its node (the driver's: the least
likely to be evicted, and never a node a notice named), and every cycle and group gets its own
prefix - a rank of an older cycle cannot join a newer group, whatever it still believes.

Only public torch API is used here: ``TCPStore``, ``PrefixStore``, ``init_process_group``.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

from .protocol import Rendezvous

_hosted: list[Any] = []  # the store this process hosts: kept alive for the process's life
_clients: dict[tuple[str, int], Any] = {}  # this process's connection to each store
_lock = threading.Lock()


def host_store() -> tuple[str, int]:
    """Host the job's store in this process (the coordinator's), once; its (host, port)."""
    import ray
    import torch.distributed as dist

    with _lock:
        if not _hosted:
            host = ray.util.get_node_ip_address()
            store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, use_libuv=True, multi_tenant=True
            )
            _hosted.append((host, store))
        host, store = _hosted[0]
        return host, int(store.port)


def _client(host: str, port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    with _lock:
        store = _clients.get((host, port))
        if store is None:
            store = dist.TCPStore(
                host,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                use_libuv=True,
            )
            _clients[(host, port)] = store
        return store


def form_group(rendezvous: Rendezvous, backend: str) -> None:
    """Join this process to the next cycle's group: ``init_process_group`` through the store.

    Bounded by ``rendezvous.timeout_s``: a member that never arrives (a spare that died) makes
    the others fail here with a timeout, and leave cleanly, rather than wait.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    client = _client(rendezvous.store_host, rendezvous.store_port, rendezvous.timeout_s)
    store = dist.PrefixStore(rendezvous.prefix, client)
    dist.init_process_group(
        backend,
        store=store,
        rank=rendezvous.rank,
        world_size=rendezvous.world_size,
        timeout=timeout,
        device_id=eager_device(backend),
    )


def eager_device(backend: str, cuda: Any = None) -> Any:
    """The device an NCCL group's communicator is built on at once, inside the rendezvous
    (``init_process_group(device_id=...)``); None for gloo or where CUDA is not in use.

    Without it NCCL builds the communicator lazily, at the group's first collective: about
    0.6 s of the 1.48 s from a SIGTERM to a warm-restarted group's first step on an H100
    (docs/benchmarks.md). ``cuda``: ``torch.cuda`` (a stand-in in unit tests).
    """
    if "nccl" not in backend:
        return None
    import torch

    cuda = torch.cuda if cuda is None else cuda
    if not cuda.is_available():
        return None
    return torch.device("cuda", cuda.current_device())
