"""Spares and standbys: workers that wait, and exit 0 when the job is over.

A *spare* can be handed an evicted rank's slot for the next cycle; a *standby* only waits for
the job to end. Both register with the coordinator and hold a long poll, like an active rank;
when the driver says the job succeeded or is closed for good (``Coordinator.job_finished``),
each is told to exit and leaves through Ray's intended-exit path with status 0 - never hanging
until the scheduler kills it (NVIDIA's resiliency PR 266 is the anchor).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..bounded import NoAnswer, Why, call
from ..config import GracefulConfig
from ..protocol import Reply, SpareAction, SpareAnswer
from .control import find_coordinator
from .process_groups import SetupError
from .process_runtime import ProcessRuntime, process_runtime
from .rank_events import SpareAssigned, SpareDismissed, SpareWaiting
from .setup import listener_status

MAX_POLL_FAILURES = 5


@dataclass(frozen=True)
class SpareResult:
    """What ended the wait: ``action`` is "exit", "assigned" or "timeout"."""

    action: SpareAction
    reason: str = ""
    group: str | None = None
    rank: int | None = None
    cycle: int | None = None
    spare_id: str = ""  # how the coordinator knows this spare (a warm restart's member id)


def wait_as_spare(
    role: str = "spare",
    config: GracefulConfig | None = None,
    timeout: float | None = None,
    exit_on_finish: bool = True,
) -> SpareResult:
    """Register as a spare or standby and wait for the coordinator's word.

    Returns when the job is over ("exit": with ``exit_on_finish`` the process then ends with
    status 0 as soon as the calling actor method returns), when a spare is given a slot
    ("assigned": join the group for ``cycle`` as ``group/rank``), when the process gets SIGTERM
    ("exit", it is being evicted itself), or after ``timeout`` seconds ("timeout").
    """
    return _wait(role, config, timeout, exit_on_finish, joins_if_named=False)


def wait_in_rejoin(config: GracefulConfig) -> SpareResult:
    """A spare's wait inside ``rejoin()``: as ``wait_as_spare``, but signalled once a decided
    warm restart names it, it still gets its slot ("assigned") - it joins, and its signal is the
    new group's first notice, as a survivor's (the others wait for it in the rendezvous)."""
    return _wait("spare", config, None, exit_on_finish=False, joins_if_named=True)


def _wait(
    role: str,
    config: GracefulConfig | None,
    timeout: float | None,
    exit_on_finish: bool,
    joins_if_named: bool,
) -> SpareResult:
    import ray

    if role not in ("spare", "standby"):
        raise SetupError(f"role {role!r} is not allowed: 'spare' or 'standby'")
    runtime = process_runtime()
    config = runtime.adopt_config(config)
    handle = find_coordinator(config)
    if handle is None:
        raise SetupError(
            f"wait_as_spare: no coordinator named {config.coordinator_name!r} runs in namespace "
            f"{config.coordinator_namespace!r}; start one on the driver with "
            "ray_graceful.Coordinator.start()"
        )
    ctx = ray.get_runtime_context()
    spare_id = f"{role}-{ctx.get_worker_id() or uuid.uuid4().hex}"
    runtime.spare_id = spare_id
    runtime.step(SpareWaiting())
    listener_status(config, "wait_as_spare on the main thread", warn=False)
    poll = _SparePoll(handle, spare_id, role, ctx.get_node_id(), config)
    poll.register()
    poll.thread.start()
    result = _until_word(poll, runtime, timeout, joins_if_named)
    result = dataclasses.replace(result, spare_id=spare_id)
    if result.action == SpareAction.ASSIGNED:
        runtime.spare_id = None
        runtime.step(SpareAssigned())
    if result.action == SpareAction.EXIT and exit_on_finish:
        runtime.step(SpareDismissed(result.reason))  # the machine: it leaves, status 0
    return result


def _until_word(
    poll: _SparePoll, runtime: ProcessRuntime, timeout: float | None, joins_if_named: bool
) -> SpareResult:
    """The coordinator's word, a SIGTERM, or the timeout: whichever comes first. Signalled,
    it leaves the pool - unless ``joins_if_named`` and the coordinator answers that a decided
    warm restart names it (``Coordinator.leave_spare``): its word is then on its way."""
    end = None if timeout is None else time.monotonic() + timeout
    named = False
    try:
        while not poll.done.wait(0.05):
            if not poll.thread.is_alive() and poll.result is None:
                return SpareResult(SpareAction.EXIT, "the spare's poll thread ended unexpectedly")
            signalled = runtime.stop_event.is_set() or runtime.machine.held_signal() is not None
            if signalled and not named:
                reply = call(poll.handle.leave_spare, poll.spare_id, "SIGTERM", timeout=2)
                named = joins_if_named and _named_by_a_warm_restart(reply)
                if not named:
                    return SpareResult(SpareAction.EXIT, "SIGTERM: this spare is being evicted")
            if end is not None and time.monotonic() > end:
                return SpareResult(
                    SpareAction.TIMEOUT, f"no word from the coordinator in {timeout}s"
                )
        assert poll.result is not None  # set before ``done``
        return poll.result
    finally:
        poll.done.set()


def _named_by_a_warm_restart(reply: object) -> bool:
    """``leave_spare`` refused, naming the cycle of the decided warm restart this spare is in."""
    return isinstance(reply, Reply) and not reply.accepted and reply.cycle is not None


class _SparePoll:
    """A spare's long poll, on a thread of its own, until the coordinator's word (``result``)."""

    def __init__(
        self, handle: Any, spare_id: str, role: str, node_id: str, config: GracefulConfig
    ) -> None:
        self.handle, self.spare_id, self.role, self.node_id = handle, spare_id, role, node_id
        self.config = config
        self.result: SpareResult | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name="ray_graceful-spare-poll", daemon=True
        )
        self.failures = 0
        self.unavailable_since: float | None = None

    def register(self) -> None:
        answer = call(
            self.handle.register_spare,
            *(self.spare_id, self.role, self.node_id, os.getpid()),
            timeout=30,
        )
        if isinstance(answer, NoAnswer):
            raise SetupError(f"the coordinator did not take this {self.role}: {answer}")
        if not answer.accepted:
            raise SetupError(f"the coordinator refused this {self.role}: {answer.reason}")

    def _run(self) -> None:
        while not self.done.is_set():
            answer = self._ask()
            if answer is None:
                continue
            if not isinstance(answer, SpareAnswer) or answer.action not in (
                SpareAction.EXIT,
                SpareAction.ASSIGNED,
            ):
                answer = SpareAnswer(SpareAction.EXIT, f"the coordinator answered {answer!r}")
            self.result = SpareResult(
                answer.action, answer.reason, answer.group, answer.rank, answer.cycle
            )
            self.done.set()

    def _ask(self) -> Any:
        """One poll: the coordinator's answer; None to poll again; an "exit" answer where the
        coordinator is gone, was not back within ``coordinator_reconnect_s``, or could not be
        polled ``MAX_POLL_FAILURES`` times."""
        config = self.config
        wait_s = config.health_interval_s
        answer = call(self.handle.poll_spare, self.spare_id, wait_s, timeout=wait_s + 30)
        if not isinstance(answer, NoAnswer):
            self.failures, self.unavailable_since = 0, None
            if isinstance(answer, SpareAnswer) and answer.action == SpareAction.REGISTER:
                self.register()  # Ray restarted the coordinator: its pool starts empty
                return None
            return answer
        if answer.why is Why.TIMEOUT:
            return None
        if answer.why is Why.RESTARTING:  # as ranks, wait
            now = time.monotonic()
            self.unavailable_since = self.unavailable_since or now
            if now - self.unavailable_since < config.coordinator_reconnect_s:
                time.sleep(0.2)
                return None
            why = f"the coordinator was not back within coordinator_reconnect_s ({answer})"
            return SpareAnswer(SpareAction.EXIT, why)
        if answer.why is Why.DEAD:
            return SpareAnswer(SpareAction.EXIT, f"the coordinator is gone ({answer})")
        self.failures += 1  # anything else: retry a few times, then leave
        if self.failures < MAX_POLL_FAILURES:
            time.sleep(min(0.2 * 2**self.failures, config.health_interval_s))
            return None
        why = f"the coordinator could not be polled {self.failures} times ({answer})"
        return SpareAnswer(SpareAction.EXIT, why)
