"""The memory tier: shards held by keepers on surviving nodes, made durable, loaded back.

Unit tests for the pure parts (the tensor tree, placement, the commit rule); the rest on a real
cluster: extra raylets as nodes, gloo ranks, a real drain.
"""

from __future__ import annotations

import pickle

import pytest
import ray
import torch

from ray_graceful import GracefulConfig, latest_committed
from ray_graceful.checkpoint import CheckpointError, ShardRecord, shard_file_name
from ray_graceful.coordinator import Coordinator
from ray_graceful.memory.commit import LeavingHolders, commit_in_memory
from ray_graceful.memory.placement import choose_holders
from ray_graceful.memory.tree import from_tree, to_tree, tree_bytes
from tests.helpers import kill_actors
from tests.memory_groups import drain_b_and_conclude, start_group, train_then_block

# --- pure parts ------------------------------------------------------------------------------


def test_state_that_is_not_a_tensor_counts_its_bytes_against_the_budget():
    """A replay buffer as a numpy array, raw bytes, an RNG state object: each counted (a keeper
    with a 1 MiB budget once took a 64 MiB numpy shard and booked 0 bytes)."""
    import random

    import numpy as np

    buffer = np.zeros((1024, 1024), dtype=np.float32)
    rng = random.Random(0)
    tree = to_tree({"replay": buffer, "raw": b"x" * 1000, "rng": rng, "ids": [1, 2, 3]})
    counted = tree_bytes(tree)
    assert counted >= buffer.nbytes + 1000 + 3 * 8 + 2000  # an RNG state pickles to ~2.5 kB
    assert tree_bytes({"rng": rng}) == len(pickle.dumps(rng, protocol=pickle.HIGHEST_PROTOCOL))


def test_a_state_dict_survives_the_tree_bit_for_bit():
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optim": [torch.arange(6).reshape(2, 3), {"lr": 0.1, "step": 7}],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 5),
        "note": "text",
    }
    tree = to_tree(state)
    # tensors' bytes, then "lr" and "step" (8 each) and "text" (4)
    assert tree_bytes(tree) == 4 * 3 * 4 + 3 * 2 + 6 * 8 + 4 + 8 + 8 + 4
    back = from_tree(tree)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert back["model"]["b"].dtype == torch.bfloat16 and back["model"]["b"].shape == (3,)
    assert torch.equal(back["optim"][0], state["optim"][0]) and back["optim"][1] == {
        "lr": 0.1,
        "step": 7,
    }
    assert back["scalar"].item() == 2.5 and back["empty"].shape == (0, 5)
    assert back["note"] == "text"


def test_holders_are_surviving_nodes_own_node_first_and_spread():
    assert choose_holders("g/0", "a", ["a", "b", "c"], 1) == ("a",)
    assert choose_holders("g/0", "x", ["a", "b", "c"], 2)[0] in "abc"
    assert len(set(choose_holders("g/0", "a", ["a", "b", "c"], 3))) == 3
    assert choose_holders("g/0", "a", ["b"], 2) == ()  # too few survivors: no memory tier
    assert choose_holders("g/0", "a", ["a", "b"], 0) == ()
    firsts = {choose_holders(f"g/{i}", "x", ["a", "b", "c", "d"], 1)[0] for i in range(40)}
    assert len(firsts) > 1, "shards of evicted savers spread over the survivors"


def record(shard, step=3, tier="memory", holders=("a",)):
    return ShardRecord(shard, step, shard_file_name(shard), 10, 0, tier=tier, holders=holders)


def test_a_memory_checkpoint_is_committed_only_when_whole():
    ok = commit_in_memory("j", 0, ["g/0", "g/1"], [record("g/0"), record("g/1", tier="disk")], 1)
    assert ok.step == 3 and ok.in_memory() == {"g/0": ("a",)}
    for records, replicas, message in [
        ([record("g/0")], 1, "were not saved"),
        ([record("g/0"), record("g/1", step=4)], 1, "steps [3, 4]"),
        ([record("g/0"), record("g/1")], 2, "held by 1 node(s) not being evicted, memory_"),
        ([record("g/0"), record("g/0"), record("g/1")], 1, "saved twice"),
        ([record("g/0"), record("g/1"), record("g/2")], 1, "not in the topology"),
    ]:
        with pytest.raises(CheckpointError) as info:
            commit_in_memory("j", 0, ["g/0", "g/1"], records, replicas)
        assert message in str(info.value)
    # A holder whose node got a notice after the plan (a late one) does not count; the step
    # is whole in the keepers all the same, which may write it through to disk.
    with pytest.raises(LeavingHolders) as leaving:
        commit_in_memory("j", 0, ["g/0"], [record("g/0")], 1, frozenset({"a"}))
    assert "held by 0 node(s) not being evicted" in str(leaving.value)
    assert leaving.value.checkpoint.in_memory() == {"g/0": ("a",)}
    with pytest.raises(CheckpointError) as info:  # too few holders at all: nothing to write
        commit_in_memory("j", 0, ["g/0", "g/1"], [record("g/0"), record("g/1")], 2)
    assert not isinstance(info.value, LeavingHolders)


def test_memory_settings_are_bounded():
    from ray_graceful import ConfigError

    with pytest.raises(ConfigError) as info:
        GracefulConfig(memory_replicas=9)
    assert "memory_replicas = 9" in str(info.value) and "from 0 to 8" in str(info.value)
    with pytest.raises(ConfigError):
        GracefulConfig(memory_budget_mb=0)


# --- on a cluster ----------------------------------------------------------------------------


def test_a_drain_commits_in_survivors_memory_persists_and_restarts_from_memory(
    nodes, memory_config, exit_recorder
):
    """Node b is drained: the survivors on a hand their shards to a's keeper (no disk on the
    critical path); the cycle commits in memory, the keepers write the durable copy in the
    background, and a restarted group loads from memory - the same weights, no step lost."""
    config = memory_config
    coordinator = Coordinator.start(config)
    try:
        ranks, pids = start_group(config, exit_recorder, ["a", "a", "b", "b"], ["0", "1"] * 2)
        weights = train_then_block(ranks)
        outcome = drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        assert outcome.committed["tier"] == "memory" and outcome.committed["step"] == 3
        assert outcome.committed["holders"] == {
            "trainer/0": [nodes["a"]],
            "trainer/1": [nodes["a"]],
        }
        assert outcome.resume_from == {"step": 3, "tier": "memory"}
        durable = coordinator.wait_durable(0, timeout=30)
        assert durable is not None and "path" in durable, durable
        ckpt = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert ckpt.step == 3 and sorted(ckpt.shards) == ["trainer/0", "trainer/1"]

        restarted, _ = start_group(config, exit_recorder, ["a"] * 4, ["0", "1"] * 2)
        loaded = ray.get(
            [r.restore.remote(s, config) for r, s in zip(restarted, "0101", strict=True)],
            timeout=60,
        )
        assert {x["tier"] for x in loaded} == {"memory-local"}, loaded
        assert {x["step"] for x in loaded} == {3}
        assert ray.get(restarted[0].weights_sum.remote(), timeout=30) == pytest.approx(weights)
        assert ray.get([r.train.remote(2) for r in restarted], timeout=60) == [5] * 4
        kill_actors(*restarted)
    finally:
        coordinator.shutdown()


def test_an_evicted_saver_hands_its_shard_to_another_node_and_a_peer_loads_it(
    nodes, memory_config, exit_recorder
):
    """Every rank runs on node b, which is drained: the shard goes to the keeper on the
    coordinator's node (a transfer), and a group restarted elsewhere loads it from that peer."""
    config = memory_config
    coordinator = Coordinator.start(config)
    try:
        ranks, pids = start_group(
            config.replace(checkpoint_dir=None), exit_recorder, ["b", "b"], ["m", "m"]
        )
        train_then_block(ranks)
        outcome = drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        own_node = coordinator.stats()["node_id"]  # the coordinator's node has a keeper too
        assert outcome.committed["holders"] == {"trainer/m": [own_node]}, (nodes, own_node)
        elsewhere = "head" if own_node == nodes["a"] else "a"
        restarted, _ = start_group(config, exit_recorder, [elsewhere] * 2, ["m", "m"])
        loaded = ray.get([r.restore.remote("m", config) for r in restarted], timeout=60)
        assert {x["tier"] for x in loaded} == {"memory-peer"} and {x["step"] for x in loaded} == {3}
        kill_actors(*restarted)
    finally:
        coordinator.shutdown()


def test_holders_are_the_spares_nodes_first_where_a_warm_restart_will_load_there():
    assert choose_holders("g/0", "evicted", ["a", "b", "c"], 1, preferred=["c"]) == ("c",)
    # An evicted saver's node is not a survivor; a preferred node that is not either is skipped.
    assert choose_holders("g/0", "a", ["a", "b"], 1, preferred=["gone", "b"]) == ("b",)
    assert choose_holders("g/0", "a", ["a", "b", "c"], 2, preferred=["c"]) == ("c", "a")


def test_a_keeper_measures_what_it_holds_not_what_it_is_told(ray_cluster):
    """A 4 MiB numpy shard announced as 0 bytes (what a state_dict without tensors used to
    count) is refused by a 1 MiB keeper, saying both sizes; one that fits is booked at its
    measured size."""
    import numpy as np

    from ray_graceful.memory.keeper import Keeper

    keeper = ray.remote(Keeper).options(num_cpus=0).remote("j", "n", 1 << 20)
    try:
        big = ray.put(to_tree({"step": 3, "state": {"replay": np.zeros(1 << 20, np.float32)}}))
        refused = ray.get(keeper.hold.remote(0, 3, "trainer/0", [big], 0), timeout=60)
        assert not refused.accepted
        assert "holds 4 MiB (announced as 0 MiB)" in refused.reason, refused.reason
        small = {"step": 3, "state": {"replay": np.zeros(1000, np.float32), "raw": b"x" * 100}}
        kept = ray.get(keeper.hold.remote(0, 3, "trainer/1", [ray.put(small)], 0), timeout=60)
        assert kept.accepted and kept.nbytes == 8 + 4000 + 100
        stats = ray.get(keeper.stats.remote(), timeout=10)
        assert (stats["used_bytes"], stats["reserved_bytes"]) == (4108, 0), stats
    finally:
        ray.kill(keeper)


# --- what a keeper holds stays the step it was handed ------------------------------------------


@ray.remote(num_cpus=0)
class HoldersOf:
    """The coordinator's one answer a load needs (``memory_checkpoint``): this step, held by
    these keepers - the seam ``load_shard`` is written against, with nothing else around it."""

    def __init__(self, step: int, holders: dict[str, str]) -> None:
        self.answer = {"step": step, "holders": holders}

    def memory_checkpoint(self, shard_key: str, step: int | None = None) -> dict:
        return self.answer


def _model_and_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):  # Adam's state exists only after a step
        model(torch.randn(2, 8)).sum().backward()
        adam.step()
        adam.zero_grad()
    return model, adam


def test_a_rank_that_loads_from_a_keeper_and_trains_on_leaves_the_held_step_as_it_was(
    ray_cluster, tmp_path
):
    """A spare loads step 5 from the keeper on its node into a model and an Adam optimizer,
    then trains 3 steps. ``Optimizer.load_state_dict`` keeps the tensors it is given: they used
    to be views of the keeper's object (mapped writable on its node), so Adam's steps landed in
    the held step - and the keeper wrote that to disk as step 5, its checksum fine."""
    from ray_graceful.memory.handoff import load_shard
    from ray_graceful.memory.keeper import start_keeper

    model, adam = _model_and_adam(seed=0)
    state = {"model": model.state_dict(), "optim": adam.state_dict()}
    held_state = pickle.loads(pickle.dumps(state))  # what step 5 is, apart from any memory
    node = ray.get_runtime_context().get_node_id()
    name = "rg-test-keeper-alias"
    keeper = start_keeper(name, "rg-test", "j", node, 1 << 30, "").handle
    holders = HoldersOf.remote(5, {node: name})
    try:
        tree = to_tree({"step": 5, "state": state})
        kept = ray.get(keeper.hold.remote(0, 5, "trainer/0", [ray.put(tree)], 0), timeout=60)
        assert kept.accepted, kept.reason

        loaded = load_shard("trainer/0", holders, None, "rg-test", step=5)
        assert loaded is not None and loaded.tier.value == "memory-local", loaded
        spare_model, spare_adam = _model_and_adam(seed=1)
        spare_model.load_state_dict(loaded.state["model"])
        spare_adam.load_state_dict(loaded.state["optim"])
        for _ in range(3):
            spare_model(torch.randn(2, 8)).sum().backward()
            spare_adam.step()
            spare_adam.zero_grad()

        ray.get(keeper.persist.remote(str(tmp_path), 5, "trainer/0"), timeout=60)
        on_disk = torch.load(tmp_path / "step-00000005" / shard_file_name("trainer/0"))
        written = on_disk["state"]["optim"]["state"]
        for index, expected in held_state["optim"]["state"].items():
            assert int(written[index]["step"]) == int(expected["step"]) == 3, written[index]
            assert torch.equal(written[index]["exp_avg"], expected["exp_avg"])
            assert torch.equal(written[index]["exp_avg_sq"], expected["exp_avg_sq"])
        assert torch.equal(on_disk["state"]["model"]["weight"], held_state["model"]["weight"])
    finally:
        ray.kill(keeper)
        ray.kill(holders)


def test_a_held_shard_whose_bytes_changed_is_never_written_as_its_step(ray_cluster, tmp_path):
    """Whatever changes a held copy's bytes in place (here: a view written to, as the old
    loader handed out), the keeper's write checks them against the CRC taken when it was held
    and refuses: no file at the shard's name, the reason says which step and why."""
    from ray_graceful.memory.keeper import Keeper

    keeper = ray.remote(Keeper).options(num_cpus=0).remote("j", "n", 1 << 30)
    try:
        tree = to_tree({"step": 5, "state": {"w": torch.ones(1000)}})
        kept = ray.get(keeper.hold.remote(0, 5, "trainer/0", [ray.put(tree)], 0), timeout=60)
        assert kept.accepted
        first = ray.get(keeper.persist.remote(str(tmp_path / "a"), 5, "trainer/0"), timeout=60)
        assert first["step"] == 5  # unchanged: written

        held_ref = ray.get(keeper.fetch.remote(5, "trainer/0"), timeout=60)[0]
        from_tree(ray.get(held_ref), copy=False)["state"]["w"].add_(1.0)  # in place, on its node
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(keeper.persist.remote(str(tmp_path / "b"), 5, "trainer/0"), timeout=60)
        assert "HeldCopyChanged" in str(info.value) and "changed since it was held" in str(
            info.value
        ), info.value
        assert not (tmp_path / "b" / "step-00000005" / shard_file_name("trainer/0")).exists()
    finally:
        ray.kill(keeper)


def test_a_shard_a_later_cycle_handed_over_again_outlives_the_release_of_a_lost_cycle(
    ray_cluster,
):
    """Cycle 5 handed shard g/0 of step 100 over; the group was evicted again before it
    trained, and cycle 6 handed the same step over again (the keeper answered "held again").
    Cycle 5's held step is then lost, and its release used to drop the shard cycle 6's commit
    relies on: an entry was tagged with the first cycle that stored it, only."""
    from ray_graceful.memory.keeper import Keeper

    keeper = ray.remote(Keeper).options(num_cpus=0).remote("j", "n", 1 << 30)
    try:
        tree = ray.put(to_tree({"step": 100, "state": {"w": torch.ones(10)}}))
        first = ray.get(keeper.hold.remote(5, 100, "g/0", [tree], 40), timeout=60)
        again = ray.get(keeper.hold.remote(6, 100, "g/0", [tree], 40), timeout=60)
        assert first.accepted and again.accepted and again.again
        ray.get(keeper.release.remote(cycle=5), timeout=60)
        assert ray.get(keeper.fetch.remote(100, "g/0"), timeout=60) is not None, "cycle 6's"
        stats = ray.get(keeper.stats.remote(), timeout=60)
        assert [s["cycles"] for s in stats["shards"]] == [[6]]
        ray.get(keeper.release.remote(cycle=6), timeout=60)  # no cycle relies on it now
        assert ray.get(keeper.fetch.remote(100, "g/0"), timeout=60) is None
    finally:
        ray.kill(keeper)
