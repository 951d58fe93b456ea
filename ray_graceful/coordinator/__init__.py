"""The coordinator side: one actor per job that turns notices into a bounded, reported end.

- ``events.py``     what goes into the cycle machine (events) and what comes out (decisions)
- ``machine.py``    the cycle machine: every rule, no Ray, no I/O, no futures
- ``cycle.py``      one cycle's phases and what it saw
- ``conclusion.py`` what to commit, committing it (on a thread), the outcome record
- ``registry.py``   the processes and ranks it knows
- ``spare_pool.py`` the spares and standbys waiting for their word
- ``warm_restarts.py`` warm restarts: who rejoins, which spare takes which slot
- ``held.py``       a warm restart's held step: held, in the keepers, on disk, or lost
- ``actor.py``      the Ray actor: a thin shell that owns futures, tasks and I/O, and these parts:
- ``effects.py``    what each of the machine's decisions does in the world
- ``watch.py``      Ray's drain state and lost ranks, polled from injected sources
- ``memory.py``     the memory tier: keepers (from an injected factory), hand-on, durable copy
- ``backups.py``    backup savers waiting on their saver's fate
- ``outcomes.py``   outcomes published once, waited on, read back after a restart
- ``recovery.py``   coming back after Ray restarted it: the cycle count and a cycle left in
                    flight, read from disk (committed from the shards there, or abandoned)
- ``gc_freeze.py``  what a teardown holds, kept out of the cyclic GC
- ``handle.py``     the driver's handle: ``Coordinator.start``/``connect``/``notify``/...
"""

from .actor import CoordinatorActor
from .cycle import Phase
from .handle import Coordinator, CoordinatorExists, coordinator_name, running_coordinators

__all__ = [
    "Coordinator",
    "CoordinatorActor",
    "CoordinatorExists",
    "Phase",
    "coordinator_name",
    "running_coordinators",
]
