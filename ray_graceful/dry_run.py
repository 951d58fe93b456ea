"""A planning dry run from a file: ``ray-graceful plan scenario.yaml``.

The file (JSON or YAML) describes a topology, and optionally the notices, the health verdicts
and config overrides to plan with::

    ranks:
      - {group: policy, rank: 0, node: node-a, shard: "0"}
      - {group: policy, rank: 1, node: node-b, shard: "0"}
    notices:
      - {source: drain, node_id: node-b, deadline_in_s: 30, reason: spot reclaim}
    health:
      - {node: node-a, verdict: FAULTY, reason: xid_79}
    config: {expected_save_s: 5, checkpoint_dir: /ckpt}

Every mistake is reported with where it is (``notices[0].deadline_in_s``) and what is allowed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from .config import GracefulConfig
from .health import VERDICTS
from .notices import EvictionNotice, NoticeError
from .plan import Key, RankInfo, TerminationPlan, TopologyError, parse_topology, plan_termination


class ScenarioError(ValueError):
    """The dry-run file is malformed; the message says where and what is allowed."""


def load(path: str) -> Any:
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ScenarioError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{path}: not valid JSON ({exc}); YAML files end in .yaml") from exc


def parse(
    data: Any, now: float | None = None
) -> tuple[list[RankInfo], list[EvictionNotice], dict[Key, str], dict[Key, str], GracefulConfig]:
    """Ranks, notices, health verdicts (and notes) and config from a scenario mapping."""
    now = time.time() if now is None else now
    if not isinstance(data, Mapping):
        raise ScenarioError(
            "a scenario is a mapping with 'ranks' (and optionally 'notices', 'health', 'config')"
        )
    unknown = sorted(set(data) - {"ranks", "notices", "health", "config"})
    if unknown:
        raise ScenarioError(f"unknown keys {unknown}; allowed: ranks, notices, health, config")
    try:
        ranks = parse_topology(data.get("ranks"))
    except TopologyError as exc:
        raise ScenarioError(str(exc)) from exc
    overrides = data.get("config") or {}
    if not isinstance(overrides, Mapping):
        raise ScenarioError("config must be a mapping of GracefulConfig fields")
    try:
        config = GracefulConfig(**{"checkpoint_dir": "(dry run)", **overrides})
    except TypeError as exc:
        raise ScenarioError(f"config: {exc}") from exc

    notices = []
    for i, raw in enumerate(data.get("notices") or []):
        if not isinstance(raw, Mapping):
            raise ScenarioError(f"notices[{i}] is not a mapping")
        values = dict(raw)
        values.setdefault("cycle", 0)
        values.setdefault("received_at", now)
        if "deadline_in_s" in values:
            seconds = values.pop("deadline_in_s")
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
                raise ScenarioError(f"notices[{i}].deadline_in_s = {seconds!r}: seconds >= 0")
            values["deadline"] = now + seconds
        try:
            notices.append(EvictionNotice.parse(values))
        except NoticeError as exc:
            raise ScenarioError(f"notices[{i}]: {exc}") from exc

    by_node: dict[str, list[RankInfo]] = {}
    for info in ranks:
        by_node.setdefault(info.node_id, []).append(info)
    health: dict[Key, str] = {}
    notes: dict[Key, str] = {}
    for i, raw in enumerate(data.get("health") or []):
        if not isinstance(raw, Mapping) or raw.get("verdict") not in VERDICTS:
            raise ScenarioError(f"health[{i}].verdict must be one of {', '.join(VERDICTS)}")
        if ("node" in raw) == ("rank" in raw):
            raise ScenarioError(f"health[{i}] names exactly one of node or rank")
        if "node" in raw:
            if raw["node"] not in by_node:
                raise ScenarioError(f"health[{i}].node {raw['node']!r} has no rank")
            keys = [r.key for r in by_node[raw["node"]]]
        else:
            rank = raw["rank"]
            if not isinstance(rank, list) or len(rank) != 2:
                raise ScenarioError(f"health[{i}].rank must be [group, rank]")
            keys = [(rank[0], rank[1])]
        for key in keys:
            health[key] = raw["verdict"]
            if raw.get("reason"):
                notes[key] = str(raw["reason"])
    return ranks, notices, health, notes, config


def plan_file(path: str, now: float | None = None) -> TerminationPlan:
    now = time.time() if now is None else now
    ranks, notices, health, notes, config = parse(load(path), now)
    return plan_termination(ranks, notices, health, config, now, health_notes=notes)
