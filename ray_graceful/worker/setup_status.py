"""What ``graceful_setup`` installed for a rank, and the warning it gives when it could not.

``SetupStatus`` is what the call returns (and prints as a few lines for the actor's log): the
rank and group torch.distributed reports, where they came from, which shard it saves, whether
the SIGTERM listener is in place, and how it reaches the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass


class GracefulSetupWarning(RuntimeWarning):
    """graceful_setup could not install everything; the message names the fix."""


@dataclass(frozen=True)
class SetupStatus:
    """What ``graceful_setup`` installed for one rank, and why."""

    group: str
    rank: int
    world_size: int
    backends: tuple[str, ...]
    rank_source: str
    shard: str
    can_save: bool
    listener_installed: bool
    listener: str
    control: str
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [
            f"ray_graceful: group {self.group!r} rank {self.rank}/{self.world_size} "
            f"({', '.join(self.backends) or '?'}; from {self.rank_source})",
            f"  shard: {self.shard!r}; emergency save: {'yes' if self.can_save else 'no saver'}",
            f"  SIGTERM listener: {self.listener}",
            f"  control: {self.control}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
