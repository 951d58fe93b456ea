"""The job-level worker setup hook: the SIGTERM listener for actors that cannot install it.

Async actors (SkyRL's and verl's workers) run every method, ``__init__`` included, off the main
thread, where ``signal.signal`` and ``signal.set_wakeup_fd`` raise. Ray runs a job's
``worker_process_setup_hook`` on the main thread of every worker process before its task loop
starts, so the listener is installed there::

    ray.init(runtime_env={"worker_process_setup_hook": "ray_graceful.hooks.setup"})

Ray's worker main loop installs its own SIGTERM handler right after the hook (RAY_FACTS); left
alone it would replace ours and end the process with a SYSTEM_ERROR exit while the teardown
runs. ``setup`` therefore routes that one call to the listener, which keeps Ray's handler as the
one to run when nothing in the process is registered - so processes that never call
``graceful_setup`` behave exactly as before.
"""

from __future__ import annotations

import threading

from .config import GracefulConfig
from .signals import SignalListener, current_listener, install_listener, set_claim_check
from .worker import _process_runtime

HOOK = "ray_graceful.hooks.setup"


def setup() -> None:
    """Install the SIGTERM listener in this worker process (Ray calls this on the main thread)."""
    GracefulConfig.from_env()  # a bad RAY_GRACEFUL_* value fails the worker start, loudly
    listener = install_listener(f"the job's setup hook {HOOK}")
    runtime = _process_runtime()
    listener.on_signal = runtime.on_sigterm
    listener.on_main_thread_signal = runtime.on_sigterm_main_thread
    set_claim_check(lambda: _process_runtime().claims_signals())
    _keep_handler_when_ray_installs_its_own(listener)


def _keep_handler_when_ray_installs_its_own(listener: SignalListener) -> None:
    import ray._private.utils as ray_utils

    original = ray_utils.set_sigterm_handler
    if getattr(original, "_ray_graceful", False):
        return

    def set_sigterm_handler(handler):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread() and current_listener() is listener:
            listener.adopt_previous(handler)
            return
        original(handler)

    set_sigterm_handler._ray_graceful = True  # type: ignore[attr-defined]
    ray_utils.set_sigterm_handler = set_sigterm_handler
