"""How long a SIGTERMed rank waits for its coordinator's order before going alone.

The order is worth waiting for: the coordinator's plan has a healthy replica save each shard
and releases the peers with this rank, while a rank going alone saves its own shard and the
cycle is abandoned. The wait comes out of the rank's own teardown time, so it is bounded:

- the SIGTERM reported and taken: ``order_wait_s``, never so long that the release and the exit
  no longer fit before the deadline;
- the coordinator restarting (Ray restarts its process), restarted since the report (which
  died with it), or silent (a process SIGKILLed a moment ago answers nothing for about a second
  before Ray finds it dead): the control thread registers again and reports the SIGTERM to the
  new process (``ControlChannel._reconnect``), and a restart takes 1-2 s - often more than
  ``order_wait_s``. The rank waits while its channel is not lost, for as long as going alone
  afterwards still leaves it its own save (``save_budget_s``);
- the coordinator gone for good, or never reached, or refusing the report (a process it does
  not know, a cycle that is over): no wait, and the reason is the teardown's trigger.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import GracefulConfig
from .control import ControlChannel


def await_order(
    control: ControlChannel,
    config: GracefulConfig,
    received_at: float,
    has_order: Callable[[], bool],
) -> str | None:
    """Report the SIGTERM received at ``received_at`` and wait for the order: None once
    ``has_order()``, else why the rank goes alone."""
    deadline = received_at + config.teardown_timeout_s
    # Never longer than leaves the teardown its release and exit before the deadline.
    latest = deadline - config.watchdog_margin_s - config.destroy_timeout_s
    restarts = control.restarts_seen
    told = control.report_sigterm(received_at)
    if told == "accepted":
        control.order_received.wait(max(0.0, min(config.order_wait_s, latest - time.time())))
    restarted = told == "restarting" or control.restarts_seen > restarts
    if not has_order() and (restarted or told == "unanswered"):
        _while_not_lost(control, latest - config.save_budget_s, has_order)
        restarted = restarted or control.restarts_seen > restarts
    if has_order():
        return None
    if restarted:
        back = "no order from it" if control.connected else "it was not back"
        return f"the coordinator restarted; {back} while this rank's own save still fit"
    if told == "unanswered":
        return "the coordinator did not answer while this rank's own save still fit"
    if told == "refused":
        return f"the coordinator refused the SIGTERM report: {control.sigterm_refusal}"
    if not control.connected:
        return "coordinator unreachable"
    return f"no order from the coordinator within {config.order_wait_s}s"


def _while_not_lost(control: ControlChannel, until: float, has_order: Callable[[], bool]) -> None:
    """Until the order, ``until`` (Unix seconds), or the channel lost (gone for good)."""
    while not has_order() and control.alive:
        left = until - time.time()
        if left <= 0:
            return
        control.order_received.wait(min(0.05, left))
