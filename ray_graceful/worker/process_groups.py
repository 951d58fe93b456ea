"""Which process group a rank is in, and how to let go of it without a collective.

``resolve_group`` finds rank, world size and group from arguments, then ``torch.distributed``,
then the ``RANK``/``WORLD_SIZE`` variables that SkyRL, OpenRLHF and verl all set, and checks that
they agree. ``release`` frees this rank's peers from any collective they are blocked in, with no
collective of its own: gloo connections are shut down (``gloo.py``); every other backend -
``nccl``, torch's new ``nccl2``, any backend that can abort - has its communicators aborted,
the API picked by capability, never by version number or ``isinstance``
(``torch_adapter.choose_abort``: torch's private names live there).

``shrink_group`` (torch >= 2.10, NCCL) is detected but not used: it builds a smaller group among
the survivors, which is itself a collective - and a collective on the exit path, with peers
that may be gone, is the hang this plugin exists to prevent.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import torch_adapter
from .gloo import GlooAddresses, read_group_addresses, shutdown_connections


class SetupError(RuntimeError):
    """graceful_setup was called wrongly; the message says what to do instead."""


@dataclass
class GroupHandle:
    """One (group, rank) this process holds."""

    name: str
    rank: int
    world_size: int
    process_group: Any = None
    backends: tuple[str, ...] = ()
    source: str = "arguments"
    gloo_addresses: GlooAddresses | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return (self.name, self.rank)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host``: a rendezvous port for ``init_process_group``.

    Picked below the kernel's ephemeral range and above Ray's worker ports (10002-19999 by
    default): a port the kernel hands out for ``bind(0)`` is in the ephemeral range, where any
    outgoing connection (Ray opens many) may take it before the store binds it.
    """
    low = 20000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = range(low, ephemeral_low)
    for port in random.sample(candidates, k=min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise SetupError(f"{name}={raw!r} in the environment is not an integer.") from None


def resolve_group(
    name: str,
    process_group: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> GroupHandle:
    """Resolve (rank, world size, group) for ``graceful_setup``; raise SetupError if wrong."""
    _check_arguments(name, rank, world_size)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise SetupError(
            "graceful_setup was called before torch.distributed.init_process_group(): there "
            "is no process group to release or destroy yet. Call it right after "
            "init_process_group(...) returns."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    try:
        pg_rank = dist.get_rank(group)
        pg_size = dist.get_world_size(group)
    except (RuntimeError, ValueError) as exc:
        raise SetupError(f"process_group={group!r} is not a usable process group: {exc}") from exc
    if pg_rank < 0:
        raise SetupError(
            "this process is not a member of process_group "
            f"{getattr(group, 'group_name', group)!r}; "
            "register only groups this rank belongs to."
        )
    if rank is not None and rank != pg_rank:
        raise SetupError(
            f"rank={rank} was passed, but torch.distributed says this process is rank {pg_rank} "
            f"of group {name!r}."
        )
    if world_size is not None and world_size != pg_size:
        raise SetupError(
            f"world_size={world_size} was passed, but torch.distributed says group {name!r} has "
            f"{pg_size} ranks."
        )
    source = (
        "torch.distributed" if rank is None else "arguments (checked against torch.distributed)"
    )
    handle = GroupHandle(name, pg_rank, pg_size, group, _backend_names(group), source)
    if process_group is None:
        handle.notes.extend(_environment_disagrees(pg_rank, pg_size))
    if "gloo" in handle.backends:
        try:
            handle.gloo_addresses = read_group_addresses(group)
        except Exception as exc:  # torch internals moved: release falls back to exiting
            handle.notes.append(f"gloo connections not identified ({exc!r}).")
        if handle.gloo_addresses is not None and not handle.gloo_addresses:
            handle.notes.append(
                "gloo connections not identified; peers are released when this process exits."
            )
    return handle


def _check_arguments(name: str, rank: int | None, world_size: int | None) -> None:
    if not isinstance(name, str) or not name.strip():
        raise SetupError(f"group name {name!r} is not allowed: give a non-empty string.")
    if "/" in name:
        raise SetupError(
            f"group name {name!r} is not allowed: '/' separates a group from its shard in a "
            f"checkpoint's keys ('group/shard'); give a name without it, e.g. "
            f"{name.replace('/', '-')!r}."
        )
    for label, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise SetupError(f"{label}={value!r} is not allowed: give an int or leave it out.")


def _environment_disagrees(pg_rank: int, pg_size: int) -> list[str]:
    """Notes where RANK / WORLD_SIZE in the environment differ from the default group's."""
    notes = []
    env_rank, env_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if env_rank is not None and env_rank != pg_rank:
        notes.append(
            f"RANK={env_rank} in the environment differs from torch.distributed's {pg_rank}; "
            "using torch.distributed's."
        )
    if env_size is not None and env_size != pg_size:
        notes.append(
            f"WORLD_SIZE={env_size} in the environment differs from torch.distributed's "
            f"{pg_size}; using torch.distributed's."
        )
    return notes


def _backend_names(group: Any) -> tuple[str, ...]:
    names: list[str] = []
    for backend in torch_adapter.process_group_backends(group).values():
        names.append(_name_of(backend))
    if not names:
        import torch.distributed as dist

        names = [part.split(":")[-1] for part in str(dist.get_backend(group)).split(",")]
    return tuple(dict.fromkeys(n.lower() for n in names))


def _name_of(backend: Any) -> str:
    name = getattr(backend, "name", None)
    return str(name() if callable(name) else name or type(backend).__name__).lower()


def release(handle: GroupHandle) -> list[str]:
    """Free peers blocked on this rank in ``handle``'s group; returns what was done."""
    return release_all([handle])


def release_all(handles: list[GroupHandle]) -> list[str]:
    """Free peers blocked on this rank in every group of ``handles``; returns what was done.

    Every communicator abort of every group runs at the same time, each on a thread of its own
    (as NVIDIA's resiliency library aborts its backends): ``ProcessGroupNCCL.abort()`` took about
    0.5 s per group on an H200, and a rank with a training and a weight-sync group paid it
    twice in a row. Gloo groups have no abort: their connections are shut down inline (a few
    syscalls). An abort that raises is reported with the rest, after every other one ran.
    """
    done: list[str] = []
    aborts: list[tuple[str, Callable[[], None]]] = []
    failed: list[str] = []
    for handle in handles:
        try:
            aborts.extend(_aborts_of(handle, done))
            if "gloo" in handle.backends:
                done.append(_shut_down_gloo(handle))
        except Exception as exc:  # one group's trouble never keeps the others held
            failed.append(f"{handle.name}: {type(exc).__name__}: {exc}")
    errors = run_at_once(aborts)
    done.extend(what for what, _ in aborts if what not in errors)
    if failed or errors:
        raise RuntimeError("; ".join([*failed, *errors.values(), *done]))
    return done


def _aborts_of(handle: GroupHandle, done: list[str]) -> list[tuple[str, Callable[[], None]]]:
    """How to abort each communicator of ``handle``'s group (gloo has none); a backend this
    torch cannot abort is noted in ``done``."""
    aborts = []
    for device_type, backend in torch_adapter.process_group_backends(handle.process_group).items():
        name = _name_of(backend)
        if name == "gloo":
            continue  # no abort: its connections are shut down
        choice = torch_adapter.abort_choice(handle.process_group, backend)
        if choice is None:
            done.append(f"{handle.name}: no abort for {name} in this torch; released at exit")
            continue
        how, abort = choice
        aborts.append((f"{handle.name}: {how} ({name}, {device_type})", abort))
    return aborts


def _shut_down_gloo(handle: GroupHandle) -> str:
    if not handle.gloo_addresses:
        return f"{handle.name}: gloo connections unknown; released at exit"
    count = shutdown_connections(handle.gloo_addresses)
    return f"{handle.name}: shut down {count} gloo connections"


def run_at_once(calls: list[tuple[str, Callable[[], None]]]) -> dict[str, str]:
    """Run every call at the same time (one inline when it is the only one); what raised, by
    name, with its error."""
    errors: dict[str, str] = {}

    def run(what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:
            errors[what] = f"{what}: {type(exc).__name__}: {exc}"

    if len(calls) <= 1:
        for what, call in calls:
            run(what, call)
        return errors
    threads = [
        threading.Thread(target=run, args=call, name="ray_graceful-abort", daemon=True)
        for call in calls
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
