"""A node's rank processes, relayed to the coordinator as one.

Without it every rank process registers on its own, holds its own long poll and probes NVML on
its own: the coordinator answers one reply per rank when an order goes out, and an idle job
sends it N/``health_interval_s`` polls a second (``bench fanout``: 4,096 ranks ordered after
6.3 s). Through a relay, the coordinator sees one member per node:

- registrations arriving together (the ranks of a node call ``graceful_setup`` right after the
  same ``init_process_group``) go up as one message;
- one long poll carries every process's last step and health, and is answered with the orders
  of all of them at once - one reply per node;
- acknowledgements go up together, and so do teardown reports;
- health is probed once per distinct set of GPUs, and each verdict goes to the processes on
  those GPUs.

Each process still holds a long poll, but on its own node's agent: the order reaches a rank
whose training thread is blocked in a collective exactly as before, through its control
thread. The coordinator's own answers pass through unchanged (at-least-once orders, stale and
unknown answers); when the coordinator cannot be reached (Ray restarting it, or gone) every
held poll is answered ``AWAY`` and each process registers again, which the relay passes on.

Pure asyncio, no Ray: the coordinator is an injected ``Upstream`` and the health probes come
from an injected factory. The node agent (``agent.py``) is a ``NodeRelay`` in a Ray actor; the
fan-out benchmark runs thousands of them, one per simulated node, in a few processes. The
half that faces the coordinator (``Relay``) is shared with the group agent (``group.py``), the
same relay one level up, whose members are the processes of up to 64 nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..health import HealthProbe, HealthReport
from ..protocol import (
    Ack,
    PollAnswer,
    PollKind,
    PollState,
    Register,
    Reply,
    TeardownOrder,
    TeardownReport,
)

logger = logging.getLogger(__name__)

BATCH_S = 0.01  # how long a registration or acknowledgement waits for others to go up with it
MAX_POLL_S = 60.0
ENDS = (PollKind.UNKNOWN, PollKind.STALE, PollKind.AWAY)  # answers that end a membership
FORGET_AFTER_S = 30.0  # a process that has not polled for this long (plus its wait) is gone


class Unreachable(Exception):
    """The coordinator did not answer: ``restarting`` (Ray brings it back) or gone for good."""

    def __init__(self, reason: str, restarting: bool) -> None:
        super().__init__(reason)
        self.restarting = restarting


def poll_wait(wait_s: float) -> float:
    """How long a poll from downstream is held: as asked, within [0.1 s, ``MAX_POLL_S``]."""
    return min(max(float(wait_s), 0.1), MAX_POLL_S)


def refusal(exc: Unreachable | TimeoutError) -> Reply:
    """A call up that failed, as the refusal a process acts on: it registers again (or acks
    again) unless the coordinator is gone for good."""
    if isinstance(exc, Unreachable):
        return Reply.refused(f"the coordinator is unreachable: {exc}", retry=exc.restarting)
    return Reply.refused("the coordinator did not answer in time", retry=True)


class Upstream(Protocol):
    """The coordinator, as a relay calls it; raises ``Unreachable``, or TimeoutError."""

    async def register(self, node_key: str, messages: list[Register]) -> list[Reply]: ...

    async def poll(
        self, node_key: str, states: dict[str, tuple[int, PollState]], wait_s: float
    ) -> dict[str, PollAnswer]: ...

    async def ack(self, acks: list[Ack]) -> list[Reply]: ...

    async def report(self, reports: list[tuple[str, TeardownReport]]) -> list[Reply]: ...


@dataclass
class Member:
    """One rank process a relay speaks for."""

    gpus: tuple[int, ...] = ()
    cycle: int = 0
    node_key: str = ""  # in a group relay: the node agent it polls through
    state: PollState = field(default_factory=PollState)
    seen: float = field(default_factory=time.monotonic)
    wait_s: float = 5.0
    waiting: asyncio.Future | None = None  # its held poll (a node relay's process)
    answer: PollAnswer | None = None  # arrived while no poll of it was held
    holding: PollAnswer | None = None  # its order, handed again until it is acknowledged

    def take(self, answer: PollAnswer) -> None:
        """An answer from upstream; an order is held until the process acknowledges it."""
        if answer.kind is PollKind.ORDER and answer.order is not None:
            self.holding = answer

    def holding_id(self) -> str:
        return self.holding.order.order_id if self.holding and self.holding.order else ""


class Batch:
    """Items that go up together in one call, ``BATCH_S`` after the first of them."""

    def __init__(self, send: Callable[[list[Any]], Awaitable[list[Any]]], wait_s: float) -> None:
        self.send, self.wait_s = send, wait_s
        self.items: list[tuple[Any, asyncio.Future]] = []
        self._task: asyncio.Task | None = None  # the flush under way (held: not collected)

    async def add(self, item: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.items.append((item, future))
        if len(self.items) == 1:
            self._task = asyncio.get_running_loop().create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(self.wait_s)
        items, self.items = self.items, []
        try:
            answers = await self.send([item for item, _ in items])
            if len(answers) != len(items):
                raise RuntimeError(f"{len(answers)} answers to {len(items)} messages")
        except Exception as exc:
            for _, future in items:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), answer in zip(items, answers, strict=True):
            if not future.done():
                future.set_result(answer)


class Relay:
    """The half of a relay that faces the coordinator: the members it speaks for, their
    registrations and acknowledgements gathered into one call each, and the one long poll.

    What faces downstream is the subclass's: ``NodeRelay`` serves a node's rank processes, one
    held poll each; ``GroupRelay`` (``group.py``) serves node agents, one held poll per node -
    the coordinator's own node-facing calls, one level down. ``_deliver`` hands an answer from
    upstream to whoever waits for it."""

    def __init__(
        self,
        key: str,
        upstream: Upstream,
        wait_s: float,
        probe_for: Callable[[tuple[int, ...]], HealthProbe] | None = None,
        batch_s: float = BATCH_S,
    ) -> None:
        self.node_key, self.upstream, self.wait_s = key, upstream, wait_s
        self.probe_for = probe_for  # None: each process's own health travels as it came
        self.members: dict[str, Member] = {}
        self.probes: dict[tuple[int, ...], HealthProbe] = {}
        self.registrations = Batch(self._send_registrations, batch_s)
        self.acks = Batch(self.upstream.ack, batch_s)
        self.reports = Batch(self.upstream.report, batch_s)
        self.reports_relayed = 0
        self._polling: asyncio.Task | None = None
        self._members_changed = asyncio.Event()  # a process registered or acknowledged
        self.parked = False  # every process holds its order: no poll goes up meanwhile
        self._joining: dict[str, Member] = {}  # process id -> its record, while registering
        self.upstream_polls = 0

    def describe(self) -> dict[str, Any]:
        return {
            "node_key": self.node_key,
            "processes": len(self.members),
            "gpu_sets_probed": len(self.probes),
            "upstream_polls": self.upstream_polls,
            "reports_relayed": self.reports_relayed,
            "parked": self.parked,
        }

    def relaying(self) -> bool:
        """Whether any process is relayed, or joining, or has something on its way up."""
        batches = (self.registrations, self.acks, self.reports)
        return bool(self.members or self._joining or any(b.items for b in batches))

    def _deliver(self, process_id: str, member: Member, answer: PollAnswer) -> None:
        raise NotImplementedError

    def _ended(self, process_id: str, answer: PollAnswer) -> None:
        """An answer that ends a membership (unknown, stale, away): the process registers
        again, or leaves."""
        if answer.kind in ENDS:
            self.members.pop(process_id, None)

    def _acknowledged(self, process_id: str) -> None:
        """A process has its order: it is no longer polled for."""
        self.members.pop(process_id, None)
        self._members_changed.set()

    # --- what goes up --------------------------------------------------------------------------

    async def _send_registrations(self, messages: list[Register]) -> list[Reply]:
        replies = await self.upstream.register(self.node_key, messages)
        for message, reply in zip(messages, replies, strict=False):
            if reply.accepted and reply.cycle is not None:
                member = self._joining.get(message.process_id) or Member(wait_s=self.wait_s)
                member.cycle, member.seen = reply.cycle, time.monotonic()  # seen: from now
                self.members[message.process_id] = member
        self._members_changed.set()
        if self.members and (self._polling is None or self._polling.done()):
            self._polling = asyncio.get_running_loop().create_task(self._poll_upstream())
        return replies

    async def _poll_upstream(self) -> None:
        """The one long poll, renewed every ``wait_s`` while any process is relayed."""
        while self.members:
            self._forget_silent()
            if all(m.holding is not None for m in self.members.values()):
                # Every process has its order: nothing more comes for them this cycle, so no
                # poll goes up (at thousands of nodes, one call fewer per node in the fan-out)
                # until one registers or all acknowledged; the relay hands the orders again.
                self._members_changed.clear()
                self.parked = True
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._members_changed.wait(), timeout=self.wait_s)
                self.parked = False
                continue
            health = await self._health()
            states = {
                pid: (
                    m.cycle,
                    PollState(
                        m.state.last_step, health.get(m.gpus, m.state.health), m.holding_id()
                    ),
                )
                for pid, m in self.members.items()
            }
            self.upstream_polls += 1
            try:
                answers = await self.upstream.poll(self.node_key, states, self.wait_s)
            except TimeoutError:
                continue  # an order it carried is answered again to the next poll
            except Unreachable as exc:
                self._away(str(exc))
                return
            except Exception as exc:  # a bug of ours or a broken answer: said, and polled again
                logger.warning("ray_graceful relay %s: its poll failed: %r", self.node_key, exc)
                await asyncio.sleep(min(self.wait_s, 1.0))
                continue
            for process_id, answer in answers.items():
                member = self.members.get(process_id)
                if member is None:
                    continue
                self._ended(process_id, answer)  # not polled for meanwhile
                member.take(answer)
                self._deliver(process_id, member, answer)

    def _away(self, reason: str) -> None:
        """Upstream is unreachable: every process is told, and registers again."""
        logger.warning("ray_graceful relay %s: upstream unreachable (%s)", self.node_key, reason)
        members, self.members = self.members, {}
        for process_id, member in members.items():
            self._deliver(process_id, member, PollAnswer(PollKind.AWAY, reason=reason))

    def _forget_silent(self) -> None:
        now = time.monotonic()
        for process_id, member in list(self.members.items()):
            if member.waiting is None and now - member.seen > member.wait_s + FORGET_AFTER_S:
                del self.members[process_id]  # its process is gone without a word

    async def _health(self) -> dict[tuple[int, ...], HealthReport]:
        """One check per distinct set of GPUs (on a thread: NVML may be slow)."""
        if self.probe_for is None:
            return {}
        out = {}
        for gpus in {m.gpus for m in self.members.values()}:
            probe = self.probes.get(gpus)
            if probe is None:
                probe = self.probes[gpus] = self.probe_for(gpus)
            out[gpus] = await asyncio.to_thread(probe.check)
        return out


class NodeRelay(Relay):
    """Speaks for the rank processes of one node (of one job): one held poll each, here."""

    async def register(self, message: Register, gpus: tuple[int, ...] = ()) -> Reply:
        """Register a process's ranks, together with whoever else registers now."""
        self._joining[message.process_id] = Member(tuple(gpus), wait_s=self.wait_s)
        try:
            return await self._up(self.registrations, message)
        finally:
            self._joining.pop(message.process_id, None)

    async def poll(
        self, process_id: str, cycle: int, state: PollState, wait_s: float
    ) -> PollAnswer:
        """A process's long poll: its order (or the coordinator's word) when one comes."""
        member = self.members.get(process_id)
        if member is None:
            why = "this process is not registered with its node's agent"
            return PollAnswer(PollKind.UNKNOWN, reason=why)
        member.cycle, member.state, member.seen = cycle, state, time.monotonic()
        member.wait_s = poll_wait(wait_s)
        again = member.answer or member.holding
        if again is not None:
            # its order again if it polls without having acknowledged it (a reply lost)
            member.answer = None
            return self._handed(process_id, again)
        member.waiting = asyncio.get_running_loop().create_future()
        try:
            answer: PollAnswer = await asyncio.wait_for(member.waiting, timeout=member.wait_s)
        except asyncio.TimeoutError:
            return PollAnswer(PollKind.IDLE)
        finally:
            member.waiting = None
        return self._handed(process_id, answer)

    def order_out(self, order_for: Callable[[int], TeardownOrder]) -> int:
        """Every process relayed here is handed its own order from ``order_for(cycle)`` - the
        agent's, when this host is cut off from the coordinator; how many were."""
        for process_id, member in self.members.items():
            answer = PollAnswer(PollKind.ORDER, order=order_for(member.cycle))
            member.take(answer)
            self._deliver(process_id, member, answer)
        return len(self.members)

    async def ack(self, message: Ack) -> Reply:
        """A process has its order: it stops polling, and the coordinator is told."""
        self._acknowledged(message.process_id)
        return await self._up(self.acks, message)

    async def report(self, process_id: str, report: TeardownReport) -> Reply:
        """A process's teardown report, sent up with the others of its node (a refusal that
        says ``retry``: the process sends it to the coordinator itself)."""
        self.reports_relayed += 1
        return await self._up(self.reports, (process_id, report))

    async def _up(self, batch: Batch, item: Any) -> Reply:
        """``item`` up in ``batch`` with the others of its node: the reply, or the refusal a
        process acts on if the call up failed."""
        try:
            return await batch.add(item)
        except (Unreachable, TimeoutError) as exc:
            return refusal(exc)

    def _deliver(self, process_id: str, member: Member, answer: PollAnswer) -> None:
        if member.waiting is not None and not member.waiting.done():
            member.waiting.set_result(answer)
        else:
            member.answer = answer

    def _handed(self, process_id: str, answer: PollAnswer) -> PollAnswer:
        self._ended(process_id, answer)
        return answer
