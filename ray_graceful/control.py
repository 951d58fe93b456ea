"""A worker process's link to the coordinator: register, hold a long poll, report.

Pull, not push: a daemon thread of the worker holds a ``poll`` call to the coordinator open.
The coordinator answers every pending poll at once when it orders a teardown, so the order
reaches a rank whose training thread is blocked in a collective, and nothing about how the user
declared the actor changes (no concurrency group, no async method). Each poll also carries the
rank's last step and a fresh health verdict (NVML), which is how FAULTY hardware becomes a
notice.

If the coordinator is gone (killed, its node lost) the channel says so and stops; a SIGTERM then
tears the rank down on its own, exactly as without a coordinator.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING, Any

from .config import GracefulConfig
from .health import HealthProbe, NullProbe, make_probe
from .teardown import SaveOrder, TeardownReport

if TYPE_CHECKING:
    from .worker import _ProcessRuntime

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 15.0
REPORT_TIMEOUT_S = 2.0
SIGTERM_REPORT_TIMEOUT_S = 1.0


def find_coordinator(config: GracefulConfig) -> Any | None:
    """This job's coordinator, or None (not in Ray / none started for this job)."""
    try:
        import ray

        from .coordinator import coordinator_name

        if not ray.is_initialized():
            return None
        name = coordinator_name(config, ray.get_runtime_context().get_job_id())
        return ray.get_actor(name, namespace=config.coordinator_namespace)
    except (ValueError, ImportError):
        return None


def _gpu_indices() -> list[int]:
    try:
        import ray

        return [int(g) for g in ray.get_gpu_ids()]
    except Exception:
        return []


class ControlChannel:
    def __init__(self, runtime: _ProcessRuntime, handle: Any, config: GracefulConfig) -> None:
        import ray

        self.runtime = runtime
        self.handle = handle
        self.config = config
        ctx = ray.get_runtime_context()
        self.process_id = f"{ctx.get_worker_id()}"
        self.job_id = ctx.get_job_id() or ""
        from .coordinator import coordinator_name

        self.coordinator_name = coordinator_name(config, self.job_id)
        self.node_id = ctx.get_node_id()
        self.actor_id = ctx.get_actor_id() or ""
        self.cycle: int | None = None
        self.alive = True
        self.state = "connecting"
        self.order_received = threading.Event()
        self._thread: threading.Thread | None = None
        self._probe: HealthProbe | None = None

    @property
    def probe(self) -> HealthProbe:
        if self._probe is None:
            try:
                self._probe = make_probe(self.config, _gpu_indices(), self.node_id)
            except Exception as exc:  # an explicit health_probe='nvml' without NVML, say
                logger.warning("ray_graceful: health probe unavailable: %s", exc)
                self._probe = NullProbe(f"probe failed to start: {exc}", "probe_failed")
        return self._probe

    # --- calls -----------------------------------------------------------------------------

    def register(self) -> str:
        """(Re-)register every rank of this process; returns a line for the setup status."""
        import ray

        ranks = [
            {
                "group": reg.group.name,
                "rank": reg.group.rank,
                "world_size": reg.group.world_size,
                "shard": reg.shard,
                "can_save": reg.saver is not None or reg.cooperative,
                "cooperative": reg.cooperative,
                "gpus": _gpu_indices(),
            }
            for reg in self.runtime.registrations.values()
            if not reg.release_only
        ]
        try:
            answer = ray.get(
                # No health here: NVML may be slow to start (or wedged); the first poll, on the
                # control thread, carries the first verdict.
                self.handle.register.remote(
                    self.process_id,
                    self.node_id,
                    os.getpid(),
                    socket.gethostname(),
                    ranks,
                    None,
                    self.actor_id,
                    self.job_id,
                ),
                timeout=REGISTER_TIMEOUT_S,
            )
        except Exception as exc:
            self.alive, self.state = False, f"registration failed: {exc!r}"
            return (
                f"coordinator {self.coordinator_name!r} unreachable ({exc!r}): on "
                "SIGTERM this rank tears itself down on its own"
            )
        if not answer.get("accepted"):
            self.alive, self.state = False, f"registration refused: {answer.get('reason')}"
            return (
                f"coordinator refused the registration ({answer.get('reason')}): on SIGTERM "
                "this rank tears itself down on its own"
            )
        self.cycle = int(answer["cycle"])
        self.state = "polling"
        self.start()
        return (
            f"coordinator {self.coordinator_name!r}, cycle {self.cycle}: orders arrive "
            "through a long poll"
        )

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run, name="ray_graceful-control", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        import ray

        wait_s = self.config.health_interval_s
        while self.alive and self.runtime.teardown is None:
            state = {"last_step": self.runtime.last_step, "health": self.probe.check().to_dict()}
            try:
                order = ray.get(
                    self.handle.poll.remote(self.process_id, self.cycle, state, wait_s),
                    timeout=wait_s + 30,
                )
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception as exc:  # the coordinator died or became unreachable
                self._lost(f"{type(exc).__name__}: {exc}")
                return
            if order is None:
                continue
            if order.get("action") == "teardown":
                if order.get("job_id", self.job_id) != self.job_id:
                    logger.error(
                        "ray_graceful: ignored an order for job %s (this is job %s)",
                        order.get("job_id"),
                        self.job_id,
                    )
                    continue
                self.order_received.set()
                self._obey(order)
                return
            self._lost(f"the coordinator answered {order}")
            return

    def _lost(self, why: str) -> None:
        self.alive, self.state = False, f"lost: {why}"
        logger.warning(
            "ray_graceful: coordinator link lost (%s); SIGTERM now tears this rank down on its own",
            why,
        )

    def _obey(self, order: dict[str, Any]) -> None:
        runtime = self.runtime
        runtime.order = order
        if any(reg.cooperative for reg in runtime.registrations.values()):
            runtime.cooperative_stop(order)
            return
        save_orders, skipped = [], []
        for save in order.get("saves", []):
            reg = runtime.registrations.get((save["group"], save["rank"]))
            if reg is None or reg.saver is None:
                skipped.append(f"{save['shard']}: this process has no saver for it")
            else:
                save_orders.append(
                    SaveOrder(
                        save["root"],
                        save["shard"],
                        order["save_budget_s"],
                        reg.saver,
                        reg.group.name,
                        reg.group.rank,
                    )
                )
        skip_reason = "; ".join([order.get("skip_reason", ""), *skipped]).strip("; ")
        runtime.begin_teardown(
            trigger=f"coordinator order ({order.get('trigger', '')})",
            deadline=float(order["deadline"]),
            cycle=int(order["cycle"]),
            save_orders=save_orders,
            skip_save_reason=skip_reason or "the plan has another replica save",
        )

    def report_sigterm(self, received_at: float) -> bool:
        """Tell the coordinator this process got SIGTERM; False if it could not be told."""
        import ray

        if not self.alive:
            return False
        try:
            answer = ray.get(
                self.handle.report_sigterm.remote(self.process_id, self.cycle, received_at),
                timeout=SIGTERM_REPORT_TIMEOUT_S,
            )
        except Exception as exc:
            self._lost(f"reporting SIGTERM: {exc!r}")
            return False
        return bool(answer.get("accepted"))

    def report(self, report: TeardownReport) -> None:
        """Send the TeardownReport before the process exits (bounded)."""
        import ray

        if self.cycle is None:
            return
        try:
            ray.get(
                self.handle.report_teardown.remote(self.process_id, report.cycle, report.to_dict()),
                timeout=REPORT_TIMEOUT_S,
            )
        except Exception as exc:
            logger.warning("ray_graceful: the report did not reach the coordinator: %r", exc)
