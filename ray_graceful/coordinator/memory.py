"""The memory tier, on the coordinator's side: keepers, where shards go, the durable copy.

With ``memory_replicas > 0`` the coordinator starts a keeper on every node that registers ranks
(pinned there, owned by the coordinator: it lives as long as the job's coordinator). When a
plan is made, each save assignment names the keepers to hand the shard to - surviving, not
FAULTY nodes (``memory/placement.py``). A cycle whose shards are all held commits in memory
(``memory/commit.py``); the keepers then write the shards to ``checkpoint_dir`` in the
background and the manifest goes last, with today's guarantees. The copy landing is a record
of its own (``wait_durable``, ``durable-cycle-N.json``): the cycle's outcome is never rewritten.
An older memory checkpoint is released once a newer one is durable; the shards of a cycle that
did not commit are released at once.

A keeper's own node can be evicted later (a drain, a notice naming it, a plan evicting its
ranks): what it holds is handed on to a keeper that stays, before that node's deadline, and no
new shard goes there. Where no keeper can take a shard, the durable copy has to land first; a
shard left with no holder and no durable copy ends the memory checkpoint (``lost``), so a
restart never mixes its step with an older one. What the memory checkpoint went through (handed
on, lost) is its record (``record``, ``memory-cycle-N.json``), rewritten as it changes.

An owned part of the coordinator, free of Ray: keepers come from an injected factory and are
called through ``memory/keeper.py``'s ``RemoteKeeper`` shape, so the unit tests give it fakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from ..checkpoint import CheckpointError, ShardRecord, commit
from ..config import GracefulConfig
from ..memory.commit import MemoryCheckpoint
from ..memory.keeper import keeper_name
from ..memory.placement import choose_holders
from ..place import Place

logger = logging.getLogger(__name__)

KEEPER_PING_S = 5.0  # a keeper that does not answer a ping in this long cannot serve a restart
HOLDERS_FRESH_S = 5.0  # a restarted group's ranks ask at once: one check serves them all


class HoldAnswer(Protocol):
    """A keeper's answer to ``hold``: held, or refused and why (``keeper.ShardKept``)."""

    @property
    def accepted(self) -> bool: ...

    @property
    def reason(self) -> str: ...


class KeeperClient(Protocol):
    """What the tier calls on a keeper (``memory/keeper.py``: ``RemoteKeeper``)."""

    async def hold(self, *args: Any) -> HoldAnswer: ...

    async def fetch(self, step: int, shard_key: str) -> list[Any] | None: ...

    async def persist(self, root: str, step: int, shard_key: str) -> dict[str, Any]: ...

    def release(self, below_step: int | None = None, cycle: int | None = None) -> None: ...

    async def ping(self) -> str: ...

    async def stats(self) -> dict[str, Any]: ...


KeeperFactory = Callable[[str, str], KeeperClient]  # (keeper name, node id) -> a started keeper
Publish = Callable[[str, dict[str, Any]], None]  # (record name, record) -> written
# (durable_summary(), whether this copy failed every try), after each durable copy ended
DurableChanged = Callable[[dict[str, Any], bool], None]

# A durable copy that fails is tried again, a bounded number of times: a full disk or a
# replaced directory may be put right by an operator, and until then no step is durable.
DURABLE_TRIES = 3
DURABLE_RETRY_S = (2.0, 8.0)  # the waits before the second and the third try
BeforePersist = Callable[[int], Awaitable[None]]  # cycle -> wait until its copy may start


class MemoryTier:
    """The memory tier's coordinator side; see the module docstring."""

    def __init__(
        self,
        config: GracefulConfig,
        job_id: str,
        instance_id: str,
        start_keeper: KeeperFactory,
        home_node: str = "",
        publish: Publish | None = None,
        before_persist: BeforePersist | None = None,
        durable_changed: DurableChanged | None = None,
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.instance_id = instance_id  # names this coordinator's keepers
        self.start_keeper = start_keeper
        self.home_node = home_node
        self.publish = publish or (lambda name, record: None)
        self.before_persist = before_persist
        self.durable_changed = durable_changed or (lambda summary, failed: None)
        self.newest_durable: dict[str, Any] | None = None  # {"step", "cycle", "path", "at"}
        self.failing: dict[str, Any] | None = None  # the newest step whose copy failed, and why
        self.keepers: dict[str, KeeperClient] = {}  # node id -> its keeper
        self.checkpoints: dict[int, MemoryCheckpoint] = {}  # step -> committed in memory
        self.by_cycle: dict[int, MemoryCheckpoint] = {}  # cycle -> its memory checkpoint
        self.leaving: dict[str, float] = {}  # keeper nodes being evicted -> their deadline
        self.durable: dict[int, dict[str, Any]] = {}  # cycle -> {"path", "at"} | {"error"}
        self.durable_events: dict[int, asyncio.Event] = {}
        # One durable copy of a step at a time: a held step and the next cycle's commit of the
        # same step (a group evicted again before it trained) must not write it side by side.
        self.writing: dict[int, asyncio.Lock] = {}
        self.tasks: set[asyncio.Task] = set()
        self.unfinished: list[MemoryCheckpoint] = []  # adopted, their durable copy not landed

    # --- placement (the cycle machine's view) -------------------------------------------------

    def nodes(self) -> list[str]:
        """Nodes with a keeper that is not leaving."""
        return [node for node in self.keepers if node not in self.leaving]

    def names(self, nodes: Sequence[str]) -> tuple[str, ...]:
        return tuple(keeper_name(self.job_id, self.instance_id, node) for node in nodes)

    def ensure_keeper(self, node_id: str) -> None:
        """Start this node's keeper, once.

        The coordinator's own node gets one too: it runs no ranks, but it is the node least
        likely to be evicted (the driver's, usually the head).
        """
        if self.config.memory_replicas <= 0 or not node_id or node_id in self.keepers:
            return
        own = self.home_node
        if own and own not in self.keepers and own != node_id:
            self.ensure_keeper(own)
        name = keeper_name(self.job_id, self.instance_id, node_id)
        self.keepers[node_id] = self.start_keeper(name, node_id)

    # --- after a coordinator restart (coordinator/recovery.py reads the records) -----------------

    def adopt(self, found: Mapping[str, KeeperClient], checkpoints: list[MemoryCheckpoint]) -> None:
        """A restarted coordinator takes back its keepers and the memory checkpoints they hold.

        The checkpoints come from their records (the newest durable one and any newer); each is
        offered again only after its holders answer (``_check_holders``, as before any restart),
        and a durable copy that had not landed is started again at ``resume``.
        """
        self.keepers.update(found)
        for memory in checkpoints:  # read back: their holders not yet checked (checked_at 0)
            self.checkpoints[memory.step] = memory
            self.by_cycle[memory.cycle] = memory
            landed = memory.durable_path is not None or memory.durable_error is not None
            if not landed and self.config.checkpoint_dir is not None:
                self.unfinished.append(memory)
        if found or checkpoints:
            logger.warning(
                "ray_graceful coordinator: adopted %d keeper(s) and the memory checkpoint(s) of "
                "step(s) %s",
                len(found),
                sorted(self.checkpoints),
            )

    def resume(self) -> None:
        """On the event loop: the durable copies an adopted checkpoint still lacks (once: a
        second copy of the same step racing the first would fail it)."""
        while self.unfinished:
            self._spawn(self._persist(self.unfinished.pop()))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _changed(self, memory: MemoryCheckpoint) -> None:
        self.publish(f"memory-cycle-{memory.cycle}", memory.to_record())

    def record(self, cycle: int) -> dict[str, Any] | None:
        """What the memory checkpoint of ``cycle`` holds and went through, as it is now."""
        memory = self.by_cycle.get(cycle)
        return memory.to_record() if memory is not None else None

    # --- after a cycle concluded ----------------------------------------------------------

    def after_commit(self, cycle: int, memory: MemoryCheckpoint | None) -> None:
        """Start the durable copy of a memory commit; release what a failed cycle handed over."""
        if not self.keepers:
            return
        if memory is None:
            for keeper in self.keepers.values():
                keeper.release(cycle=cycle)
            return
        self.checkpoints[memory.step] = memory
        self.by_cycle[memory.cycle] = memory
        for old in [c for c in self.by_cycle if c < cycle - 16]:
            del self.by_cycle[old]
        self._changed(memory)
        if self.config.checkpoint_dir is None:
            return  # nowhere durable: it lives in memory only (the outcome says so)
        self._spawn(self._persist(memory))

    async def _persist(self, memory: MemoryCheckpoint) -> None:
        """Keepers write their shards; the manifest goes last; older memory is released.

        Where a warm restart from this checkpoint is under way, its members load first (from
        these keepers): ``before_persist`` waits until every member spoke, at most
        ``rejoin_timeout_s``, instead of taking the keepers' CPU and memory bandwidth from it.
        """
        root = self.config.checkpoint_dir
        assert root is not None
        if self.before_persist is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self.before_persist(memory.cycle), self.config.rejoin_timeout_s
                )
        for attempt in range(DURABLE_TRIES):
            if attempt:
                await asyncio.sleep(DURABLE_RETRY_S[min(attempt, len(DURABLE_RETRY_S)) - 1])
                if (self.newest_durable or {}).get("step", -1) > memory.step:
                    break  # a newer step is durable: this one no longer needs to be
            async with self.writing.setdefault(memory.step, asyncio.Lock()):
                durable = await self._write_durable(root, memory)
            if "path" in durable:
                break
            durable["tries"] = attempt + 1
        self._copy_ended(memory, durable)

    def _durable_ended(self, memory: MemoryCheckpoint, durable: dict[str, Any]) -> None:
        """Keep ``durable_summary`` true: the newest durable step, and a newer one that failed."""
        newest = (self.newest_durable or {}).get("step", -1)
        if "path" in durable:
            if memory.step >= newest:
                self.newest_durable = {"step": memory.step, "cycle": memory.cycle, **durable}
            if self.failing is not None and self.failing["step"] <= memory.step:
                self.failing = None
        elif memory.step > newest:
            self.failing = {
                "step": memory.step,
                "cycle": memory.cycle,
                "reason": durable.get("error", ""),
                "tries": durable.get("tries", 1),
            }
        self.durable_changed(self.durable_summary(), "path" not in durable)

    def durable_summary(self) -> dict[str, Any]:
        """What is on disk, as a user asks it: the newest durable step (None: none yet), and
        the newer step whose copy failed after every try - "no durable step since k"."""
        summary: dict[str, Any] = {
            "step": (self.newest_durable or {}).get("step"),
            "path": (self.newest_durable or {}).get("path"),
            "failing": dict(self.failing) if self.failing else None,
        }
        if self.failing:
            since = summary["step"]
            summary["says"] = (
                f"no durable step since {'the start' if since is None else f'step {since}'}: "
                f"the copy of step {self.failing['step']} failed {self.failing['tries']} "
                f"time(s) ({self.failing['reason']})"
            )[:500]
        return summary

    async def write_through(self, memory: MemoryCheckpoint) -> dict[str, Any]:
        """A checkpoint whole in the keepers whose nodes are leaving (``LeavingHolders``): it
        would vanish with them, so it is committed on disk instead - the keepers write their
        shards now, while their nodes drain, and the manifest goes last. Never offered from
        memory. The keepers' writes are bounded by the latest deadline of their nodes (or
        ``teardown_timeout_s``): past it they are gone. The durable record, as ``wait_durable``
        gives it to anyone waiting for this cycle's copy."""
        root = self.config.checkpoint_dir
        assert root is not None  # conclusion.carry_out asks for a write-through only with one
        holders = {n for r in memory.shards.values() for n in r.holders}
        deadlines = [self.leaving[n] for n in holders if n in self.leaving]
        within = max(deadlines, default=time.time() + self.config.teardown_timeout_s)
        async with self.writing.setdefault(memory.step, asyncio.Lock()):
            durable = await self._write_durable(root, memory, max(within - time.time(), 1.0))
        self._copy_ended(memory, durable, in_memory=False)
        return durable

    def _copy_ended(
        self, memory: MemoryCheckpoint, durable: dict[str, Any], in_memory: bool = True
    ) -> None:
        """A disk copy ended (landed or failed): the summary, its record, the memory
        checkpoint's own record (``in_memory``: not for a write-through, never one), and
        whoever waits for it (``wait_durable``)."""
        self._durable_ended(memory, durable)
        self.durable[memory.cycle] = durable
        self.publish(f"durable-cycle-{memory.cycle}", {"cycle": memory.cycle, **durable})
        if in_memory:
            self._changed(memory)
        self.durable_events.setdefault(memory.cycle, asyncio.Event()).set()

    async def _write_durable(
        self, root: str, memory: MemoryCheckpoint, within: float | None = None
    ) -> dict[str, Any]:
        """The keepers write the shards (within ``within`` seconds, if given), then the
        manifest; where it landed, or the error. A step already on disk is kept as it is
        (``commit``), its shards reported reused."""
        try:
            records: list[ShardRecord] = []
            calls = {}
            for key, record in memory.shards.items():
                if record.tier is Place.DISK:
                    records.append(record)
                    continue
                calls[key] = self._persist_one(root, memory.step, key, record.holders)
            written = asyncio.gather(*calls.values())
            for data in await asyncio.wait_for(written, within):
                records.append(ShardRecord.from_dict(data))
            path = await asyncio.to_thread(
                commit,
                root,
                memory.step,
                list(memory.shards),
                records,
                memory.cycle,
                {"job_id": self.job_id, "tiers": ["memory", "disk"]},
            )
            memory.durable_path, memory.durable_at = os.path.dirname(path), time.time()
            memory.durable_error = None
            durable = {"path": memory.durable_path, "at": memory.durable_at}
            for older in [s for s in self.checkpoints if s < memory.step]:
                del self.checkpoints[older]
            for older in [s for s in self.writing if s < memory.step]:
                del self.writing[older]
            for keeper in self.keepers.values():
                keeper.release(below_step=memory.step)
        except Exception as exc:  # a keeper's error, a dead keeper, the disk: all say why
            memory.durable_error = f"{type(exc).__name__}: {exc}"
            durable = {"error": memory.durable_error}
            logger.error(
                "ray_graceful coordinator: durable copy of step %s failed: %s", memory.step, exc
            )
        return durable

    async def _persist_one(
        self, root: str, step: int, key: str, holders: tuple[str, ...]
    ) -> dict[str, Any]:
        """Ask the shard's holders in turn until one has written it."""
        errors = []
        for node in holders:
            keeper = self.keepers.get(node)
            if keeper is None:
                errors.append(f"no keeper on {node[:12]}")
                continue
            try:
                return await keeper.persist(root, step, key)
            except Exception as exc:
                errors.append(f"keeper on {node[:12]}: {type(exc).__name__}: {exc}")
        raise CheckpointError(f"no keeper could write {key}: {'; '.join(errors)}")

    # --- a keeper's node is leaving ------------------------------------------------------

    def node_leaving(self, node_id: str, deadline: float) -> None:
        """``node_id`` is being evicted: its keeper's shards move before ``deadline``.

        Once per node, in the background (the cycle's own teardown does not wait for it). From
        now on no shard is placed on that node.
        """
        if node_id not in self.keepers or node_id in self.leaving:
            return
        if not deadline:
            deadline = time.time() + self.config.teardown_timeout_s
        self.leaving[node_id] = deadline
        self._spawn(self._evacuate(node_id, deadline))

    async def _evacuate(self, node_id: str, deadline: float) -> None:
        """Hand on every shard the leaving keeper holds, newest checkpoint first."""
        for memory in sorted(self.checkpoints.values(), key=lambda m: -m.step):
            orphans = []
            for key, record in list(memory.shards.items()):
                if record.tier is not Place.MEMORY or node_id not in record.holders:
                    continue
                target = await self._hand_on(memory, record, node_id, deadline)
                holders = tuple(h for h in record.holders if h != node_id)
                holders += (target,) if target else ()
                memory.shards[key] = dataclasses.replace(record, holders=holders)
                memory.handed_on.append(
                    {"shard": key, "from": node_id, "to": target, "at": time.time()}
                )
                if not holders:
                    orphans.append(key)
            if orphans:
                await self._orphaned(memory, orphans, node_id, deadline)
            self._changed(memory)

    async def _hand_on(
        self,
        memory: MemoryCheckpoint,
        record: ShardRecord,
        node_id: str,
        deadline: float,
    ) -> str | None:
        """Copy one shard from the leaving keeper to a keeper that stays: its node, or None."""
        staying = [n for n in self.keepers if n not in self.leaving and n not in record.holders]
        for target in choose_holders(record.shard, "", staying, len(staying)):
            left = deadline - time.time()
            if left <= 0:
                break
            try:
                shard_ref = await asyncio.wait_for(
                    self.keepers[node_id].fetch(memory.step, record.shard), left
                )
                if shard_ref is None:
                    return None  # the leaving keeper does not hold it (any more)
                reply = await asyncio.wait_for(
                    self.keepers[target].hold(
                        memory.cycle,
                        memory.step,
                        record.shard,
                        shard_ref,
                        record.bytes,
                        record.group,
                        record.rank,
                        left,
                        record.dcp_chunks,
                    ),
                    left,
                )
            except Exception as exc:
                logger.warning(
                    "ray_graceful coordinator: could not hand %s on from %s to %s: %r",
                    record.shard,
                    node_id[:12],
                    target[:12],
                    exc,
                )
                continue
            if reply.accepted:
                logger.info(
                    "ray_graceful coordinator: %s (step %s) handed on from %s to %s",
                    record.shard,
                    memory.step,
                    node_id[:12],
                    target[:12],
                )
                return target
            logger.warning("ray_graceful coordinator: %s refused: %s", target[:12], reply.reason)
        return None

    async def _orphaned(
        self,
        memory: MemoryCheckpoint,
        shards: list[str],
        node_id: str,
        deadline: float,
    ) -> None:
        """Shards only the leaving node held: the durable copy must land before it goes."""
        if memory.durable_path is None and self.config.checkpoint_dir is not None:
            event = self.durable_events.setdefault(memory.cycle, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), max(deadline - time.time(), 0))
            except asyncio.TimeoutError:
                pass
        if memory.durable_path is not None:
            return  # on disk: a restart loads those shards from there, at the same step
        self._forget(
            memory,
            f"{', '.join(shards)} held only on node {node_id[:12]}, which was evicted before "
            "the durable copy landed and no other keeper could take it",
        )

    def _forget(self, memory: MemoryCheckpoint, why: str) -> None:
        """A memory checkpoint that can no longer be restored whole is no longer offered."""
        memory.lost = why
        self.checkpoints.pop(memory.step, None)
        self._changed(memory)
        logger.error(
            "ray_graceful coordinator: the memory checkpoint of step %s is lost: %s; restarts "
            "resume from the newest durable checkpoint",
            memory.step,
            why,
        )

    async def _check_holders(self, memory: MemoryCheckpoint) -> None:
        """Drop holders whose keeper is gone; a shard with none left ends the checkpoint.

        Asked before a restart is told where to load from, so every rank of the restarted
        group gets the same step: one rank falling back to an older step on disk while the
        others load the newer one from memory would be a torn restore.
        """
        if time.time() - memory.checked_at < HOLDERS_FRESH_S:
            return
        nodes = sorted({n for holders in memory.in_memory().values() for n in holders})
        answers = await asyncio.gather(*(self._keeper_answers(n) for n in nodes))
        gone = {node for node, alive in zip(nodes, answers, strict=True) if not alive}
        memory.checked_at = time.time()
        orphans = []
        for key, record in list(memory.shards.items()):
            if record.tier is Place.MEMORY and gone & set(record.holders):
                holders = tuple(h for h in record.holders if h not in gone)
                memory.shards[key] = dataclasses.replace(record, holders=holders)
                orphans += [] if holders else [key]
        if orphans and memory.durable_path is None:
            lost = ", ".join(n[:12] for n in sorted(gone))
            self._forget(memory, f"{', '.join(orphans)} had no keeper left (gone: {lost})")

    async def _keeper_answers(self, node_id: str) -> bool:
        keeper = self.keepers.get(node_id)
        if keeper is None:
            return False
        try:
            await asyncio.wait_for(keeper.ping(), KEEPER_PING_S)
            return True
        except Exception:
            return False

    # --- queries ----------------------------------------------------------------------------

    async def checkpoint_for(self, shard_key: str) -> dict[str, Any] | None:
        """The newest memory checkpoint that holds ``shard_key``: its step, {node: keeper}."""
        for step in sorted(self.checkpoints, reverse=True):
            memory = self.checkpoints[step]
            await self._check_holders(memory)
            if memory.lost:
                continue
            record = memory.shards.get(shard_key)
            if record is not None and record.tier is Place.MEMORY:
                return {
                    "step": step,
                    "holders": dict(zip(record.holders, self.names(record.holders), strict=True)),
                }
        return None

    def durable_failed(self, cycle: int, why: str) -> None:
        """Cycle ``cycle``'s step will never be durable (a held step lost): waits for it end."""
        self.durable[cycle] = {"error": why}
        self.publish(f"durable-cycle-{cycle}", {"cycle": cycle, "error": why})
        self.durable_events.setdefault(cycle, asyncio.Event()).set()

    async def wait_durable(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """The durable copy's record once the background copy of ``cycle`` ended (or None)."""
        event = self.durable_events.setdefault(cycle, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=timeout)
        except asyncio.TimeoutError:
            return None
        return self.durable.get(cycle)

    async def keeper_stats(self) -> dict[str, Any]:
        """Every keeper's budget, use and shards (the demo and the CLI show them)."""
        out: dict[str, Any] = {}
        for node, keeper in self.keepers.items():
            try:
                out[node] = await asyncio.wait_for(keeper.stats(), timeout=10)
            except Exception as exc:
                out[node] = {"error": repr(exc)}
        return out
