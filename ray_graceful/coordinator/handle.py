"""The driver's handle on its job's coordinator: start it, find it, tell it, read from it.

``Coordinator.start(config)`` on the driver (or the Ray Train callback) starts this job's
coordinator actor next to the driver; workers and the CLI find it by name. One coordinator per
Ray job by default (``coordinator_name``), so one job's notices can never stop another's ranks.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from ..bounded import NoAnswer, Why, call, wait_until
from ..config import GracefulConfig
from ..outcome import TerminationOutcome
from ..protocol import DEFAULT_NAME, JobClosed, Reply, SpareAssigned, coordinator_name
from .actor import MAX_CONCURRENCY, CoordinatorActor


class CoordinatorExists(RuntimeError):
    """A coordinator of that name already runs."""


def running_coordinators(config: GracefulConfig) -> list[str]:
    """Names of the coordinators alive in ``config.coordinator_namespace``."""
    import ray

    prefix = config.coordinator_name or DEFAULT_NAME
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == config.coordinator_namespace and a["name"].startswith(prefix)
    )


class Coordinator:
    """The driver's handle on the coordinator actor."""

    def __init__(self, handle: Any, config: GracefulConfig, name: str = "") -> None:
        self.handle = handle
        self.config = config
        self.name = name  # the actor's name: the job's coordinator, ray_graceful_coordinator-<job>

    @classmethod
    def start(cls, config: GracefulConfig | None = None, node_id: str | None = None) -> Coordinator:
        """Start this job's coordinator on this node (the driver's, usually the head).

        It is named after this Ray job (or ``config.coordinator_name``) in
        ``config.coordinator_namespace``; the job's workers and the CLI find it there. Starting
        a second one under the same name raises ``CoordinatorExists``; a ``checkpoint_dir`` this
        process cannot write, ``ConfigError``.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        config = config or GracefulConfig.from_env()
        config.check_checkpoint_dir("Coordinator.start")  # here, not at the eviction
        ctx = ray.get_runtime_context()
        name = coordinator_name(config, ctx.get_job_id())
        try:
            ray.get_actor(name, namespace=config.coordinator_namespace)
        except ValueError:
            pass
        else:
            raise CoordinatorExists(
                f"a coordinator named {name!r} already runs in namespace "
                f"{config.coordinator_namespace!r}: use Coordinator.connect()"
            )
        actor = ray.remote(CoordinatorActor).options(
            name=name,
            namespace=config.coordinator_namespace,
            num_cpus=0,
            max_concurrency=MAX_CONCURRENCY,
            # Restarted by Ray where it was if its process dies (coordinator/recovery.py).
            max_restarts=config.coordinator_max_restarts,
            # Next to the driver (the head, usually): the node least likely to be evicted.
            # Pinned: a soft affinity to the head put a zero-CPU actor on another node 9 times
            # in 12 (Ray 2.60, docs/concepts.md) - a node that can be drained under the job.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id or ctx.get_node_id(), soft=False
            ),
        )
        handle = actor.remote(config, ctx.get_job_id())
        ray.get(handle.ping.remote(), timeout=60)  # type: ignore[attr-defined]
        return cls(handle, config, name)

    @classmethod
    def connect(
        cls, config: GracefulConfig | None = None, timeout: float = 10.0, job_id: str | None = None
    ) -> Coordinator:
        """Find a running coordinator; ValueError (saying which exist) if none fits.

        ``job_id`` picks the coordinator of that job; without it, this driver's own job's, else
        the only one running in the namespace (the CLI, which is a job of its own).
        """
        import ray

        config = config or GracefulConfig.from_env()
        names = running_coordinators(config)
        if config.coordinator_name:
            wanted = config.coordinator_name
        elif job_id is not None:
            wanted = coordinator_name(config, job_id)
        elif coordinator_name(config, ray.get_runtime_context().get_job_id()) in names:
            wanted = coordinator_name(config, ray.get_runtime_context().get_job_id())
        elif len(names) == 1:
            wanted = names[0]
        else:
            raise ValueError(
                f"{len(names)} coordinators run in namespace {config.coordinator_namespace!r}"
                + (f" ({', '.join(names)}): pick one with --job JOB_ID" if names else "")
            )
        handle = ray.get_actor(wanted, namespace=config.coordinator_namespace)
        ray.get(handle.ping.remote(), timeout=timeout)
        return cls(handle, config, wanted)

    @classmethod
    def connect_all(cls, config: GracefulConfig | None = None) -> list[Coordinator]:
        """Every coordinator running in the namespace (one per job that uses ray_graceful).

        A node's eviction concerns every job with ranks on it: ``notify --this-node`` without
        ``--job`` tells them all, and each one that has no rank there refuses it.
        """
        import ray

        config = config or GracefulConfig.from_env()
        if config.coordinator_name:
            return [cls.connect(config)]
        out = []
        for name in running_coordinators(config):
            try:
                handle = ray.get_actor(name, namespace=config.coordinator_namespace)
                out.append(cls(handle, config, name))
            except ValueError:
                continue  # it ended between the listing and now
        return out

    def _ask(self, method: str, *args: Any, timeout: float) -> Any:
        """Call the coordinator; while Ray restarts it (``coordinator_max_restarts``), again -
        the call that met its death fails with ``ActorUnavailableError``, the next one waits for
        the new process - until ``timeout``."""
        import ray

        give_up = time.monotonic() + timeout
        while True:
            left = max(give_up - time.monotonic(), 0.0)
            try:
                return ray.get(getattr(self.handle, method).remote(*args), timeout=left)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.1)

    def notify(
        self,
        *,
        node_id: str | None = None,
        rank: tuple[str, int] | None = None,
        reason: str = "notified",
        deadline: float = 0.0,
        source: str = "api",
        timeout: float = 10.0,
    ) -> Reply:
        """Send a notice; the ``Reply`` says whether it was accepted, and why not."""
        data: dict[str, Any] = {"source": source, "reason": reason, "deadline": deadline}
        if node_id is not None:
            data["node_id"] = node_id
        if rank is not None:
            data["rank"] = list(rank)
        return self._ask("notify", data, timeout=timeout)

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """Diagnostics: cheap counters (pid, cycle, phase, processes, pending polls, polls
        served) for benchmarks, soaks and tests; `status()` is the view for people."""
        return self._ask("stats", timeout=timeout)

    def status(self, timeout: float = 10.0) -> dict[str, Any]:
        return self._ask("status", timeout=timeout)

    def wait_outcome(self, timeout: float, cycle: int | None = None) -> TerminationOutcome | None:
        """The outcome of ``cycle`` (default: the current one), waiting up to ``timeout``."""
        outcome: TerminationOutcome | None = self._ask(
            "wait_outcome", cycle, timeout, timeout=timeout + 10
        )
        return outcome

    def wait_durable(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """Memory tier: when cycle ``cycle``'s checkpoint landed in ``checkpoint_dir``.

        ``{"path", "at"}``, or ``{"error"}`` if the background copy failed; None if it had not
        ended within ``timeout`` (or that cycle committed nothing in memory).
        """
        durable: dict[str, Any] | None = self._ask(
            "wait_durable", cycle, timeout, timeout=timeout + 10
        )
        return durable

    def durability(self, cycle: int, timeout: float = 10.0) -> dict[str, Any] | None:
        """Where cycle ``cycle``'s step is now: ``stage`` is "held" (by the warm restart's
        survivors, in their memory), "committing", "in-keepers" (committed in memory),
        "on-disk" (its manifest written) or "lost" (never committed: ``reason``); ``held``,
        ``in_keepers``, ``missing`` and ``at`` (stage -> when) say the rest. None if that
        cycle committed nothing in memory and held nothing."""
        return self._ask("durability", cycle, timeout=timeout)

    def memory_record(self, cycle: int, timeout: float = 10.0) -> dict[str, Any] | None:
        """Memory tier: what cycle ``cycle``'s memory checkpoint holds and went through, now.

        ``holders`` per shard, ``handed_on`` (moved off a leaving node), ``lost`` (why it can no
        longer be restored from memory), ``durable_path``; None if that cycle committed nothing
        in memory. The outcome keeps what was committed at the time; this is its later life.
        """
        return self._ask("memory_record", cycle, timeout=timeout)

    def wait_rejoined(self, cycle: int, timeout: float) -> dict[str, Any] | None:
        """Warm restart into ``cycle``: who joined as what, loaded from where, how long.

        Waits until every member said what it did (or ``timeout``); None if no warm restart led
        into that cycle.
        """
        record: dict[str, Any] | None = self._ask(
            "wait_rejoined", cycle, timeout, timeout=timeout + 10
        )
        return record

    def keeper_stats(self) -> dict[str, Any]:
        """Memory tier: every node's keeper - its budget, what it holds."""
        return self._ask("keeper_stats", timeout=30)

    def job_finished(self, success: bool = True, permanent: bool = True) -> JobClosed:
        """Tell spares and standbys the job is over: they exit 0."""
        closed: JobClosed = self._ask("job_finished", success, permanent, timeout=30)
        return closed

    def assign_spare(self, group: str, rank: int) -> SpareAssigned:
        """Hand a waiting spare the slot of ``group/rank`` for the next cycle; its answer names
        the spare, or says why none was given (``.assigned`` is False)."""
        assigned: SpareAssigned = self._ask("assign_spare", group, rank, timeout=30)
        return assigned

    def shutdown(self, timeout: float = 10.0) -> None:
        """End the coordinator and its keepers, and wait (bounded) until its name is free again.

        ``ray.kill`` returns before the actor is gone; a second run in the same job (a second
        ``trainer.fit()``) would otherwise find the name taken by a dying coordinator. Keepers
        outlive a coordinator's crash (``memory/keeper.py``), so they are ended here, at once;
        one this cannot name (a coordinator that does not answer) leaves on its own once the
        coordinator is gone.
        """
        import ray

        keepers = call(self.handle.keeper_stats, timeout=2.0)
        ray.kill(self.handle)
        namespace = self.config.coordinator_namespace
        for stats in keepers.values() if isinstance(keepers, dict) else ():
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(stats["name"], namespace=namespace))

        def dead() -> bool:  # then its name is released with it
            answer = call(self.handle.ping, timeout=1.0)
            return isinstance(answer, NoAnswer) and answer.why is Why.DEAD

        wait_until(dead, timeout, every=0.05)
