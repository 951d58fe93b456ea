"""The step a group's ranks agree to stop at, before any of them is released from a collective.

Orders reach a group's ranks milliseconds apart. A rank told just before its ``should_stop(k)``
parks at k; a peer told just after its own ``should_stop(k)`` returned goes on into step k+1's
collective and waits there for the parked rank. Released from inside that step, the peer cannot
prove its state is step k: a warm restart's survivor then saves its shard and loads it back
instead of holding it, and the held path becomes a save-first one (issue 62: at 512 MB, 3 of
10 restarts took 2.2-4.2 s instead of 1.3 s).

So where the coordinator says every rank of the cycle will answer (``TeardownOrder``'s
``agree_stop_step``: a warm restart whose survivors may hold, no rank lost or FAULTY), each rank
says in its group's store where it can stop - step k when parked there, k+1 when inside the step
after k, k and no later when its thread left its loop - and, once every rank said so, the stop
step is the largest. A rank parked below it runs on (``should_stop`` returns False once) and
parks there; the others reach it. No collective is issued: the store is the TCP key-value store
the group already has (rank 0's ``TCPStore``, or the coordinator's for a warm group), a few
small calls per rank whatever the group's size.

Bounded: a rank that does not say where within the wait, or one that cannot move to the stop
step, ends the agreement, and every rank does what it did before: the peers are released from
their collectives.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable
from typing import Any

from .. import torch_adapter
from .process_groups import GroupHandle

# Ranks of one group that all take part in every step's collective are at most one step apart;
# the window of steps each rank looks at around its own leaves room for one more.
WINDOW = 2


@dataclasses.dataclass(frozen=True)
class Position:
    """Where one rank can stop: ``step``, and whether it can go on to a later one."""

    step: int
    can_run_on: bool  # False: its thread left its loop, so it stops at ``step`` or nowhere


def agree(
    groups: Iterable[GroupHandle], cycle: int, position: Position, timeout_s: float
) -> tuple[int | None, str]:
    """The stop step every rank of ``groups`` agreed on, and how it went in words; None where
    there is none: a rank did not say where within ``timeout_s``, a rank that cannot run on
    stops below the largest, or a store did not answer."""
    timeout_s = max(timeout_s, 0.0)
    agreed = position.step
    for handle in groups:
        try:
            step, why = _agree_in(handle, cycle, position, timeout_s)
        except Exception as exc:  # a store that has gone (its host ended): no agreement
            return None, f"group {handle.name!r}'s store did not answer ({type(exc).__name__})"
        if step is None:
            return None, why
        agreed = max(agreed, step)
    if agreed > position.step and not position.can_run_on:
        return None, f"this rank left its loop at step {position.step}; a peer is past it"
    return agreed, f"stop step {agreed} agreed (this rank was at {position.step})"


def all_parked(groups: Iterable[GroupHandle], cycle: int, timeout_s: float) -> str:
    """Say this rank is parked at the agreed step, and wait (bounded) until every rank is: a
    rank that aborts its communicators while a peer still finishes the step's collective would
    fail that peer out of it. How it went, in words."""
    for handle in groups:
        try:
            store = torch_adapter.group_store(handle.process_group)
            if store is None:
                return f"group {handle.name!r} has no store to say so in"
            prefix = f"ray_graceful/stop/{cycle}/parked/"
            said = _everyone_said(store, handle.world_size, prefix, timeout_s)
        except Exception as exc:
            return f"group {handle.name!r}'s store did not answer ({type(exc).__name__})"
        if said < handle.world_size:
            return f"{said} of {handle.world_size} ranks of group {handle.name!r} parked"
    return "every rank parked at it"


def _agree_in(
    handle: GroupHandle, cycle: int, position: Position, timeout_s: float
) -> tuple[int | None, str]:
    store = torch_adapter.group_store(handle.process_group)
    if store is None:
        return None, f"group {handle.name!r} has no store to agree in"
    prefix = f"ray_graceful/stop/{cycle}/"
    step = position.step
    store.add(f"{prefix}can/{step}", 1)
    if not position.can_run_on:
        store.add(f"{prefix}fixed/{step}", 1)
    said = _everyone_said(store, handle.world_size, f"{prefix}said/", timeout_s)
    if said < handle.world_size:
        return None, (
            f"{said} of {handle.world_size} ranks of group {handle.name!r} said where they "
            f"stop within {timeout_s:.2f}s"
        )
    later = [s for s in range(step, step + WINDOW + 1) if store.check([f"{prefix}can/{s}"])]
    agreed = max(later, default=step)
    stuck = [s for s in range(step - WINDOW, agreed) if store.check([f"{prefix}fixed/{s}"])]
    if stuck:
        return None, (
            f"a rank of group {handle.name!r} left its loop at step {stuck[0]}, below the "
            f"stop step {agreed} its peers need"
        )
    return agreed, ""


def _everyone_said(store: Any, world_size: int, prefix: str, timeout_s: float) -> int:
    """Count this rank under ``prefix`` in the group's ``store`` and wait until all
    ``world_size`` ranks counted; how many had when the wait ended. The last to count marks it
    done, so the others wait on one key (``Store.wait``) rather than poll the count."""
    if store.add(f"{prefix}count", 1) >= world_size:
        store.set(f"{prefix}all", b"1")
    try:
        store.wait([f"{prefix}all"], datetime.timedelta(seconds=max(timeout_s, 0.001)))
    except RuntimeError:  # torch's DistStoreError, on a timeout, is a RuntimeError
        return int(store.add(f"{prefix}count", 0))
    return world_size
