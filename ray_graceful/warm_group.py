"""The driver's side of a warm restart: the workers, their spares, and one call to go on.

Hand-built groups (verl, SkyRL, OpenRLHF) drive their workers from the driver: each training
call is a remote call on every worker. When an eviction ends one, the others' calls fail too
(their collectives were released). ``WarmGroup.restart()`` is then the one call that brings the
group back without new processes::

    group = ray_graceful.WarmGroup(coordinator, workers, spares=[Worker.remote(...)])
    while True:
        try:
            ray.get([w.train.remote(...) for w in group.workers])
            break
        except ray.exceptions.RayError:
            group.restart()          # survivors + spares, re-formed in place

Spares are started by the constructor, which returns once the coordinator has them: each waits
inside its rejoin method (``graceful_rejoin`` by default, called with ``args``) until it is
handed an evicted slot. ``restart`` waits for the eviction's outcome, calls the same method on
every worker still alive, and returns once every member joined -
``group.workers`` is then the new group in rank order. If the coordinator decided against a
warm restart (no committed step, no spare and no smaller size allowed...), or a member failed,
every rank has left cleanly and ``WarmRestartFailed`` says why: restart cold from the
checkpoint, as without one.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

from .coordinator import Coordinator
from .notices import short
from .outcome import TerminationOutcome
from .protocol import Rejoined


class WarmRestartFailed(RuntimeError):
    """The group could not be re-formed in place; every rank has left or is being ended by the
    coordinator. ``.reason`` says why."""

    def __init__(self, reason: str, outcome: TerminationOutcome | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.outcome = outcome


class WarmRestartInProgress(RuntimeError):
    """``restart()`` was called while another call on the same group runs: one eviction has one
    restart, and ``group.workers`` is the one it returns. Wait for that call instead."""


@dataclass(frozen=True)
class WarmRestart:
    """What ``WarmGroup.restart`` did: the eviction's outcome and each member's ``Rejoined``."""

    outcome: TerminationOutcome
    members: tuple[Rejoined, ...]  # in rank order

    @property
    def step(self) -> int:
        """The step training resumes from (every member holds it)."""
        return self.members[0].step

    @property
    def world_size(self) -> int:
        return self.members[0].world_size


class WarmGroup:
    """A hand-built worker group that comes back in place after an eviction."""

    def __init__(
        self,
        coordinator: Coordinator,
        workers: list[Any],
        spares: list[Any] = (),  # type: ignore[assignment]
        method: str = "graceful_rejoin",
        args: tuple[Any, ...] = (),
    ) -> None:
        self.coordinator = coordinator
        self.workers = list(workers)
        self.method, self.args = method, args
        self._spares: dict[Any, Any] = {}  # ObjectRef of its pending rejoin -> the spare
        self._restarting = threading.Lock()  # held by the one restart() that runs
        self.add_spares(spares)

    @property
    def spares(self) -> list[Any]:
        """The spares still waiting for a slot."""
        return list(self._spares.values())

    def add_spares(self, spares: list[Any], timeout: float = 120.0) -> None:
        """Start spares waiting (each in its rejoin method); return once the coordinator has them.

        A spare that is not registered yet when an eviction comes cannot take the slot, so this
        waits (bounded) until the coordinator lists them; ``TimeoutError`` says how many came.
        """
        import ray

        if not spares:
            return
        before = len(self.coordinator.status()["spares"])
        for spare in spares:
            self._spares[getattr(spare, self.method).remote(*self.args)] = spare
        deadline = time.monotonic() + timeout
        while (waiting := len(self.coordinator.status()["spares"])) < before + len(spares):
            failed, _ = ray.wait(list(self._spares), timeout=0)
            if failed or time.monotonic() > deadline:
                why: object = f"not within {timeout}s"
                if failed:
                    try:
                        why = ray.get(failed[0])
                    except Exception as exc:  # its rejoin method raised: say what
                        why = exc
                raise TimeoutError(
                    f"{waiting - before} of {len(spares)} spare(s) registered ({short(why)})"
                )
            time.sleep(0.05)

    def restart(self, timeout: float = 60.0) -> WarmRestart:
        """Re-form the group after an eviction; ``WarmRestartFailed`` where it cannot be.

        Members are matched by the ids the coordinator gave them: a spare whose call ended
        without such an id (it left on its own SIGTERM, or died) leaves the pool. Where some
        members joined and another did not, the coordinator ends those that joined through a
        cycle of their new group; ``WarmRestartFailed`` is raised once that cycle's outcome is
        out (or ``timeout`` is spent), never while they still run.

        ``WarmRestartInProgress`` at once if another ``restart()`` of this group runs: two calls
        at once took each other's members, one raised a bare ``KeyError``, the other failed
        after its timeout, and ``group.workers`` was left stale.
        """
        if not self._restarting.acquire(blocking=False):
            raise WarmRestartInProgress(
                "another restart() of this group is running: one eviction has one restart - "
                "wait for that call's result (group.workers is set by it)"
            )
        try:
            return self._restart(timeout)
        finally:
            self._restarting.release()

    def _restart(self, timeout: float) -> WarmRestart:
        import ray

        until = time.monotonic() + timeout
        try:
            outcome = self.coordinator.wait_outcome(timeout=timeout)
        except ray.exceptions.RayError as exc:  # the survivors leave by themselves
            raise WarmRestartFailed(f"the coordinator is gone ({type(exc).__name__})") from exc
        if outcome is None:
            raise WarmRestartFailed(f"no outcome of the eviction within {timeout}s")
        warm = outcome.warm or {}
        if warm.get("result") != "rejoining":
            raise WarmRestartFailed(
                warm.get("reason") or "warm_restart is off in the coordinator's config", outcome
            )
        members = {m["member"] for m in warm["members"]}
        calls = {getattr(w, self.method).remote(*self.args): w for w in self.workers}
        spares_needed = sum(1 for m in warm["members"] if m["was"].startswith("spare"))
        why: list[str] = []
        calls.update(self._assigned_spares(members, spares_needed, until, why))
        joined = self._members_joined(calls, members, until, timeout, why)
        if len(joined) != len(members):
            if joined:  # the coordinator ends them: wait for that cycle's outcome
                left_s = max(until - time.monotonic(), 1.0)
                with contextlib.suppress(ray.exceptions.RayError):
                    self.coordinator.wait_outcome(timeout=left_s, cycle=warm["cycle"])
            raise WarmRestartFailed(
                f"{len(joined)} of {len(members)} member(s) joined ({'; '.join(why[:3])})",
                outcome,
            )
        joined.sort(key=lambda pair: (pair[0].group, pair[0].rank))
        self.workers = [actor for _, actor in joined]
        return WarmRestart(outcome, tuple(result for result, _ in joined))

    def _members_joined(
        self,
        calls: dict[Any, Any],
        members: set[str],
        until: float,
        timeout: float,
        why: list[str],
    ) -> list[tuple[Rejoined, Any]]:
        """The answers of the new group's members, as they come; done once every member has
        answered. An evicted worker's call is never waited for: on a host that was cut off or
        fell silent it answers only when Ray declares the host dead (about 64 s), long after
        the members joined."""
        import ray

        joined: list[tuple[Rejoined, Any]] = []
        pending = dict(calls)
        while pending and len(joined) < len(members):
            left_s = until - time.monotonic()
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(left_s, 0.0))
            if not ready:
                why.append(f"no answer within {timeout}s")
                break
            actor = pending.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                why.append(type(exc).__name__)  # an evicted worker: gone, as it should be
                continue
            if isinstance(result, Rejoined) and result.joined and result.member in members:
                joined.append((result, actor))
            elif isinstance(result, Rejoined):
                why.append(f"{result.was or result.member}: {result.reason}")
        return joined

    def _assigned_spares(
        self, members: set[str], needed: int, until: float, why: list[str]
    ) -> dict[Any, Any]:
        """The calls of the ``needed`` spares the coordinator handed a slot, by member id.

        A spare's call ends when it was handed a slot (and joined, or failed to) - or when it
        left without one: its own SIGTERM, the job's end, its death. Those leave the pool.
        """
        import ray

        found: dict[Any, Any] = {}
        while len(found) < needed and self._spares:
            left_s = max(until - time.monotonic(), 0.0)
            ready, _ = ray.wait(list(self._spares), num_returns=1, timeout=left_s)
            if not ready:
                why.append(f"{needed - len(found)} assigned spare(s) did not answer in time")
                break
            spare = self._spares.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                why.append(f"a spare: {type(exc).__name__}")
                continue
            if isinstance(result, Rejoined) and result.member in members:
                found[ready[0]] = spare
        return found
