"""The memory tier's coordinator side with fake keepers: hand-on, the durable copy, a lost shard.

``MemoryTier`` is written against the keeper's call shape (``memory/keeper.py``:
``RemoteKeeper``), so these keepers are plain objects holding tensors in a dict - the real
keeper actors and real drains are ``test_memory_tier.py`` and ``faults/``. The disk is real:
the durable copy writes shards and a manifest that ``latest_committed`` reads back.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import pytest

from ray_graceful import GracefulConfig, latest_committed
from ray_graceful.checkpoint import ShardRecord, save_state_dict, shard_file_name, write_shard
from ray_graceful.coordinator import recovery
from ray_graceful.coordinator.memory import MemoryTier
from ray_graceful.memory.commit import MemoryCheckpoint
from ray_graceful.outcome import publish_record
from ray_graceful.protocol import Reply

pytestmark = pytest.mark.unit


class FakeKeeper:
    """A keeper in this process: what it holds, what it was asked; it can be made to die."""

    def __init__(self, node: str, budget: int = 1 << 30) -> None:
        self.node, self.budget = node, budget
        self.held: dict[tuple[int, str], Any] = {}
        self.cycles: dict[tuple[int, str], int] = {}  # what cycle handed each shard over
        self.released: list[dict[str, Any]] = []
        self.persisted: list[tuple[int, str]] = []
        self.dead = False

    def _alive(self) -> None:
        if self.dead:
            raise RuntimeError(f"keeper on {self.node} died")

    async def hold(self, cycle, step, shard, value, nbytes, group, rank, timeout, chunks=None):
        self._alive()
        if nbytes > self.budget:
            return Reply.refused("over its budget")
        self.held[(step, shard)] = value
        self.cycles[(step, shard)] = cycle
        return Reply.ok(cycle)

    async def fetch(self, step: int, shard_key: str) -> Any:
        self._alive()
        return self.held.get((step, shard_key))

    async def persist(self, root: str, step: int, shard_key: str) -> dict[str, Any]:
        self._alive()
        self.persisted.append((step, shard_key))
        value = self.held[(step, shard_key)]
        record = write_shard(
            root, step, shard_key, lambda p, s: save_state_dict({"v": value}, p), group="g"
        )
        return record.to_dict()

    def release(self, below_step: int | None = None, cycle: int | None = None) -> None:
        self.released.append({"below_step": below_step, "cycle": cycle})

    async def ping(self) -> str:
        self._alive()
        return "ok"

    async def stats(self) -> dict[str, Any]:
        self._alive()
        shards = [
            {"step": step, "shard": key, "bytes": 10, "cycle": self.cycles.get((step, key), 0)}
            for step, key in sorted(self.held)
        ]
        return {"name": f"keeper-{self.node}", "node_id": self.node, "shards": shards}


@pytest.fixture
def config(tmp_path):
    return GracefulConfig(
        report_dir=str(tmp_path / "reports"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        memory_replicas=1,
        health_probe="none",
    )


def tier(config, home: str = "head", before_persist=None) -> tuple[MemoryTier, dict]:
    keepers: dict[str, FakeKeeper] = {}

    def start(name: str, node: str) -> FakeKeeper:
        assert name.endswith(node), "a keeper is named after its node"
        keepers[node] = FakeKeeper(node)
        return keepers[node]

    def publish(name, record):
        publish_record(config.report_dir, "job", name, record)

    memory = MemoryTier(config, "job", "c0ffee", start, home, publish, before_persist)
    return memory, keepers


def held_checkpoint(keepers: dict, step: int, where: dict[str, str], cycle: int = 0):
    """A memory checkpoint of ``{shard: node}``, each shard put in that node's keeper."""
    shards = {}
    for key, node in where.items():
        keepers[node].held[(step, key)] = f"{key}@{step}"
        keepers[node].cycles[(step, key)] = cycle
        name = shard_file_name(key)
        shards[key] = ShardRecord(key, step, name, 10, 0, "g", 0, tier="memory", holders=(node,))
    return MemoryCheckpoint("job", cycle, step, shards)


def read_record(config, name: str) -> dict:
    with open(os.path.join(config.report_dir, "job", f"{name}.json")) as f:
        return json.load(f)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def test_every_node_with_ranks_gets_a_keeper_and_the_home_node_one_too(config):
    memory, keepers = tier(config)
    for node in ("a", "b", "a"):
        memory.ensure_keeper(node)
    assert sorted(keepers) == ["a", "b", "head"]
    memory.leaving["b"] = time.time() + 5
    assert memory.nodes() == ["head", "a"], "no shard is placed on a leaving node"


def test_the_durable_copy_lands_with_its_own_record_and_the_older_step_is_released(config):
    async def scenario():
        memory, keepers = tier(config)
        for node in ("a", "b"):
            memory.ensure_keeper(node)
        checkpoint = held_checkpoint(keepers, 9, {"g/0": "a", "g/1": "b"})
        memory.after_commit(0, checkpoint)
        durable = await memory.wait_durable(0, 10)
        return memory, keepers, durable

    memory, keepers, durable = run(scenario())
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert latest.step == 9 and durable["path"] == latest.path
    assert read_record(config, "durable-cycle-0") == {"cycle": 0, **durable}
    assert read_record(config, "memory-cycle-0") == memory.record(0)
    assert memory.record(0)["durable_path"] == latest.path
    assert {"below_step": 9, "cycle": None} in keepers["a"].released


def test_two_cycles_committing_one_step_write_it_to_disk_one_after_the_other(config):
    """A held step (cycle 0) and the next cycle's commit of the same step (cycle 1: the group
    evicted again before it trained) both go to disk. They once ran side by side and one failed
    on the manifest; now the second finds the step committed and keeps it as it is."""

    async def scenario():
        memory, keepers = tier(config)
        memory.ensure_keeper("a")
        inside: list[int] = []
        overlapped: list[bool] = []
        persist = keepers["a"].persist

        async def slow_persist(root, step, key):
            overlapped.append(bool(inside))
            inside.append(step)
            await asyncio.sleep(0.05)  # every writer is inside at once, unless they take turns
            try:
                return await persist(root, step, key)
            finally:
                inside.pop()

        keepers["a"].persist = slow_persist
        memory.after_commit(0, held_checkpoint(keepers, 9, {"g/0": "a"}, cycle=0))
        memory.after_commit(1, held_checkpoint(keepers, 9, {"g/0": "a"}, cycle=1))
        return await memory.wait_durable(0, 10), await memory.wait_durable(1, 10), overlapped

    first, second, overlapped = run(scenario())
    assert overlapped == [False, False], "the two durable copies of step 9 overlapped"
    assert "path" in first and second.get("path") == first["path"], (first, second)
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert latest is not None and latest.step == 9 and latest.manifest["cycle"] == 0


def test_the_durable_copy_waits_for_the_warm_restart_to_load_first(config):
    async def scenario():
        members_done = asyncio.Event()

        async def before_persist(cycle: int) -> None:
            assert cycle == 0
            await members_done.wait()

        memory, keepers = tier(config, before_persist=before_persist)
        memory.ensure_keeper("a")
        memory.after_commit(0, held_checkpoint(keepers, 3, {"g/0": "a"}))
        early = await memory.wait_durable(0, 0.3)
        members_done.set()
        return early, await memory.wait_durable(0, 10)

    early, durable = run(scenario())
    assert early is None and durable["path"], "copied only once the members had loaded"


def test_a_leaving_keeper_hands_its_shards_on_before_its_deadline(config):
    config = config.replace(checkpoint_dir=None)  # memory only: the hand-on is all there is

    async def scenario():
        memory, keepers = tier(config)
        for node in ("a", "b"):
            memory.ensure_keeper(node)
        memory.after_commit(0, held_checkpoint(keepers, 4, {"g/0": "a", "g/1": "a"}))
        memory.node_leaving("a", time.time() + 5)
        await asyncio.gather(*memory.tasks)
        where = await memory.checkpoint_for("g/0")
        return memory, keepers, where

    memory, keepers, where = run(scenario())
    record = memory.record(0)
    assert set(map(tuple, record["holders"].values())) <= {("b",), ("head",)}, record
    assert {h["from"] for h in record["handed_on"]} == {"a"} and len(record["handed_on"]) == 2
    assert record["lost"] is None
    for shard, (node,) in record["holders"].items():
        assert keepers[node].held[(4, shard)] == f"{shard}@4", "the same value, on one that stays"
    assert where["step"] == 4 and list(where["holders"]) == record["holders"]["g/0"]
    assert read_record(config, "memory-cycle-0") == record


def test_a_shard_no_keeper_can_take_is_lost_and_never_offered_again(config):
    config = config.replace(checkpoint_dir=None)

    async def scenario():
        memory, keepers = tier(config, home="")
        memory.ensure_keeper("a")
        memory.after_commit(0, held_checkpoint(keepers, 4, {"g/0": "a"}))
        memory.node_leaving("a", time.time() + 1)
        await asyncio.gather(*memory.tasks)
        return memory, await memory.checkpoint_for("g/0")

    memory, where = run(scenario())
    assert where is None, "a restart must not load a checkpoint missing a shard"
    assert "g/0" in memory.record(0)["lost"]


def test_a_dead_holder_found_before_a_restart_ends_the_memory_checkpoint(config):
    config = config.replace(checkpoint_dir=None)

    async def scenario():
        memory, keepers = tier(config, home="")
        for node in ("a", "b"):
            memory.ensure_keeper(node)
        memory.after_commit(0, held_checkpoint(keepers, 2, {"g/0": "a", "g/1": "b"}))
        keepers["b"].dead = True
        return memory, await memory.checkpoint_for("g/0")

    memory, where = run(scenario())
    assert where is None, "g/0 alone is held, but the step is not whole without g/1"
    assert "g/1 had no keeper left" in memory.record(0)["lost"]


def test_a_cycle_that_did_not_commit_releases_what_it_handed_over(config):
    memory, keepers = tier(config)
    memory.ensure_keeper("a")
    memory.after_commit(3, None)
    assert all({"below_step": None, "cycle": 3} in k.released for k in keepers.values())


def test_a_restarted_coordinator_adopts_its_keepers_and_offers_their_checkpoint_again(config):
    """Issue 22: the coordinator dies after a memory commit, before its durable copy landed.
    Its successor takes back the same keepers and reads the checkpoint back from its record:
    a restarted rank is offered step 6 from memory, and the durable copy is done after all."""

    async def scenario():
        never = asyncio.Event()

        async def stuck(cycle: int) -> None:  # the first coordinator dies before its copy
            await never.wait()

        first, keepers = tier(config, before_persist=stuck)
        for node in ("a", "b"):
            first.ensure_keeper(node)
        first.after_commit(0, held_checkpoint(keepers, 6, {"g/0": "a", "g/1": "b"}))
        await asyncio.sleep(0)
        for task in first.tasks:
            task.cancel()
        assert latest_committed(config.checkpoint_dir) is None

        second = MemoryTier(config, "job", "c0ffee", lambda n, node: None, "head")
        second.adopt(dict(keepers), recovery.memory_checkpoints(config.report_dir, "job"))
        assert sorted(second.keepers) == ["a", "b", "head"]
        where = await second.checkpoint_for("g/1")
        second.resume()
        return second, where, await second.wait_durable(0, 10)

    second, where, durable = run(scenario())
    assert where == {"step": 6, "holders": {"b": "ray_graceful_keeper-job-c0ffee-b"}}
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert latest.step == 6 and durable["path"] == latest.path
    assert second.record(0)["durable_path"] == latest.path


def test_a_restart_reads_back_only_checkpoints_still_offered(config):
    """Lost ones are not read back, nor ones older than the newest durable copy (released)."""
    publish = {}
    for cycle, step, durable, lost in (
        (0, 2, True, None),
        (1, 4, True, None),
        (2, 6, False, None),
        (3, 8, False, "gone"),
    ):
        memory = MemoryCheckpoint(
            "job",
            cycle,
            step,
            {
                "g/0": ShardRecord(
                    "g/0", step, shard_file_name("g/0"), 1, 0, tier="memory", holders=("a",)
                )
            },
        )
        memory.durable_path = f"/x/step-{step}" if durable else None
        memory.lost = lost
        publish_record(config.report_dir, "job", f"memory-cycle-{cycle}", memory.to_record())
        publish[cycle] = memory
    with open(os.path.join(config.report_dir, "job", "memory-cycle-9.json"), "w") as f:
        f.write("{not json")
    back = recovery.memory_checkpoints(config.report_dir, "job")
    assert [(m.cycle, m.step) for m in back] == [(1, 4), (2, 6)]
    assert back[1].shards == publish[2].shards and back[0].durable_path == "/x/step-4"


def test_a_durable_copy_under_way_is_never_started_twice(config):
    """``resume`` runs at every wake-up of the shell: it starts only an adopted checkpoint's
    missing copy, once - a second copy of the same step racing the first failed it (the demo:
    "MANIFEST.json.tmp-<pid> -> MANIFEST.json: No such file")."""

    async def scenario():
        go = asyncio.Event()

        async def before_persist(cycle: int) -> None:
            await go.wait()

        memory, keepers = tier(config, before_persist=before_persist)
        memory.ensure_keeper("a")
        memory.after_commit(0, held_checkpoint(keepers, 3, {"g/0": "a"}))
        for _ in range(3):
            memory.resume()
            await asyncio.sleep(0)
        go.set()
        return keepers, await memory.wait_durable(0, 10)

    keepers, durable = run(scenario())
    assert "path" in durable, durable
    assert keepers["a"].persisted == [(3, "g/0")], "one copy of the step, not two"


class FailingKeeper(FakeKeeper):
    """A keeper whose first ``fail`` writes fail, as a full disk or a replaced directory does."""

    def __init__(self, node: str, fail: int) -> None:
        super().__init__(node)
        self.fail = fail

    async def persist(self, root: str, step: int, shard_key: str) -> dict[str, Any]:
        if self.fail > 0:
            self.fail -= 1
            raise OSError(28, "No space left on device")
        return await super().persist(root, step, shard_key)


def _quick_retries(monkeypatch) -> None:
    from ray_graceful.coordinator import memory as memory_module

    monkeypatch.setattr(memory_module, "DURABLE_RETRY_S", (0.05, 0.05))


def test_a_durable_copy_that_fails_every_try_says_so_everywhere_a_user_looks(config, monkeypatch):
    """``checkpoint_dir`` replaced by a file: the copy failed once, ``durability`` said "in the
    keepers" with no reason for ever after, and nothing tried again. Now: three tries, then the
    record, the summary (status, outcome) and the metric's hook say no step is durable since."""
    from ray_graceful.coordinator.held import memory_durability

    _quick_retries(monkeypatch)
    os.makedirs(os.path.dirname(config.checkpoint_dir), exist_ok=True)
    with open(config.checkpoint_dir, "w") as f:
        f.write("not a directory")
    told: list[tuple[dict, bool]] = []

    async def scenario():
        memory, keepers = tier(config)
        memory.durable_changed = lambda summary, failed: told.append((summary, failed))
        memory.ensure_keeper("a")
        memory.after_commit(0, held_checkpoint(keepers, 9, {"g/0": "a"}))
        return memory, await memory.wait_durable(0, 10)

    memory, durable = run(scenario())
    assert durable["tries"] == 3 and "NotADirectoryError" in durable["error"], durable
    assert read_record(config, "durable-cycle-0")["tries"] == 3
    where = memory_durability(memory.record(0))
    assert where["stage"] == "durable-failed" and "NotADirectoryError" in where["reason"]
    summary = memory.durable_summary()
    assert summary["step"] is None and summary["failing"]["step"] == 9
    assert summary["says"].startswith("no durable step since the start: the copy of step 9")
    assert told == [(summary, True)]


def test_a_durable_copy_that_fails_once_is_tried_again_and_lands(config, monkeypatch):
    _quick_retries(monkeypatch)

    async def scenario():
        memory, keepers = tier(config)
        keepers["a"] = FailingKeeper("a", fail=1)
        memory.keepers["a"] = keepers["a"]
        memory.after_commit(0, held_checkpoint(keepers, 9, {"g/0": "a"}))
        return memory, await memory.wait_durable(0, 10)

    memory, durable = run(scenario())
    assert "path" in durable and latest_committed(config.checkpoint_dir).step == 9
    assert memory.record(0)["durable_error"] is None
    assert memory.durable_summary() == {"step": 9, "path": durable["path"], "failing": None}


def test_a_failed_step_is_no_longer_failing_once_a_newer_one_is_durable(config, monkeypatch):
    _quick_retries(monkeypatch)

    async def scenario():
        memory, keepers = tier(config)
        keepers["a"] = FailingKeeper("a", fail=3)
        memory.keepers["a"] = keepers["a"]
        memory.after_commit(0, held_checkpoint(keepers, 9, {"g/0": "a"}, cycle=0))
        failed = await memory.wait_durable(0, 10)
        says = memory.durable_summary()["says"]
        memory.after_commit(1, held_checkpoint(keepers, 12, {"g/0": "a"}, cycle=1))
        return failed, says, await memory.wait_durable(1, 10), memory.durable_summary()

    failed, says, landed, summary = run(scenario())
    assert "error" in failed and "step 9 failed 3 time(s)" in says
    assert "path" in landed and summary["step"] == 12 and summary["failing"] is None


def test_an_outcome_published_while_no_step_is_durable_says_so_in_its_summary():
    from ray_graceful.outcome import TerminationOutcome
    from ray_graceful.protocol import Result

    says = "no durable step since step 4: the copy of step 9 failed 3 time(s) (OSError: full)"
    outcome = TerminationOutcome(1, "job", Result.COMMITTED, durable={"step": 4, "says": says})
    assert outcome.summary().endswith(f"; {says}")
    assert TerminationOutcome.from_dict(outcome.to_dict()).durable == outcome.durable


def test_a_checkpoint_whose_keepers_are_all_leaving_is_written_through_to_disk(config):
    """Every Ray Train worker SIGTERMed in turn: the step is whole in the keepers, but every
    keeper's node has a notice. It is written to disk by those keepers while their nodes drain,
    and never offered from memory; a keeper that died first leaves it not durable, saying why."""

    async def scenario(dies: bool):
        memory, keepers = tier(config, home="")
        for node in ("a", "b"):
            memory.ensure_keeper(node)
            memory.leaving[node] = time.time() + 5
        checkpoint = held_checkpoint(keepers, 7, {"g/0": "a", "g/1": "b"}, cycle=2)
        keepers["b"].dead = dies
        durable = await memory.write_through(checkpoint)
        return memory, durable, await memory.wait_durable(2, 1), await memory.checkpoint_for("g/0")

    memory, durable, waited, offered = run(scenario(dies=False))
    latest = latest_committed(config.checkpoint_dir, verify_checksums=True)
    assert latest is not None and latest.step == 7 and durable["path"] == latest.path
    assert sorted(latest.shards) == ["g/0", "g/1"]
    assert waited == durable and read_record(config, "durable-cycle-2")["path"] == latest.path
    assert memory.durable_summary()["step"] == 7
    assert offered is None and memory.record(2) is None, "never a memory checkpoint"

    config = config.replace(checkpoint_dir=config.checkpoint_dir + "-second")
    memory, durable, waited, offered = run(scenario(dies=True))
    assert "keeper on b" in durable["error"] and waited == durable
    assert latest_committed(config.checkpoint_dir) is None, "no manifest without every shard"
    assert memory.durable_summary()["failing"]["step"] == 7
