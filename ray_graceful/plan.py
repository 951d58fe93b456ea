"""Who saves, who just leaves: a pure function from what is known to a TerminationPlan.

Rules:

- an evicted rank has its notice's deadline; every other rank leaves within
  ``teardown_timeout_s``;
- a rank on FAULTY hardware never saves: it goes straight to teardown (the faulty node is the
  one that sets the job's recovery time);
- every shard gets exactly one saver: survivors (ranks not being evicted) before evicted ones,
  healthier before less healthy (HEALTHY, UNKNOWN, DEGRADED), then the most time left, then
  the lowest rank - and only a replica whose expected save fits before its deadline;
- the next viable replica of a shard (by the same preference) is its *backup*: it stays parked
  at its step boundary and saves only if the saver cannot (stuck in a collective after the
  release, refused as not quiescent, failed, died) - asked at the latest moment its own save
  still fits before its deadline (``start_by``), so a shard is not lost to one bad rank;
- if some shard has no viable saver, nobody saves (a partial checkpoint is never written as if
  complete) and the plan says why;
- only *complete* groups are planned for: a group whose registered ranks are not exactly
  ``0 .. world_size-1`` (a rank never registered, ranks that disagree on the world size) has
  no saver, its ranks just leave, and the plan names it in ``incomplete``. Its shards could not
  make a checkpoint a restart can load, so they are never part of one. With no complete group
  left, the checkpoint is abandoned.

Everything is one pass over the ranks and one over the shards: linear in the number of ranks
(``ray-graceful bench plan`` measures it).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from .config import GracefulConfig
from .health import DEGRADED, FAULTY, HEALTHY, UNKNOWN, VERDICTS
from .notices import EvictionNotice, short
from .place import Place
from .protocol import Action, RankKey, RankSpec, ShardId

Key = RankKey  # one rank-key type, the protocol's
_PREFERENCE = {HEALTHY: 0, UNKNOWN: 1, DEGRADED: 2}
_SEVERITY_OK = frozenset(VERDICTS)
_HEALTH_WORDS = {HEALTHY: "healthy", UNKNOWN: "health unknown", DEGRADED: "degraded"}
Candidate = tuple[tuple[bool, int, float, int], RankKey]  # (preference, key): lowest wins


class TopologyError(ValueError):
    """A topology is malformed; the message says what and what is allowed."""


class RankInfo(NamedTuple):
    """What the planner needs to know of one rank."""

    group: str
    rank: int
    node_id: str
    shard: str
    can_save: bool = True
    world_size: int = 0  # as the rank registered it; 0: not known (a dry-run topology)

    @classmethod
    def of(cls, spec: RankSpec, node_id: str) -> RankInfo:
        """What the planner needs of a registered rank (``RankSpec``) on ``node_id``."""
        return cls(spec.group, spec.rank, node_id, spec.shard, spec.can_save, spec.world_size)

    @property
    def key(self) -> Key:
        return (self.group, self.rank)


class RankPlan(NamedTuple):
    """The plan for one rank."""

    group: str
    rank: int
    node_id: str
    shard: str
    health: str
    action: Action
    reason: str
    deadline: float
    evicted: bool
    start_by: float = 0.0  # a backup: the latest time its save may start and still fit


class TerminationPlan(NamedTuple):
    orders: tuple[RankPlan, ...]
    savers: dict[ShardId, Key]
    abandoned: str | None
    created_at: float
    backups: dict[ShardId, Key]  # shard -> the replica that saves if its saver cannot
    incomplete: dict[str, str]  # group -> why it is not planned for (see incomplete_groups)

    def order_for(self, key: Key) -> RankPlan:
        for order in self.orders:
            if (order.group, order.rank) == key:
                return order
        raise KeyError(key)

    def to_dict(self) -> dict[str, Any]:
        return {
            "created_at": self.created_at,
            "abandoned": self.abandoned,
            "savers": [
                {"group": g, "shard": s, "rank": k[1]} for (g, s), k in sorted(self.savers.items())
            ],
            "backups": [
                {"group": g, "shard": s, "rank": k[1]} for (g, s), k in sorted(self.backups.items())
            ],
            "incomplete": dict(self.incomplete),
            "orders": [o._asdict() for o in self.orders],
        }

    def for_log(self, max_rows: int = 64) -> str:
        """The table, or for a larger plan one line of counts (16,384 rows per cycle once made
        the coordinator's log the slowest part of a teardown); ``status()`` has the table."""
        if len(self.orders) <= max_rows:
            return self.table()
        actions = Counter(str(o.action) for o in self.orders)
        nodes = len({o.node_id for o in self.orders})
        evicted = len({o.node_id for o in self.orders if o.evicted})
        counts = ", ".join(f"{n} {a}" for a, n in sorted(actions.items()))
        ending = (
            f"abandoned: {self.abandoned}" if self.abandoned else f"{len(self.savers)} shard(s)"
        )
        incomplete = f"; {len(self.incomplete)} group(s) not saved" if self.incomplete else ""
        return (
            f"{len(self.orders)} ranks on {nodes} nodes ({evicted} evicted): {counts}; "
            f"checkpoint {ending}, {len(self.backups)} with a backup{incomplete} "
            "(the full table: ray-graceful status)"
        )

    def table(self, now: float | None = None) -> str:
        """The plan as a table a person can read."""
        now = time.time() if now is None else now
        header = ("rank", "node", "shard", "health", "action", "deadline", "reason")
        rows = [
            (
                f"{o.group}/{o.rank}",
                o.node_id[:12],
                o.shard,
                o.health,
                o.action.upper() if o.action is not Action.LEAVE else str(o.action),
                f"{o.deadline - now:+.1f}s",
                o.reason,
            )
            for o in sorted(self.orders, key=lambda o: (o.group, o.rank))
        ]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
        lines = []
        for row in [header, *rows]:
            cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
            lines.append("  ".join([*cells, str(row[-1])]).rstrip())
        lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 6)
        for group, why in sorted(self.incomplete.items()):
            lines.append(f"group {group} not saved: {why}")
        if self.abandoned:
            lines.append(f"checkpoint abandoned: {self.abandoned}")
        else:
            lines.append(
                f"checkpoint: {len(self.savers)} shard(s), one saver each; "
                f"{len(self.backups)} with a backup"
            )
        return "\n".join(lines)


def plan_termination(
    topology: Iterable[RankInfo],
    notices: Iterable[EvictionNotice],
    health: Mapping[Key, str],
    config: GracefulConfig,
    now: float | None = None,
    expected_save_s: Mapping[ShardId, float] | None = None,
    health_notes: Mapping[Key, str] | None = None,
    destination: Place = Place.DISK,
) -> TerminationPlan:
    """Plan the end of a cycle; see the module docstring for the rules.

    ``destination`` names where savers write (``place.destination``); ``Place.NOWHERE``: there
    is nowhere to write, and the plan abandons the checkpoint saying so.
    """
    with cyclic_gc_paused():
        return _plan(
            topology, notices, health, config, now, expected_save_s, health_notes, destination
        )


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: for code that allocates a few small objects per rank
    and keeps them all (a plan, its orders). At 16,384 ranks the collector, set off by those
    allocations, rescans everything the coordinator holds again and again: measured, it doubled
    the time from a notice to every order. Nothing such code allocates makes a reference cycle,
    so nothing is left for the collector; it runs again as before afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _plan(
    topology: Iterable[RankInfo],
    notices: Iterable[EvictionNotice],
    health: Mapping[Key, str],
    config: GracefulConfig,
    now: float | None,
    expected_save_s: Mapping[ShardId, float] | None,
    health_notes: Mapping[Key, str] | None,
    destination: Place,
) -> TerminationPlan:
    now = time.time() if now is None else now
    expected = expected_save_s or {}
    topology = list(topology)
    incomplete = incomplete_groups(topology)
    ranks, best, second, shards = _rank_pass(
        topology, _notice_deadlines(notices, config), health, config, now, expected, incomplete
    )
    savers: dict[ShardId, Key] = {s: k for s, (_p, k) in best.items()}
    backups: dict[ShardId, Key] = {s: k for s, (_p, k) in second.items()}
    abandoned = _why_abandoned(destination, incomplete, shards, savers, config)
    if abandoned:
        savers, backups = {}, {}
    orders = _orders(
        ranks, savers, backups, incomplete, abandoned, health_notes or {}, expected, config
    )
    return TerminationPlan(orders, savers, abandoned, now, backups, incomplete)


NoticeDeadlines = tuple[dict[str, float], dict[Key, float]]  # by node, by rank
PlannedRank = tuple[RankInfo, Key, str, float, bool]  # info, key, verdict, deadline, evicted


def _margin(config: GracefulConfig) -> float:
    return config.watchdog_margin_s + config.plan_margin_s


def _notice_deadlines(notices: Iterable[EvictionNotice], config: GracefulConfig) -> NoticeDeadlines:
    """The earliest deadline the notices give each node, and each rank named on its own."""
    node_deadline: dict[str, float] = {}
    rank_deadline: dict[Key, float] = {}
    for notice in notices:
        deadline = notice.effective_deadline(config.teardown_timeout_s)
        if notice.node_id is not None:
            node_deadline[notice.node_id] = min(
                deadline, node_deadline.get(notice.node_id, deadline)
            )
        elif notice.rank is not None:  # a notice names a node or a rank (notices.py checks)
            key = notice.rank
            rank_deadline[key] = min(deadline, rank_deadline.get(key, deadline))
    return node_deadline, rank_deadline


def _rank_pass(
    topology: list[RankInfo],
    deadlines: NoticeDeadlines,
    health: Mapping[Key, str],
    config: GracefulConfig,
    now: float,
    expected: Mapping[ShardId, float],
    incomplete: dict[str, str],
) -> tuple[list[PlannedRank], dict[ShardId, Candidate], dict[ShardId, Candidate], set[ShardId]]:
    """One pass over the ranks (16,384 of them must plan in milliseconds): each rank's
    deadline, health and eviction, and the best and second-best saver of each shard."""
    node_deadline, rank_deadline = deadlines
    default_deadline = now + config.teardown_timeout_s
    ranks: list[PlannedRank] = []
    best: dict[ShardId, Candidate] = {}
    second: dict[ShardId, Candidate] = {}
    shards: set[ShardId] = set()
    margin = _margin(config)
    default_save = config.expected_save_s
    health_get, node_get, rank_get, expected_get = (
        health.get,
        node_deadline.get,
        rank_deadline.get,
        expected.get,
    )
    for info in topology:
        group, rank, node, shard, can_save, _world = info
        key = (group, rank)
        verdict = health_get(key, UNKNOWN)
        # An evicted rank has its notice's deadline (the earliest, if several); everyone else
        # leaves within the configured teardown time.
        node_d = node_get(node)
        rank_d = rank_get(key) if rank_deadline else None
        if node_d is None and rank_d is None:
            deadline, evicted = default_deadline, verdict == FAULTY
        else:
            deadline = min(d for d in (node_d, rank_d) if d is not None)
            evicted = True
        ranks.append((info, key, verdict, deadline, evicted))
        if incomplete and group in incomplete:
            continue  # never planned for: its shards cannot make a loadable checkpoint
        shard_id = ShardId(group, shard)
        shards.add(shard_id)
        if can_save and verdict != FAULTY:
            if now + expected_get(shard_id, default_save) + margin <= deadline:
                candidate = ((evicted, _PREFERENCE[verdict], -deadline, rank), key)
                current = best.get(shard_id)
                if current is None or candidate < current:
                    best[shard_id] = candidate
                    if current is not None:
                        second[shard_id] = current
                elif shard_id not in second or candidate < second[shard_id]:
                    second[shard_id] = candidate
        elif verdict not in _SEVERITY_OK:
            raise TopologyError(f"health for {group}/{rank} is {verdict!r}")
    return ranks, best, second, shards


def _why_abandoned(
    destination: Place,
    incomplete: dict[str, str],
    shards: set[ShardId],
    savers: dict[ShardId, Key],
    config: GracefulConfig,
) -> str | None:
    """Why no checkpoint can be made at all, or None."""
    if destination is Place.NOWHERE:
        return "nowhere to save: no checkpoint_dir is configured"
    if incomplete and not shards:
        return "no complete group: " + "; ".join(
            f"group {g}: {why}" for g, why in sorted(incomplete.items())[:5]
        )
    missing = [s.key for s in shards if s not in savers]
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
        return (
            f"shard(s) {shown} have no replica that is not FAULTY, can save, and has "
            f"{config.expected_save_s:.0f}s+{_margin(config):.0f}s before its deadline"
        )
    return None


def _orders(
    ranks: list[PlannedRank],
    savers: dict[ShardId, Key],
    backups: dict[ShardId, Key],
    incomplete: dict[str, str],
    abandoned: str | None,
    notes: Mapping[Key, str],
    expected: Mapping[ShardId, float],
    config: GracefulConfig,
) -> tuple[RankPlan, ...]:
    """Each rank's action and the reason it is given."""
    margin, default_save, expected_get = _margin(config), config.expected_save_s, expected.get
    saver_keys = set(savers.values())
    backup_of = {k: s for s, k in backups.items()}
    leave_reason = {s: f"rank {k[1]} saves shard {s[1]}" for s, k in savers.items()}
    orders: list[RankPlan] = []
    append = orders.append
    for info, key, verdict, deadline, evicted in ranks:
        group, rank, node, shard, can_save, _world = info
        start_by = 0.0
        if key in saver_keys:
            who = "evicted replica" if evicted else "survivor"
            action, reason = Action.SAVE, f"saves shard {shard} ({who}, {_HEALTH_WORDS[verdict]})"
        elif key in backup_of:
            shard_of = backup_of[key]
            action = Action.BACKUP
            reason = f"saves shard {shard} only if rank {savers[shard_of][1]} cannot"
            start_by = deadline - expected_get(shard_of, default_save) - margin
        elif verdict == FAULTY:
            note = notes.get(key)
            action, reason = (
                Action.LEAVE,
                "FAULTY hardware: never saves" + (f" ({note})" if note else ""),
            )
        elif group in incomplete:
            action, reason = Action.LEAVE, f"group {group} is incomplete: {incomplete[group]}"
        elif abandoned:
            action, reason = Action.LEAVE, "checkpoint abandoned"
        elif not can_save:
            action, reason = Action.LEAVE, "has no saver"
        else:
            action, reason = Action.LEAVE, leave_reason[ShardId(group, shard)]
        append(
            RankPlan(group, rank, node, shard, verdict, action, reason, deadline, evicted, start_by)
        )
    return tuple(orders)


def incomplete_groups(topology: Iterable[RankInfo]) -> dict[str, str]:
    """The groups whose ranks are not exactly ``0 .. world_size-1``, each with why.

    A checkpoint of such a group cannot be loaded by all of its ranks at one step (a rank
    that never registered has nothing saved for it), so it is never planned for. Groups whose
    ranks did not say their world size (``world_size`` 0, a dry-run topology) are taken as
    they are.
    """
    present, sizes = _ranks_and_sizes(topology)
    out = {}
    for group, declared in sizes.items():
        if len(declared) > 1:
            out[group] = f"its ranks disagree on the world size ({sorted(declared)[:4]})"
            continue
        world = next(iter(declared))
        ranks = present[group]
        missing = sorted(set(range(world)) - ranks)
        beyond = sorted(r for r in ranks if r >= world)
        if missing or beyond:
            why = f"{len(ranks & set(range(world)))} of {world} ranks registered"
            if missing:
                why += f" (missing: {_few(missing)})"
            if beyond:
                why += f" (ranks beyond the world size: {_few(beyond)})"
            out[group] = why
    return out


def missing_ranks(topology: Iterable[RankInfo]) -> dict[str, list[int]]:
    """Per group that agrees on its world size, the ranks below it that are not in ``topology``."""
    present, sizes = _ranks_and_sizes(topology)
    out = {}
    for group, declared in sizes.items():
        if len(declared) == 1:
            missing = sorted(set(range(next(iter(declared)))) - present[group])
            if missing:
                out[group] = missing
    return out


def _ranks_and_sizes(
    topology: Iterable[RankInfo],
) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Per group: the ranks present, and the world sizes they declared (0 is none)."""
    present: dict[str, set[int]] = {}
    sizes: dict[str, set[int]] = {}
    for info in topology:
        present.setdefault(info.group, set()).add(info.rank)
        if info.world_size > 0:
            sizes.setdefault(info.group, set()).add(info.world_size)
    return present, sizes


def _few(numbers: list[int]) -> str:
    more = f" and {len(numbers) - 8} more" if len(numbers) > 8 else ""
    return ", ".join(map(str, numbers[:8])) + more


def parse_topology(data: Any) -> list[RankInfo]:
    """Ranks from untrusted input (a topology file): errors name the entry and the field."""
    if isinstance(data, Mapping):
        data = data.get("ranks")
    if not isinstance(data, list) or not data:
        raise TopologyError('a topology is a non-empty list of ranks, or {"ranks": [...]}')
    seen: set[Key] = set()
    out = []
    for i, entry in enumerate(data):
        where = f"ranks[{i}]"
        if not isinstance(entry, Mapping):
            raise TopologyError(f"{where} is not a mapping")
        allowed = {"group", "rank", "node", "shard", "can_save", "world_size"}
        unknown = sorted(str(k)[:40] for k in set(entry) - allowed)
        if unknown:
            raise TopologyError(f"{where}: unknown fields {unknown}; allowed: {sorted(allowed)}")
        group = entry.get("group", "default")
        rank = entry.get("rank")
        node = entry.get("node")
        if not isinstance(group, str) or not group:
            raise TopologyError(f"{where}.group must be a non-empty string")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise TopologyError(f"{where}.rank = {short(rank)}: must be an integer >= 0")
        if not isinstance(node, str) or not node:
            raise TopologyError(f"{where}.node must be a non-empty string (a node id or name)")
        shard = entry.get("shard", rank)
        if not isinstance(shard, (str, int)) or isinstance(shard, bool):
            raise TopologyError(f"{where}.shard = {short(shard)}: must be a string or an integer")
        can_save = entry.get("can_save", True)
        if not isinstance(can_save, bool):
            raise TopologyError(f"{where}.can_save must be true or false")
        world_size = entry.get("world_size", 0)
        if "world_size" in entry and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise TopologyError(
                f"{where}.world_size = {short(world_size)}: must be an integer >= 1 (or left out)"
            )
        if (group, rank) in seen:
            raise TopologyError(f"{where}: {group}/{rank} appears twice")
        seen.add((group, rank))
        out.append(RankInfo(group, rank, node, str(shard), can_save, world_size))
    return out
