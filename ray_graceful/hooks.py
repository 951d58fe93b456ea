"""The job-level worker setup hook: the SIGTERM listener for actors that cannot install it.

Async actors (SkyRL's and verl's workers) run every method, ``__init__`` included, off the main
thread, where ``signal.signal`` and ``signal.set_wakeup_fd`` raise. Ray runs a job's
``worker_process_setup_hook`` on the main thread of every worker process before its task loop
starts, so the listener is installed there::

    ray.init(runtime_env={"worker_process_setup_hook": "ray_graceful.hooks.setup"})

Ray's worker main loop installs its own SIGTERM handler right after the hook (Ray 2.60); left
alone it would replace ours and end the process with a SYSTEM_ERROR exit while the teardown
runs. ``setup`` therefore routes that one call to the listener, which keeps Ray's handler as the
one to run when nothing in the process is registered - so processes that never call
``graceful_setup`` behave exactly as before.
"""

from __future__ import annotations

import logging

from . import ray_adapter
from .config import ConfigError, GracefulConfig
from .worker.process_runtime import route_signals
from .worker.signals import current_listener, install_listener

logger = logging.getLogger(__name__)

HOOK = "ray_graceful.hooks.setup"


def setup() -> None:
    """Install the SIGTERM listener in this worker process (Ray calls this on the main thread).

    A job-wide hook runs in *every* worker process of the job - the coordinator's, Ray Train's
    controller, processes that never train. So it never raises: a bad
    ``RAY_GRACEFUL_*`` value is logged here, installs nothing, and is raised where the user's
    code calls ``graceful_setup`` (or ``Coordinator.start``), not by killing a worker at start.
    """
    try:
        GracefulConfig.from_env()
    except ConfigError as exc:
        logger.error("ray_graceful: setup hook installed nothing: %s", exc)
        return
    listener = install_listener(f"the job's setup hook {HOOK}")
    route_signals(listener)

    def adopt(handler: object) -> bool:
        if current_listener() is not listener:
            return False
        listener.adopt_previous(handler)  # type: ignore[arg-type]
        return True

    ray_adapter.route_worker_sigterm_handler(adopt)
