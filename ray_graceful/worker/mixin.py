"""The adoption point: ``GracefulWorkerMixin``, one call after ``init_process_group``.

``GracefulWorkerMixin`` goes on the *undecorated* worker base class (SkyRL's
``DistributedTorchRayActor``, OpenRLHF's ``BaseDistributedActor``, verl's ``Worker``). It is a
plain class on purpose: no ``__init__`` to call, no ``async def`` method (one would silently
turn a sync actor into an async one), no concurrency group (declaring any moves every method of
a sync actor off the main thread). Adopting it changes nothing about how the actor runs. Its
methods hand over to the setup API (``setup.py``), the per-process runtime
(``process_runtime.py``) and the warm restart (``rejoin.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..config import GracefulConfig
from ..protocol import Rejoined
from .process_groups import SetupError
from .rejoin import rejoin
from .save_ways import Saver
from .setup import SetupStatus, add_process_group, after_init_process_group, should_stop


def _defined_by_mixin(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is still the mixin's own (Ray wraps actor methods: unwrap first)."""
    fn = inspect.unwrap(getattr(cls, name))
    return getattr(fn, "__qualname__", "") == f"GracefulWorkerMixin.{name}"


def _check_actor_shape(owner: object) -> None:
    """Refuse a class whose names clash with the mixin's, with the clash named."""
    stop = getattr(owner, "should_stop", None)
    if stop is not None and not callable(stop):
        raise SetupError(
            f"{type(owner).__name__}.should_stop is {stop!r}, not a method: an attribute of the "
            "worker shadows GracefulWorkerMixin.should_stop(). Rename the attribute."
        )
    for name in ("should_stop", "emergency_checkpoint"):
        method = getattr(type(owner), name, None)
        if method is not None and inspect.iscoroutinefunction(inspect.unwrap(method)):
            raise SetupError(
                f"{type(owner).__name__}.{name} is 'async def': it is called from the teardown "
                "thread, not the event loop, so it must be a plain 'def'."
            )


class GracefulWorkerMixin:
    """Mix into the undecorated worker base; call ``graceful_setup()`` after init_process_group.

    Override ``emergency_checkpoint(path, step)`` to save this rank's state (or pass
    ``state_dict=`` to ``graceful_setup``); call ``should_stop(step)`` at step boundaries.
    """

    def graceful_setup(
        self,
        name: str = "default",
        *,
        process_group: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        shard: str | int | None = None,
        state_dict: Callable[[], Any] | None = None,
        saver: Saver | None = None,
        config: GracefulConfig | None = None,
        load_state_dict: Callable[[Any], Any] | None = None,
    ) -> SetupStatus:
        """Register this rank (see ``after_init_process_group``); returns what was installed.

        How this rank saves: ``state_dict=`` (the default saver), ``saver=`` (e.g.
        ``ray_graceful.dcp_saver(...)``), or an override of ``emergency_checkpoint``.
        """
        _check_actor_shape(self)
        overridden = not _defined_by_mixin(type(self), "emergency_checkpoint")
        if overridden and (state_dict is not None or saver is not None):
            raise SetupError(
                f"{type(self).__name__} overrides emergency_checkpoint and also passed "
                f"{'state_dict' if state_dict is not None else 'saver'}=: use one of them."
            )
        return after_init_process_group(
            name,
            process_group=process_group,
            rank=rank,
            world_size=world_size,
            shard=shard,
            saver=self.emergency_checkpoint if overridden else saver,
            state_dict=state_dict,
            config=config,
            load_state_dict=load_state_dict,
        )

    def graceful_rejoin(
        self,
        *,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], Any] | None = None,
        config: GracefulConfig | None = None,
        backend: str | None = None,
    ) -> Rejoined:
        """Warm restart: join the next cycle's group in this process (``ray_graceful.rejoin``).

        A survivor of an eviction calls it once its training call returned; a spare calls it
        at once, and it waits there until it is handed a slot or the job ends.
        """
        return rejoin(
            state_dict=state_dict,
            load_state_dict=load_state_dict,
            config=config,
            backend=backend,
        )

    def should_stop(self, step: int | None = None) -> bool:
        """True once a teardown began (see ``ray_graceful.should_stop``)."""
        return should_stop(step)

    def emergency_checkpoint(self, path: str, step: int) -> tuple[int, int] | None:
        """Write this rank's state for ``step`` at ``path`` (a file or a directory).

        Called on the teardown thread, after peers were released: use no collective. The
        write is made atomic around you (temp name, fsync, rename). The default is replaced
        by ``state_dict=`` in ``graceful_setup``, or by overriding this method.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no emergency saver: override emergency_checkpoint(path, "
            "step) or pass state_dict= to graceful_setup"
        )

    def graceful_add_group(self, process_group: Any, name: str) -> None:
        """Register an extra process group to release on teardown."""
        add_process_group(process_group, name)
