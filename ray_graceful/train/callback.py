"""The Ray Train callback: the run's coordinator, each worker's SIGTERM listener, its rank.

``GracefulTrainCallback`` (also loadable with
``RAY_TRAIN_CALLBACKS=ray_graceful.train.GracefulTrainCallback``) runs on Train's controller and
on each worker:

- on the controller it starts the run's coordinator, and ends it with the run; and, as Train
  creates the workers, their nodes' agents (``node/agent.py``);
- on each worker's main thread it installs the SIGTERM listener (the training function runs on
  a thread of its own, where no signal handler can be installed);
- on the cold path it registers each rank once Train formed the process group. On the warm
  path (``torch_config=GracefulTorchConfig()``) the training function registers itself
  (``warm.setup``), as it holds what a new worker loads into.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import ray_adapter
from ..config import GracefulConfig
from ..node.agent import agent_wanted, start_agents
from ..worker.setup import install_signal_handling, register_rank
from .loop import GROUP, train_shard

logger = logging.getLogger(__name__)


def _register_train_rank(config: GracefulConfig) -> str:
    """Runs on each Train worker (main thread) once the process group is up: the cold path."""
    import ray.train

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    shard = train_shard(config, rank)
    status = register_rank(
        GROUP, None, rank, ctx.get_world_size(), shard, None, config, train_fn_saves=True
    )
    return str(status)


class GracefulTrainCallback(*ray_adapter.train_callback_bases()):  # type: ignore[misc]
    """Turns ray_graceful on for a Ray Train V2 run (``RunConfig(callbacks=[...])``)."""

    def __init__(self, config: GracefulConfig | None = None) -> None:
        self.config = config or GracefulConfig.from_env()
        self._coordinator: Any = None
        self.warm = False  # the run's backend keeps survivors (GracefulTorchConfig)
        self._finished = False  # every worker's training function returned
        self.statuses: list[str] = []

    # --- on the controller -----------------------------------------------------------------

    def after_controller_start(self, train_run_context: Any) -> None:
        from ..coordinator import Coordinator, CoordinatorExists
        from .backend import is_warm_path

        self.warm = is_warm_path(getattr(train_run_context, "backend_config", None))
        if self.warm and not self.config.warm_restart:
            # torch_config=GracefulTorchConfig() is the switch: the warm path needs the
            # coordinator's warm restart (the store the new group forms through)
            logger.info("ray_graceful: GracefulTorchConfig turns warm_restart on for this run")
            self.config = self.config.replace(warm_restart=True)
        try:
            self._coordinator = Coordinator.start(self.config)
        except CoordinatorExists:
            # This job's driver started it already (coordinators are per job): theirs to end.
            self._coordinator = None

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        # Train created the workers (the whole group, or a replacement): each node's agent is
        # started now, beside Train's own setup of them - their train context, the process
        # group, the function's imports - rather than on the path of the first registration
        # there, which waited about 1.4 s for the agent's new process.
        if self._coordinator is not None:
            nodes, world_size = ray_adapter.train_worker_nodes(workers)
            if agent_wanted(self.config, world_size):
                try:
                    start_agents(self.config, self._coordinator.handle, nodes)
                except Exception as exc:  # the ranks start their agents themselves
                    logger.warning("ray_graceful: could not start the node agents: %r", exc)
        return {}

    def after_worker_group_training_start(self, worker_group: Any) -> None:
        # The process group is up by now (Ray Train's backend set it up when the group
        # started), whichever order the callbacks run in.
        if not self.warm:
            self.statuses = worker_group.execute(_register_train_rank, self.config)

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        # Every worker's training function returned: the run is over, and Train shuts the
        # workers down next. Said now, their going is no eviction ("died without a notice").
        statuses = getattr(worker_group_status, "worker_statuses", None) or {}
        if self._coordinator is None or self._finished or not statuses:
            return
        if all(not s.running and s.error is None for s in statuses.values()):
            self._finished = True
            self._coordinator.job_finished(success=True)

    def after_controller_finish(self, result: Any) -> None:
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            try:
                coordinator.job_finished(success=getattr(result, "error", None) is None)
            finally:
                coordinator.shutdown()

    # --- on each worker --------------------------------------------------------------------

    def after_init_train_context(self) -> None:
        # This runs on the Train worker's main thread: the one place signal handling can be
        # installed (the training function runs on its own thread). Train calls it for the
        # new worker it starts in an evicted slot too.
        install_signal_handling(self.config)
