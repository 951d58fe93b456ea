"""The worker side: what runs inside each rank's process.

- ``mixin.py``         the adoption point: ``GracefulWorkerMixin``
- ``setup.py``         ``after_init_process_group``, ``should_stop``: the public setup API,
                       and what it installed (``SetupStatus``)
- ``lifecycle.py``     the rank's machine: one pure ``step`` decides how a rank's life goes on;
                       ``rank_events.py`` its words (phases, events, actions)
- ``process_runtime.py`` the per-process state it acts on; every event source steps it there
- ``timers.py``        the one thread for every wait the machine asks for
- ``rejoin.py``        warm restart: keep the process, re-form the group, hold the committed step
- ``signals.py``       the SIGTERM listener (wakeup fd + thread), fork-safe
- ``control.py``       the transport to the coordinator (register, long poll, ack, report;
                       registering again with a coordinator Ray restarted)
- ``peer_release.py``  without a reachable coordinator: a rank leaving alone tells its peers
                       through the group's store, and they leave too
- ``training_loop.py`` where the training thread is, and the step a save holds (parking)
- ``teardown.py``      the ordered, guarded, timed steps that end a rank
- ``emergency_save.py``, ``save_ways.py``  a teardown's saves: each shard by the first of its
                       save ways that takes it (hold, hand off to keepers, write to disk)
- ``process_groups.py``, ``gloo.py``  releasing peers without a collective (abort / shutdown)
- ``report_file.py``   the ``TeardownReport``'s file and log line; ``exit_path.py`` how a
                       process leaves
- ``hard_deadline.py`` the kernel timer that ends a rank at its deadline whatever holds the GIL
- ``threads.py``       bounded calls and where the other threads are
- ``spare_wait.py``    spares and standbys that wait, and exit 0 when the job is over
- ``late_copy.py``     a held shard's copy to the keepers, behind the training
- ``peer_transfer.py`` a held shard sent to a spare over the new group
"""

from .mixin import GracefulWorkerMixin
from .rejoin import rejoin
from .setup import (
    GracefulSetupWarning,
    SetupStatus,
    add_process_group,
    after_init_process_group,
    install_signal_handling,
    should_stop,
    teardown_now,
)

__all__ = [
    "GracefulSetupWarning",
    "GracefulWorkerMixin",
    "SetupStatus",
    "add_process_group",
    "after_init_process_group",
    "install_signal_handling",
    "rejoin",
    "should_stop",
    "teardown_now",
]
