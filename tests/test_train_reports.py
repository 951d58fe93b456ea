"""Ray Train's warm path: a held step reported to Train once it is on disk (``reports.py``).

Pure logic: which step rank 0 puts into the boundary's all-reduce, and when. The report itself
goes through ``ray.train.report`` in a real run (``tests/test_train_warm.py``, the held row).
"""

from __future__ import annotations

import os

import torch

from ray_graceful.checkpoint import commit, save_state_dict, step_dir, write_shard
from ray_graceful.train import reports as module
from ray_graceful.train.reports import NOT_YET, HeldReport


def _commit(root: str, step: int) -> None:
    def save(path, step_):
        return save_state_dict({"w": torch.zeros(4)}, path)

    commit(root, step, ["model"], [write_shard(root, step, "model", save)], cycle=1)


def test_rank_0_names_the_held_step_only_once_its_manifest_is_on_disk(tmp_path, monkeypatch):
    root = str(tmp_path)
    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    held = HeldReport()
    held.expect(7, cycle=1, checkpoint_dir=root)
    assert held.on_disk(rank=0) == NOT_YET, "nothing on disk yet"
    _commit(root, 7)
    assert held.on_disk(rank=0) == NOT_YET, "rank 0 looks at most once a second"
    clock[0] += module.LOOK_EVERY_S
    assert held.on_disk(rank=1) == NOT_YET, "only rank 0 looks: it attaches the directory"
    assert held.on_disk(rank=0) == 7


def test_a_step_directory_without_its_manifest_is_not_on_disk(tmp_path):
    """A shard written but not committed (the coordinator writes the manifest last)."""
    root = str(tmp_path)
    write_shard(root, 3, "model", lambda path, step: save_state_dict({"w": torch.zeros(1)}, path))
    held = HeldReport()
    held.expect(3, cycle=1, checkpoint_dir=root)
    assert os.path.isdir(step_dir(root, 3))
    assert held.on_disk(rank=0) == NOT_YET


def test_nothing_is_looked_for_without_a_held_step_or_a_directory(tmp_path):
    _commit(str(tmp_path), 5)
    held = HeldReport()
    assert held.on_disk(rank=0) == NOT_YET, "no step expected"
    held.expect(5, cycle=1, checkpoint_dir=None)
    assert held.on_disk(rank=0) == NOT_YET, "no checkpoint_dir: nothing ever reaches disk"
    held.expect(5, cycle=1, checkpoint_dir=str(tmp_path))
    held.forget()  # rank 0 attached it in the join's own report
    assert held.on_disk(rank=0) == NOT_YET
