"""Emergency checkpoints in DCP's format: saved with no collective, loaded by ``dcp.load``.

Real gloo process groups and FSDP2 (``fully_shard`` on a CPU mesh), in plain processes. Each
saver goes through ``write_shard`` (what a rank's teardown calls) and the checkpoint through
``commit`` (what the coordinator calls); the restart loads with PyTorch's own loader, at the
same world size and at another. On a cluster: mixin actors drained on a real node, the memory
tier holding their DCP files, its durable copy loaded by ``dcp.load``.
"""

from __future__ import annotations

import os

import pytest
import ray
import torch
import torch.multiprocessing as mp

from ray_graceful import dcp_saver, latest_committed
from ray_graceful.checkpoint import (
    CheckpointError,
    ShardRecord,
    commit,
    shard_file_name,
    write_shard,
)
from ray_graceful.coordinator import Coordinator
from ray_graceful.memory.commit import commit_in_memory
from tests import actors
from tests.helpers import free_port, kill_actors
from tests.memory_groups import drain_b_and_conclude, place

STEP = 7


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 5))


def _as_arrays(model: torch.nn.Module) -> dict:
    """Every parameter whole, as numpy copies: they cross the process boundary by value
    (a tensor would travel as a shared-memory handle that dies with its process)."""
    return {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def _save(rank, world, port, root, mesh_shape, savers, label, queue):
    """Train-shaped: an FSDP2 (or HSDP) model; the ranks in ``savers`` save their shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, port)
    model = _model(seed=0)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None  # 2-D: HSDP
    fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    full = _as_arrays(model)  # (a collective)
    record = None
    if rank in savers:
        saver = dcp_saver(lambda: {"model": model.state_dict(), "step": STEP})
        shard = f"policy/{label(rank)}"
        record = write_shard(root, STEP, shard, saver, group="policy", rank=rank).to_dict()
    queue.put((rank, record, full if rank == 0 else None))
    dist.destroy_process_group()


def _load(rank, world, port, path, queue):
    """A fresh model, sharded over another world size, loaded with PyTorch's loader."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, port)
    model = _model(seed=123)  # other weights: the load must replace every element
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    state = {"model": model.state_dict(), "step": 0}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    full = _as_arrays(model)
    queue.put((rank, state["step"], full if rank == 0 else None))
    dist.destroy_process_group()


def _spawn(fn, world, *args):
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(fn, args=(world, free_port(), *args, queue), nprocs=world)
    return sorted((queue.get() for _ in range(world)), key=lambda item: item[0])


def _save_group(root, world, mesh_shape, savers, label):
    results = _spawn(_save, world, root, mesh_shape, savers, label)
    records = [ShardRecord.from_dict(r) for _rank, r, _f in results if r is not None]
    return records, results[0][2]


def _shard_label_fsdp(rank: int) -> int:
    return rank


def _shard_label_mislabelled(rank: int) -> int:
    return 0  # both ranks claim to be replicas of shard 0: they hold different halves


def _shard_label_hsdp(rank: int) -> int:
    return rank % 2  # mesh (replicate=2, shard=2): ranks 0 and 2 hold shard 0


@pytest.mark.timeout(240)
def test_an_fsdp2_emergency_save_loads_with_dcp_at_the_same_and_another_world_size(tmp_path):
    root = str(tmp_path / "ckpt")
    records, saved = _save_group(root, 2, (2,), {0, 1}, _shard_label_fsdp)
    commit(root, STEP, ["policy/0", "policy/1"], records, cycle=0)
    ckpt = latest_committed(root)
    assert ckpt.step == STEP and ckpt.manifest["dcp"] == {"policy": "dcp-policy"}
    for world in (2, 3):  # 3: uneven shards of 6 and 5 rows - DCP reshards
        loaded = _spawn(_load, world, ckpt.dcp_path("policy"))
        assert [step for _r, step, _f in loaded] == [STEP] * world
        full = loaded[0][2]
        assert full.keys() == saved.keys()
        for name, array in saved.items():
            assert (full[name] == array).all(), f"{name} at world size {world}"


def test_groups_whose_names_differ_only_in_an_unsafe_character_load_their_own_tensors(tmp_path):
    """ "actor ref" and "actor_ref" once shared ``dcp-actor_ref``: the second group's metadata
    overwrote the first's, and ``dcp_path("actor ref")`` loaded the other group's tensors."""
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path / "ckpt")
    groups = {"actor ref": 1.0, "actor_ref": 2.0}
    records = [
        write_shard(
            root,
            STEP,
            f"{group}/0",
            dcp_saver(lambda value=value: {"w": torch.full((3,), value)}),
            group=group,
            rank=0,
        )
        for group, value in groups.items()
    ]
    commit(root, STEP, [f"{group}/0" for group in groups], records, cycle=0)
    ckpt = latest_committed(root)
    assert len(set(ckpt.manifest["dcp"].values())) == 2, ckpt.manifest["dcp"]
    for group, value in groups.items():
        state = {"w": torch.zeros(3)}
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(state, checkpoint_id=ckpt.dcp_path(group))
        assert torch.equal(state["w"], torch.full((3,), value)), group


@pytest.mark.timeout(240)
def test_hsdp_one_saver_per_shard_is_enough(tmp_path):
    """Mesh (2 replicas x 2 shards): ranks 0 and 1 save shards 0 and 1, their replicas 2 and 3
    do not; the checkpoint is whole, and loads into plain FSDP2 at world size 2."""
    root = str(tmp_path / "ckpt")
    records, saved = _save_group(root, 4, (2, 2), {0, 1}, _shard_label_hsdp)
    commit(root, STEP, ["policy/0", "policy/1"], records, cycle=0)
    loaded = _spawn(_load, 2, latest_committed(root).dcp_path("policy"))
    for name, array in saved.items():
        assert (loaded[0][2][name] == array).all(), name


@pytest.mark.timeout(240)
def test_a_tensor_the_chunks_do_not_cover_is_never_committed(tmp_path):
    """Ranks labelled as replicas of one shard that hold different halves: one saves, half of
    each tensor is missing - the commit refuses, naming the tensor, and writes no manifest."""
    root = str(tmp_path / "ckpt")
    records, _saved = _save_group(root, 2, (2,), {0}, _shard_label_mislabelled)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.0\.weight': the saved chunks "):
        commit(root, STEP, ["policy/0"], records, cycle=0)
    assert latest_committed(root) is None
    assert not os.path.exists(os.path.join(root, f"step-{STEP:08d}", "manifest.json"))


def test_a_memory_commit_checks_dcp_coverage_before_any_file_exists():
    """The memory tier commits before the durable copy is written: the chunks the savers
    reported are checked then, as ``assemble`` checks them on disk. Replicas' identical
    chunks count once; a missing half refuses the commit, naming the tensor."""

    def record(shard, chunks):
        return ShardRecord(
            shard, STEP, shard_file_name(shard), 10, 0, tier="memory", holders=("a",),
            dcp_chunks={"w": [[4, 2], "torch.float32", chunks]},
        )  # fmt: skip

    top, bottom = [[[0, 0], [2, 2]]], [[[2, 0], [2, 2]]]
    whole = [record("policy/0", top), record("policy/1", bottom)]
    assert commit_in_memory("job", 0, ["policy/0", "policy/1"], whole, 1).step == STEP
    half = [record("policy/0", top)]
    with pytest.raises(CheckpointError, match=r"group 'policy': tensor 'w': the saved chunks "):
        commit_in_memory("job", 0, ["policy/0"], half, 1)
    overlapping = [record("policy/0", top), record("policy/1", [[[1, 0], [3, 2]]])]
    with pytest.raises(CheckpointError, match="overlap"):
        commit_in_memory("job", 0, ["policy/0", "policy/1"], overlapping, 1)
    bad = ShardRecord.from_dict({**whole[0].to_dict(), "dcp_chunks": {"w": "not chunks"}})
    with pytest.raises(CheckpointError, match="group 'policy'"):
        commit_in_memory("job", 0, ["policy/0"], [bad], 1)


# --- on a cluster ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_drained_fsdp2_group_commits_dcp_in_memory_and_dcp_load_reads_its_durable_copy(
    nodes, memory_config, exit_recorder
):
    """FSDP2 ranks on nodes a and b save with ``dcp_saver`` and the memory tier on; b is
    drained. Both ranks hand their DCP files to a surviving keeper, the cycle commits in
    memory, and the keepers' durable copy is a DCP directory with the global metadata:
    ``dcp.load`` reads it at world size 3, bitwise. A group restarted at the same world size
    restores its own chunks from memory with the saver's ``restore``."""
    config = memory_config
    coordinator = Coordinator.start(config)
    try:
        ranks, pids = _start_dcp_group(config, exit_recorder, ["a", "b"])
        assert ray.get([r.train.remote(3) for r in ranks], timeout=60) == [3, 3]
        saved = ray.get([r.full_weights.remote() for r in ranks], timeout=60)[0]
        ranks[0].train.remote(1000)  # blocked on rank 1, which idles: a real collective
        outcome = drain_b_and_conclude(nodes, coordinator, exit_recorder, pids)
        assert outcome.committed["tier"] == "memory" and outcome.committed["step"] == 3
        durable = coordinator.wait_durable(0, timeout=60)
        assert durable is not None and "path" in durable, durable
        ckpt = latest_committed(config.checkpoint_dir, verify_checksums=True)
        assert ckpt.step == 3 and ckpt.manifest["dcp"] == {"policy": "dcp-policy"}

        loaded = _spawn(_load, 3, ckpt.dcp_path("policy"))
        assert [step for _r, step, _f in loaded] == [3] * 3
        for name, array in saved.items():
            assert (loaded[0][2][name] == array).all(), name

        restarted, _ = _start_dcp_group(config, exit_recorder, ["a", "a"])
        restored = ray.get([r.restore_own.remote(i, config) for i, r in enumerate(restarted)])
        assert {r["tier"] for r in restored} <= {"memory-local", "memory-peer"}, restored
        assert [r["saved_step"] for r in restored] == [3, 3]
        again = ray.get([r.full_weights.remote() for r in restarted], timeout=60)[0]
        for name, array in saved.items():
            assert (again[name] == array).all(), name
        kill_actors(*restarted)
    finally:
        coordinator.shutdown()


def _start_dcp_group(config, exit_recorder, placement):
    port = free_port()
    ranks = place(actors.DcpTrainer, placement, exit_recorder)
    world = len(ranks)
    ray.get(
        [r.setup_fsdp.remote(i, world, "127.0.0.1", port, config) for i, r in enumerate(ranks)],
        timeout=120,
    )
    return ranks, ray.get([r.pid.remote() for r in ranks], timeout=30)
