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

Times: the plan is made at ``now`` (the current time unless given; ``ray-graceful plan`` prints
it). A notice's ``deadline_in_s`` counts from ``now``; ``deadline`` is a real Unix time, which
must lie after ``now``; ``received_at`` defaults to ``now``.

Every mistake is reported with where it is (``notices[0].deadline_in_s``) and what is allowed;
a notice or health entry for a node or rank the topology does not have is a mistake too, never
dropped silently. The file is bounded (1 MiB) and values in messages are cut short, so a YAML
alias bomb gets an error, not gigabytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ..config import GracefulConfig
from ..health import VERDICTS
from ..notices import EvictionNotice, NoticeError, short
from ..plan import Key, RankInfo, TerminationPlan, TopologyError, parse_topology, plan_termination


class ScenarioError(ValueError):
    """The dry-run file is malformed; the message says where and what is allowed."""


MAX_SCENARIO_BYTES = 1 << 20


def load(path: str) -> Any:
    with open(path, "rb") as f:
        raw = f.read(MAX_SCENARIO_BYTES + 1)
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"larger than {MAX_SCENARIO_BYTES} bytes; a scenario is small")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            try:
                return yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ScenarioError(f"not valid YAML: {str(exc)[:300]}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScenarioError(f"not valid JSON ({exc}); YAML files end in .yaml") from None
    except ScenarioError:
        raise  # said already: not valid YAML or JSON
    except ValueError as exc:  # an integer of over 4,300 digits (Python's limit), in either
        raise ScenarioError(f"a number in it is out of range ({str(exc)[:120]})") from None
    except RecursionError:
        raise ScenarioError("nested too deeply to be a scenario") from None


def parse(
    data: Any, now: float | None = None
) -> tuple[list[RankInfo], list[EvictionNotice], dict[Key, str], dict[Key, str], GracefulConfig]:
    """Ranks, notices, health verdicts (and notes) and config from a scenario mapping."""
    now = time.time() if now is None else now
    try:
        return _parse(data, now)
    except RecursionError:
        raise ScenarioError("nested too deeply to be a scenario") from None


def _list(data: Mapping[str, Any], key: str) -> list[Any]:
    value = data.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ScenarioError(f"{key} must be a list, got {short(value)}")
    return value


def _parse(
    data: Any, now: float
) -> tuple[list[RankInfo], list[EvictionNotice], dict[Key, str], dict[Key, str], GracefulConfig]:
    if not isinstance(data, Mapping):
        raise ScenarioError(
            "a scenario is a mapping with 'ranks' (and optionally 'notices', 'health', 'config')"
        )
    unknown = sorted(str(k)[:40] for k in set(data) - {"ranks", "notices", "health", "config"})
    if unknown:
        raise ScenarioError(f"unknown keys {unknown}; allowed: ranks, notices, health, config")
    try:
        ranks = parse_topology(data.get("ranks"))
    except TopologyError as exc:
        raise ScenarioError(str(exc)) from exc
    overrides = data.get("config") or {}
    if not isinstance(overrides, Mapping):
        raise ScenarioError("config must be a mapping of GracefulConfig fields")
    unknown_fields = sorted(str(k)[:40] for k in overrides if k not in GracefulConfig.field_names())
    if unknown_fields:
        raise ScenarioError(
            f"config: unknown fields {unknown_fields}; allowed: "
            + ", ".join(GracefulConfig.field_names())
        )
    config = GracefulConfig(**{"checkpoint_dir": "/(dry run)", **overrides})  # never written

    by_node: dict[str, list[RankInfo]] = {}
    for info in ranks:
        by_node.setdefault(info.node_id, []).append(info)
    known = {info.key for info in ranks}

    notices = []
    for i, raw in enumerate(_list(data, "notices")):
        if not isinstance(raw, Mapping):
            raise ScenarioError(f"notices[{i}] is not a mapping")
        values = dict(raw)
        values.setdefault("cycle", 0)
        values.setdefault("received_at", now)
        if "deadline_in_s" in values:
            seconds = values.pop("deadline_in_s")
            if (
                not isinstance(seconds, (int, float))
                or isinstance(seconds, bool)
                or not 0 <= seconds <= 7 * 24 * 3600
            ):
                raise ScenarioError(
                    f"notices[{i}].deadline_in_s = {short(seconds)}: seconds from now, 0 to 604800"
                )
            values["deadline"] = now + seconds
        try:
            notice = EvictionNotice.parse(values, now=now)
        except (NoticeError, TypeError) as exc:
            raise ScenarioError(f"notices[{i}]: {str(exc)[:500]}") from None
        if notice.node_id is not None and notice.node_id not in by_node:
            raise ScenarioError(
                f"notices[{i}].node_id {short(notice.node_id)} has no rank in 'ranks' (nodes: "
                f"{short(sorted(by_node))})"
            )
        if notice.rank is not None and notice.rank not in known:
            raise ScenarioError(f"notices[{i}].rank {short(list(notice.rank))} is not in 'ranks'")
        notices.append(notice)

    health: dict[Key, str] = {}
    notes: dict[Key, str] = {}
    for i, raw in enumerate(_list(data, "health")):
        if not isinstance(raw, Mapping) or raw.get("verdict") not in VERDICTS:
            raise ScenarioError(f"health[{i}].verdict must be one of {', '.join(VERDICTS)}")
        if ("node" in raw) == ("rank" in raw):
            raise ScenarioError(f"health[{i}] names exactly one of node or rank")
        if "node" in raw:
            if not isinstance(raw["node"], str) or raw["node"] not in by_node:
                raise ScenarioError(f"health[{i}].node {short(raw['node'])} has no rank")
            keys = [r.key for r in by_node[raw["node"]]]
        else:
            rank = raw["rank"]
            if (
                not isinstance(rank, list)
                or len(rank) != 2
                or not isinstance(rank[0], str)
                or not isinstance(rank[1], int)
                or tuple(rank) not in known
            ):
                raise ScenarioError(
                    f"health[{i}].rank {short(rank)} must be [group, rank] of a rank in 'ranks'"
                )
            keys = [(rank[0], rank[1])]
        for key in keys:
            health[key] = raw["verdict"]
            if raw.get("reason"):
                notes[key] = short(raw["reason"], 200).strip("'\"")
    return ranks, notices, health, notes, config


def plan_file(path: str, now: float | None = None) -> TerminationPlan:
    now = time.time() if now is None else now
    ranks, notices, health, notes, config = parse(load(path), now)
    return plan_termination(ranks, notices, health, config, now, health_notes=notes)
