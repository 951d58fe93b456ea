"""Every torch-private name and gloo-store detail ray_graceful relies on, in one module.

``ray_adapter.py`` does the same for Ray. What torch does not offer publicly - the backend
objects behind a ``ProcessGroup``, aborting one group's communicators, the gloo listeners a
group published in its store, telling a frame inside ``torch.distributed`` apart - is reached
here and nowhere else, each by capability (``getattr``), never by version number, and each
degrading to "not available" rather than raising when torch moves it.

Checked against torch 2.13 (CPU wheel here; the CUDA wheel on the GPU machine, tests/gpu/).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# A frame whose file lies under this path is inside a torch.distributed call.
DISTRIBUTED_FRAME_MARKER = os.path.join("torch", "distributed", "")


def in_torch_distributed(filename: str) -> bool:
    """Whether a frame of ``filename`` is torch.distributed code (a collective, a store)."""
    return DISTRIBUTED_FRAME_MARKER in filename


def process_group_backends(group: Any) -> dict[str, Any]:
    """device type -> the backend object of a ``ProcessGroup`` (``_device_types``,
    ``_get_backend``: torch >= 2.0); {} where this torch has neither."""
    import torch

    found: dict[str, Any] = {}
    for device_type in getattr(group, "_device_types", []) or []:
        try:
            found[str(device_type).split(":")[0]] = group._get_backend(torch.device(device_type))
        except (RuntimeError, AttributeError, ValueError):
            continue
    return found


def choose_abort(
    process_group: Any, backend: Any, c10d: Any
) -> tuple[str, Callable[[], None]] | None:
    """Pick how to abort one group's communicators (NCCL and its kin), by what torch offers.

    Order: the backend's own ``abort()`` (per group, torch >= ~2.7; what NVIDIA's resiliency
    library calls), then ``c10d._abort_process_group(group)``, then ``ProcessGroup.abort()``.
    None when none exists: then the release is this process ending. ``c10d`` is
    ``torch.distributed.distributed_c10d`` (a stand-in in unit tests).
    """
    if backend is not None and callable(getattr(backend, "abort", None)):
        return (f"{type(backend).__name__}.abort()", backend.abort)
    abort_pg = getattr(c10d, "_abort_process_group", None)
    if callable(abort_pg):
        return ("distributed_c10d._abort_process_group(group)", lambda: abort_pg(process_group))
    if callable(getattr(process_group, "abort", None)):
        return ("ProcessGroup.abort()", process_group.abort)
    return None


def abort_choice(process_group: Any, backend: Any) -> tuple[str, Callable[[], None]] | None:
    """``choose_abort`` against this process's torch."""
    import torch.distributed.distributed_c10d as c10d

    return choose_abort(process_group, backend, c10d)


def gloo_listener_blobs(process_group: Any) -> list[bytes]:
    """What each rank of a gloo group published in the group's store about its listener.

    Gloo's rendezvous stores one value per rank under a key ending in the rank number; each
    value embeds the rank's listening ``sockaddr`` (``worker/gloo.py`` parses it). The store
    is the group's own (``get_group_store``, not part of torch's documented API).
    """
    store = process_group.get_group_store()
    return [bytes(store.get(key)) for key in store.list_keys() if key.rsplit("/", 1)[-1].isdigit()]


def group_store(process_group: Any) -> Any | None:
    """The store a group's ranks share (``ProcessGroup.get_group_store``, undocumented), for
    the world group when ``process_group`` is None; None where there is none to reach."""
    try:
        if process_group is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                return None
            process_group = dist.group.WORLD
        return process_group.get_group_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
