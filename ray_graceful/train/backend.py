"""``GracefulTorchConfig``: Ray Train's torch backend, with the evicted workers replaced alone.

Ray Train restarts its whole worker group when a worker fails - unless the backend declares
*replica groups* (``Backend.has_replica_groups``, a DeveloperAPI since Ray 2.56; torchft's is
the only backend in Ray that does). Then the controller replaces only the failing groups, in
their placement-group slots, and keeps the others' processes and training functions running
(``RAY_FACTS.md``, "Round 5"). Groups have one worker each, so a failing group is a failing
worker.

This backend declares them, forms the process group over all workers at the first start as
``TorchConfig`` does, and forms nothing for a replacement: the new worker joins the plugin's
group itself (``warm.setup``), at the evicted rank, together with the survivors that parked at
the step boundary (``warm.carry_on``). Everything else is ``TorchConfig``'s (backend, init
method, timeout). On a Ray without replica groups Train ignores the attribute and restarts
the whole group: the plugin's cold ending still holds (``warm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig

from .. import ray_adapter


def ray_has_replica_groups() -> bool:
    """Whether the installed Ray Train replaces a failing replica group alone (Ray >= 2.56)."""
    from ray.train.backend import Backend

    return hasattr(Backend, "has_replica_groups")


def _backend_class() -> type:
    base, replica_group = ray_adapter.train_torch_backend()

    class GracefulTorchBackend(base):  # type: ignore[misc, valid-type]
        """``TorchConfig``'s backend, for the whole group only (see the module docstring)."""

        has_replica_groups = True

        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            if replica_group is not None and isinstance(worker_group, replica_group):
                return  # a new worker in an evicted slot: it joins the plugin's group itself
            super().on_start(worker_group, backend_config)

        def on_training_start(self, worker_group: Any, backend_config: Any) -> None:
            if replica_group is not None and isinstance(worker_group, replica_group):
                return
            super().on_training_start(worker_group, backend_config)

    return GracefulTorchBackend


_BACKEND: type | None = None


@dataclass
class GracefulTorchConfig(TorchConfig):
    """``TorchConfig`` for the warm path: ``TorchTrainer(..., torch_config=GracefulTorchConfig())``
    with ``GracefulTrainCallback`` in the run's callbacks (which then turns ``warm_restart``
    on). The fields are ``TorchConfig``'s."""

    @property
    def backend_cls(self) -> type:
        global _BACKEND
        if _BACKEND is None:
            _BACKEND = _backend_class()
        return _BACKEND


def is_warm_path(backend_config: Any) -> bool:
    """Whether a run's backend config is the warm path's (on any Ray: where Ray has no replica
    groups, the warm path's ranks say so, and nobody is kept to rejoin - ``warm.setup``)."""
    return isinstance(backend_config, GracefulTorchConfig)
