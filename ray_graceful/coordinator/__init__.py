"""The coordinator side: one actor per job that turns notices into a bounded, reported end.

- ``actor.py``    the actor: registration, the long poll (fan-out), notices, transitions
- ``cycle.py``    one cycle's state machine and its conclusion (commit, outcome)
- ``registry.py`` the processes, ranks and spares it knows
- ``handle.py``   the driver's handle: ``Coordinator.start``/``connect``/``notify``/...
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
