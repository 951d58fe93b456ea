"""Spares and standbys: workers that wait, and exit 0 when the job is over.

A *spare* can be handed an evicted rank's slot for the next cycle; a *standby* only waits for
the job to end. Both register with the coordinator and hold a long poll, like an active rank;
when the driver says the job succeeded or is closed for good (``Coordinator.job_finished``),
each is told to exit and leaves through Ray's intended-exit path with status 0 - never hanging
until the scheduler kills it (NVIDIA's resiliency PR 266 is the anchor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import uuid
from dataclasses import dataclass

from ..config import GracefulConfig
from ..protocol import SpareAction, SpareAnswer
from .control import find_coordinator
from .exit_path import exit_when_idle, write_stderr
from .process_groups import SetupError
from .process_runtime import process_runtime
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
    listener_status(config, "wait_as_spare on the main thread", warn=False)

    def register() -> None:
        answer = ray.get(
            handle.register_spare.remote(spare_id, role, ctx.get_node_id(), os.getpid()),
            timeout=30,
        )
        if not answer.accepted:
            raise SetupError(f"the coordinator refused this {role}: {answer.reason}")

    register()
    box: dict[str, SpareResult] = {}
    done = threading.Event()

    def poll() -> None:
        failures = 0
        unavailable_since: float | None = None
        while not done.is_set():
            try:
                order = ray.get(
                    handle.poll_spare.remote(spare_id, config.health_interval_s),
                    timeout=config.health_interval_s + 30,
                )
                failures, unavailable_since = 0, None
                if isinstance(order, SpareAnswer) and order.action == SpareAction.REGISTER:
                    register()  # Ray restarted the coordinator: its pool starts empty
                    continue
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.ActorUnavailableError as exc:  # restarting: as ranks, wait
                now = time.monotonic()
                unavailable_since = unavailable_since or now
                if now - unavailable_since < config.coordinator_reconnect_s:
                    time.sleep(0.2)
                    continue
                order = SpareAnswer(
                    SpareAction.EXIT,
                    f"the coordinator was not back within coordinator_reconnect_s ({exc})",
                )
            except ray.exceptions.RayActorError as exc:
                order = SpareAnswer(SpareAction.EXIT, f"the coordinator is gone ({exc})")
            except Exception as exc:  # anything else: retry a few times, then leave
                failures += 1
                if failures < MAX_POLL_FAILURES:
                    time.sleep(min(0.2 * 2**failures, config.health_interval_s))
                    continue
                order = SpareAnswer(
                    SpareAction.EXIT,
                    f"the coordinator could not be polled {failures} times ({exc!r})",
                )
            if order is None:
                continue
            if not isinstance(order, SpareAnswer) or order.action not in (
                SpareAction.EXIT,
                SpareAction.ASSIGNED,
            ):
                order = SpareAnswer(SpareAction.EXIT, f"the coordinator answered {order!r}")
            box["result"] = SpareResult(
                order.action, order.reason, order.group, order.rank, order.cycle
            )
            done.set()

    poller = threading.Thread(target=poll, name="ray_graceful-spare-poll", daemon=True)
    poller.start()
    end = None if timeout is None else time.monotonic() + timeout
    while not done.wait(0.05):
        if not poller.is_alive() and "result" not in box:
            box["result"] = SpareResult(
                SpareAction.EXIT, "the spare's poll thread ended unexpectedly"
            )
            break
        if runtime.stop_event.is_set():
            with contextlib.suppress(Exception):
                ray.get(handle.leave_spare.remote(spare_id, "SIGTERM"), timeout=2)
            box["result"] = SpareResult(SpareAction.EXIT, "SIGTERM: this spare is being evicted")
            break
        if end is not None and time.monotonic() > end:
            box["result"] = SpareResult(
                SpareAction.TIMEOUT, f"no word from the coordinator in {timeout}s"
            )
            break
    done.set()
    box["result"] = dataclasses.replace(box["result"], spare_id=spare_id)
    runtime.spare_id = None if box["result"].action == SpareAction.ASSIGNED else spare_id
    if box["result"].action == SpareAction.EXIT and exit_on_finish:
        _exit_when_idle(config, box["result"].reason)
    return box["result"]


def _exit_when_idle(config: GracefulConfig, reason: str) -> None:
    """End this process with status 0 once the current actor method returned."""
    write_stderr(f"ray_graceful: spare/standby exiting: {reason}\n")
    exit_when_idle(f"ray_graceful spare exit ({reason})", config.exit_grace_s + 5.0)
