"""The transport between a worker process and its coordinator: register, long poll, report.

Pull, not push: a daemon thread of the worker holds a ``poll`` call to the coordinator open.
The coordinator answers every pending poll at once when it orders a teardown, so the order
reaches a rank whose training thread is blocked in a collective, and nothing about how the user
declared the actor changes (no concurrency group, no async method). Each poll also carries the
rank's last step and a fresh health verdict (NVML), which is how FAULTY hardware becomes a
notice.

This module knows nothing of what an order means: it acknowledges the ``TeardownOrder`` (so it is
not sent again - delivery is at least once) and hands it to ``on_order``; the worker runtime turns
it into a teardown. A coordinator that Ray is restarting (its process died; the poll fails with
``ActorUnavailableError``) is registered with again, with the same keys, for up to
``coordinator_reconnect_s``; one that is gone for good (``ActorDiedError``) ends the channel.
Either way ``on_disconnect`` is told at once, and the peers are watched through the group's
store (``peer_release.py``); and ``on_link`` is told the link is restarting, back or lost -
what that means for a SIGTERMed rank (report again, wait, go alone) is its machine's
(``lifecycle.py``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ..bounded import NoAnswer, Why, call
from ..checkpoint import ShardRecord
from ..config import GracefulConfig
from ..health import HealthProbe, NullProbe, make_probe
from ..protocol import (
    Ack,
    LateSave,
    PollKind,
    PollState,
    RankSpec,
    Register,
    Rejoined,
    RejoinResult,
    Rendezvous,
    Reply,
    SaveResult,
    SaveTurn,
    SigtermSeen,
    TeardownOrder,
    TeardownReport,
    TurnAnswer,
    WarmResult,
    coordinator_name,
)
from ..word import Word
from .rank_events import Link, Told

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 15.0
REREGISTER_EVERY_S = 0.25  # while the coordinator says "later" (a cycle still tearing down)
REPORT_TIMEOUT_S = 2.0
SIGTERM_REPORT_TIMEOUT_S = 1.0
UNACKNOWLEDGED = "ray_graceful: could not acknowledge the order: %r"


class Channel(Word):
    """Where a process's link to its coordinator is (``ControlChannel.state``; ``why`` says
    what the coordinator answered or what failed)."""

    CONNECTING = "connecting"
    POLLING = "polling"  # registered: orders arrive through the long poll
    REGISTERING_AGAIN = "registering again"  # the coordinator said "later" (a cycle leaving)
    RECONNECTING = "reconnecting"  # Ray is restarting the coordinator
    UNREACHABLE = "registration failed"
    REFUSED = "registration refused"
    LOST = "lost"  # gone for good: a SIGTERM now tears this rank down on its own


def find_coordinator(config: GracefulConfig) -> Any | None:
    """This job's coordinator, or None (not in Ray / none started for this job)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        name = coordinator_name(config, ray.get_runtime_context().get_job_id())
        return ray.get_actor(name, namespace=config.coordinator_namespace)
    except (ValueError, ImportError):
        return None


def gpu_indices() -> list[int]:
    try:
        import ray

        return [int(g) for g in ray.get_gpu_ids()]
    except Exception:
        return []


def _warn_if_unacknowledged(done: concurrent.futures.Future) -> None:
    """Said, not raised: an unacknowledged order may come again, and is handled once."""
    if not done.cancelled() and (exc := done.exception()) is not None:
        logger.warning(UNACKNOWLEDGED, exc)


class ControlChannel:
    """One worker process's link to the coordinator.

    ``ranks()`` gives the ranks to register, ``last_step()`` what to say with each poll,
    ``on_order(order)`` takes an order (once or more: it must be idempotent), and ``done()``
    says when to stop polling (a teardown is under way).
    """

    def __init__(
        self,
        handle: Any,
        config: GracefulConfig,
        ranks: Callable[[], tuple[RankSpec, ...]],
        last_step: Callable[[], int | None],
        on_order: Callable[[TeardownOrder], None],
        done: Callable[[], bool],
        on_disconnect: Callable[[], None] = lambda: None,
        relay: Any | None = None,
        on_link: Callable[[Link], object] = lambda change: None,
    ) -> None:
        import ray

        self.handle, self.config = handle, config
        self.relay = relay  # this node's agent (node/agent.py), or None: straight to the handle
        self.ranks, self.last_step, self.on_order, self.done = ranks, last_step, on_order, done
        self.on_disconnect = on_disconnect
        self.on_link = on_link  # restarting, back, lost: the rank's machine decides what follows
        self.sigterm_refusal = ""  # why the coordinator refused the SIGTERM report, if it did
        ctx = ray.get_runtime_context()
        self.process_id = f"{ctx.get_worker_id()}"
        self.job_id = ctx.get_job_id() or ""
        self.node_id = ctx.get_node_id()
        self.actor_id = ctx.get_actor_id() or ""
        self.coordinator_name = coordinator_name(config, self.job_id)
        self.cycle: int | None = None
        self.alive = True
        self.reconnecting = False  # Ray is restarting the coordinator: registering again
        self.state, self.why = Channel.CONNECTING, ""
        self.order_received = threading.Event()
        self._thread: threading.Thread | None = None
        self._probe: HealthProbe | None = None

    def describe(self) -> str:
        """The link in words: its state, and why where there is a reason."""
        return f"{self.state}: {self.why}" if self.why else str(self.state)

    @property
    def connected(self) -> bool:
        """Registered with a coordinator that answers: it, not this rank, releases the peers."""
        return self.alive and self.cycle is not None

    @property
    def probe(self) -> HealthProbe:
        if self._probe is None:
            try:
                self._probe = make_probe(self.config, gpu_indices(), self.node_id)
            except Exception as exc:  # an explicit health_probe='nvml' without NVML, say
                logger.warning("ray_graceful: health probe unavailable: %s", exc)
                self._probe = NullProbe(f"probe failed to start: {exc}", "probe_failed")
        return self._probe

    # --- calls -----------------------------------------------------------------------------

    def register(self) -> str:
        """(Re-)register every rank of this process; returns a line for the setup status.

        A coordinator still tearing down the previous group refuses for now (``retry``): the
        control thread then registers again until it is accepted, and polls from there - a
        group restarted while the last one is still leaving is covered once that ended. Until
        then ``cycle`` is None, and a SIGTERM tears this rank down on its own.
        """
        answer = self._send_registration()
        if isinstance(answer, NoAnswer):
            self.alive, self.state, self.why = False, Channel.UNREACHABLE, str(answer)
            return (
                f"coordinator {self.coordinator_name!r} unreachable ({answer}): on SIGTERM this "
                "rank tears itself down on its own"
            )
        if not answer.accepted and answer.retry:
            self.state, self.why = Channel.REGISTERING_AGAIN, answer.reason
            self.start()
            return (
                f"coordinator {self.coordinator_name!r} is busy ({answer.reason}): the "
                "registration is retried in the background; until it is accepted, SIGTERM "
                "tears this rank down on its own"
            )
        if not answer.accepted:
            self.alive, self.state, self.why = False, Channel.REFUSED, answer.reason
            return (
                f"coordinator refused the registration ({answer.reason}): on SIGTERM this rank "
                "tears itself down on its own"
            )
        self.cycle = answer.cycle
        self.state, self.why = Channel.POLLING, ""
        self.start()
        return (
            f"coordinator {self.coordinator_name!r}, cycle {self.cycle}: orders arrive "
            "through a long poll"
        )

    @property
    def via(self) -> Any:
        """Whom registrations, polls and acknowledgements go to: the agent, or the coordinator."""
        return self.handle if self.relay is None else self.relay

    def _without_relay(self, why: str) -> bool:
        """The node agent failed us: from now on this process talks to the coordinator itself.
        False if it already did (the failure was the coordinator's)."""
        if self.relay is None:
            return False
        logger.warning(
            "ray_graceful: the node agent failed (%s); this process registers with and polls "
            "the coordinator directly from now on",
            why[:300],
        )
        self.relay, self.cycle = None, None
        return True

    def _send_registration(self, timeout: float = REGISTER_TIMEOUT_S) -> Reply | NoAnswer:
        """The registration's answer, through the node agent or, if that fails, directly."""
        answer = call(*self._registration(), timeout=timeout)
        if isinstance(answer, NoAnswer) and self._without_relay(f"registering: {answer}"):
            answer = call(*self._registration(), timeout=timeout)
        return answer

    def _registration(self) -> tuple[Any, ...]:
        """The method to register with, and its arguments. No health here: NVML may be slow to
        start (or wedged); the first poll, on the control thread, carries the first verdict."""
        message = Register(
            process_id=self.process_id,
            node_id=self.node_id,
            pid=os.getpid(),
            hostname=socket.gethostname(),
            job_id=self.job_id,
            ranks=self.ranks(),
            actor_id=self.actor_id,
        )
        if self.relay is not None:  # the agent probes the node's GPUs: tell it ours
            return self.relay.register, message, tuple(gpu_indices())
        return self.handle.register, message

    def _register_until_accepted(self, give_up: float | None = None) -> bool:
        """On the control thread: register again until accepted - while the coordinator says
        "later", and, given ``give_up`` (a monotonic time), while Ray restarts it: then a call
        that fails means "not back yet", unless the actor is dead for good."""
        while self.alive and not self.done() and self.cycle is None:
            time.sleep(REREGISTER_EVERY_S)
            timeout = REGISTER_TIMEOUT_S
            if give_up is not None:
                timeout = min(timeout, give_up - time.monotonic())
                if timeout <= 0:
                    self._lost("not back within coordinator_reconnect_s")
                    return False
            answer = self._send_registration(timeout)
            if isinstance(answer, NoAnswer):
                if give_up is not None and answer.why is not Why.DEAD:
                    continue  # still restarting, or a timeout: try again
                self._lost(f"registering again: {answer}")
                return False
            if answer.accepted:
                self.cycle, self.state, self.why = answer.cycle, Channel.POLLING, ""
                logger.info("ray_graceful: registered in cycle %s", self.cycle)
            elif not answer.retry:
                self._lost(f"registration refused: {answer.reason}")
                return False
        return self.cycle is not None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="ray_graceful-control", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        if not self._register_until_accepted():
            return
        wait_s = self.config.health_interval_s
        while self.alive and not self.done():
            health = None if self.relay is not None else self.probe.check()  # the agent's job
            state = PollState(self.last_step(), health)
            answer = call(
                self.via.poll, self.process_id, self.cycle, state, wait_s, timeout=wait_s + 30
            )
            if isinstance(answer, NoAnswer):
                if answer.why is Why.TIMEOUT:
                    continue  # not lost: an order it carried is answered again to the next poll
                if self._without_relay(f"polling: {answer}"):  # the agent, not the coordinator
                    if self._register_until_accepted(self._give_up()):
                        continue
                    return
                if answer.why is not Why.RESTARTING:
                    self._lost(str(answer))  # the coordinator died for good or is unreachable
                    return
                if self._reconnect(str(answer)):  # Ray is restarting it: registered again
                    continue
                return
            if answer.kind is PollKind.IDLE:
                continue
            if answer.kind in (PollKind.AWAY, PollKind.UNKNOWN):
                # AWAY: the agent found the coordinator restarting or gone. UNKNOWN: whoever
                # answered does not know this process - a coordinator Ray restarted between two
                # polls, or the agent, which forgot it when its own poll found the coordinator
                # away while this process was between polls. Either way: register again.
                if self._reconnect(answer.reason):
                    continue
                return
            if answer.kind is not PollKind.ORDER or answer.order is None:
                self._lost(f"the coordinator answered {answer.kind}: {answer.reason}")
                return
            order = answer.order
            if order.job_id != self.job_id:
                logger.error(
                    "ray_graceful: ignored an order for job %s (this is job %s)",
                    order.job_id,
                    self.job_id,
                )
                continue
            self._ack(order)
            self.order_received.set()
            self.on_order(order)
            return

    def _ack(self, order: TeardownOrder) -> None:
        """Acknowledge ``order``, not waiting for the answer (a round trip, or a node agent's
        batch, before every teardown began); sent first, it still precedes the report."""
        try:
            ref = self.via.ack.remote(Ack(self.process_id, order.cycle, order.order_id))
        except Exception as exc:
            logger.warning(UNACKNOWLEDGED, exc)
            return
        ref.future().add_done_callback(_warn_if_unacknowledged)

    def _reconnect(self, why: str) -> bool:
        """Register again (same process id, same ranks) with the coordinator Ray restarts.

        Until it answers, ``cycle`` is None and ``reconnecting`` true; ``on_disconnect`` has the
        peers watched through the group's store, and ``on_link`` tells the rank's machine
        (restarting, then back: a SIGTERM meanwhile is reported then).
        """
        self.cycle, self.state, self.why = None, Channel.RECONNECTING, why
        self.reconnecting = True
        logger.warning("ray_graceful: coordinator unavailable (%s); registering again", why)
        self.on_disconnect()
        self.on_link(Link.RESTARTING)
        try:
            if not self._register_until_accepted(self._give_up()):
                return False
        finally:
            self.reconnecting = False
        logger.warning("ray_graceful: registered again, in cycle %s", self.cycle)
        self.on_link(Link.BACK)
        return True

    def _give_up(self) -> float:
        """When registering again stops: ``coordinator_reconnect_s`` from now."""
        return time.monotonic() + self.config.coordinator_reconnect_s

    def _lost(self, why: str) -> None:
        self.alive, self.state, self.why = False, Channel.LOST, why
        logger.warning(
            "ray_graceful: coordinator link lost (%s); SIGTERM now tears this rank down on its "
            "own and releases its peers through the group's store",
            why,
        )
        self.on_disconnect()
        self.on_link(Link.LOST)

    def report_sigterm(self, received_at: float) -> Told:
        """Tell the coordinator this process got SIGTERM: accepted; refused (no order to come,
        ``sigterm_refusal`` says why); restarting (Ray restarts it: once the channel is back,
        ``on_link(BACK)``, the rank's machine reports again); unanswered (a process just killed
        answers nothing for a second or so); unreachable (gone for good)."""
        if self.reconnecting:
            return Told.RESTARTING
        if not self.connected or self.cycle is None:  # no cycle: never registered
            return Told.UNREACHABLE
        seen = SigtermSeen(self.process_id, self.cycle, received_at)
        answer = call(self.handle.report_sigterm, seen, timeout=SIGTERM_REPORT_TIMEOUT_S)
        if isinstance(answer, NoAnswer):
            if answer.why is Why.RESTARTING:
                return Told.RESTARTING  # the control thread's poll fails too, and registers again
            if answer.why is Why.TIMEOUT:
                return Told.UNANSWERED  # dead and not yet found so, or busy: the poll tells
            self._lost(f"reporting SIGTERM: {answer}")
            return Told.UNREACHABLE
        self.sigterm_refusal = "" if answer.accepted else answer.reason
        if not answer.accepted and answer.retry:
            # Not registered with this coordinator yet: Ray restarted it and the node agent's
            # relay reached the new one first. The channel registers again (the agent answers
            # its poll AWAY), and the rank's machine reports again once it is back.
            return Told.RESTARTING
        return Told.ACCEPTED if answer.accepted else Told.REFUSED

    def wait_rejoined(self, cycle: int, wait_s: float) -> WarmResult | NoAnswer | None:
        """Until every member of the warm restart into ``cycle`` has said what it did (or
        ``wait_s``): how it stands then (``REJOINING``: not yet); None: no such warm restart;
        a ``NoAnswer`` if the coordinator could not be asked."""
        answer = call(self.handle.wait_rejoined, cycle, wait_s, timeout=wait_s + REPORT_TIMEOUT_S)
        if isinstance(answer, NoAnswer):
            return answer
        if not isinstance(answer, dict):  # None: the coordinator has no such record
            return None
        try:
            return WarmResult(answer.get("result"))
        except ValueError:
            return None

    def save_result(self, saved: list[str], failed: list[str], reason: str) -> None:
        """Tell the coordinator how this process's own saves went (its backups wait on it)."""
        if self.cycle is None:
            return
        message = SaveResult(self.process_id, self.cycle, tuple(saved), tuple(failed), reason)
        reply = call(self.handle.save_result, message, timeout=REPORT_TIMEOUT_S)
        if isinstance(reply, NoAnswer):  # its backups then wait for the report, or their limit
            logger.warning("ray_graceful: the save result did not reach the coordinator: %s", reply)

    def late_saved(
        self, cycle: int, saved: list[ShardRecord], failed: list[str], reason: str
    ) -> None:
        """Tell the coordinator where this process's held shards of ``cycle`` landed (if it is
        not told, it loses the step at its deadline)."""
        message = LateSave(self.process_id, cycle, tuple(saved), tuple(failed), reason)
        reply = call(self.handle.late_saved, message, timeout=REPORT_TIMEOUT_S)
        if isinstance(reply, NoAnswer) or not reply.accepted:
            why = reply if isinstance(reply, NoAnswer) else reply.reason
            logger.warning("ray_graceful: the late copy of cycle %s not taken: %s", cycle, why)

    def save_turn(self, cycle: int, key: str, wait_s: float) -> tuple[bool, str]:
        """As a backup saver: must this process save shard ``key``? Waits at most ``wait_s``."""
        asked = SaveTurn(self.process_id, cycle, key)
        answer = call(self.handle.save_turn, asked, wait_s, timeout=wait_s + REPORT_TIMEOUT_S)
        if isinstance(answer, NoAnswer):
            return False, f"could not ask the coordinator ({answer.why}: {answer})"
        if not isinstance(answer, TurnAnswer):
            return False, f"the coordinator answered a {type(answer).__name__}, not a TurnAnswer"
        return answer.save and answer.accepted, answer.why

    def left_unanswered(self, reason: str) -> None:
        """As a survivor ordered to rejoin: this process leaves before it joined (a SIGTERM, no
        word in time). The coordinator hands its slot out, or ends the warm restart now: the
        others would wait for it in the rendezvous (``WarmRestarts.left_unanswered``)."""
        left = Rejoined(RejoinResult.LEFT, self.process_id, reason=reason[:300], pid=os.getpid())
        reply = call(self.handle.rejoined, left, timeout=REPORT_TIMEOUT_S)
        if isinstance(reply, NoAnswer):
            logger.warning("ray_graceful: could not tell the coordinator it left: %s", reply)

    def rendezvous(self, wait_s: float) -> Rendezvous | NoAnswer | None:
        """Warm restart: this process's answer (join as what, or leave); None: not yet."""
        answer = call(self.handle.rendezvous, self.process_id, wait_s, timeout=wait_s + 30)
        return answer if isinstance(answer, Rendezvous | NoAnswer) else None

    def report(self, report: TeardownReport) -> None:
        """Send the TeardownReport before the process exits (bounded): through the node's
        agent, with its node's; to the coordinator itself if the agent could not pass it on."""
        if self.cycle is None:
            return
        if self.relay is not None:
            reply = call(
                self.relay.report_teardown, self.process_id, report, timeout=REPORT_TIMEOUT_S
            )
            if isinstance(reply, Reply) and (reply.accepted or not reply.retry):
                return  # taken, or refused by the coordinator itself: not sent again
            why = reply.reason if isinstance(reply, Reply) else str(reply)
            logger.warning("ray_graceful: the node agent did not pass the report on (%s)", why)
        reply = call(self.handle.report_teardown, self.process_id, report, timeout=REPORT_TIMEOUT_S)
        if isinstance(reply, NoAnswer):
            logger.warning("ray_graceful: the report did not reach the coordinator: %s", reply)
