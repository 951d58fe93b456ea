"""The README's and the docs' adoption snippets, run as written.

Each snippet is read from its Markdown file at test time; only its placeholders (``...``, the
``/shared/ckpt`` path) are filled in, each by an exact replacement that must still match - so a
snippet that changes is run as changed, and one that no longer fits the others fails here. The
review that asked for this found that docs/memory-tier.md restored ``loaded.state["model"]``
while the README registered ``state_dict=self.model.state_dict``: a KeyError on the first
restart of anyone who copied both.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import ray
import torch

import ray_graceful
from tests.helpers import free_port, kill_actors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(relative: str) -> list[str]:
    with open(os.path.join(REPO, relative)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def snippet(relative: str, marker: str) -> str:
    """The one ```python block of ``relative`` that contains ``marker``."""
    found = [b for b in python_blocks(relative) if marker in b]
    assert len(found) == 1, f"{relative}: {len(found)} python blocks contain {marker!r}"
    return found[0]


def fill(text: str, *replacements: tuple[str, str]) -> str:
    for old, new in replacements:
        assert old in text, f"the snippet no longer holds {old!r}: update this test with it"
        text = text.replace(old, new)
    return text


ADOPTION = [  # (file, a line of the snippet that names it)
    ("README.md", "class DistributedTorchRayActor(GracefulWorkerMixin)"),
    ("docs/worker.md", "class MyBaseWorker(GracefulWorkerMixin)"),
    ("docs/memory-tier.md", "loaded = ray_graceful.load_latest("),
    ("docs/checkpoints.md", "ray_graceful.load_state_dict(ckpt.shard_path("),
    ("docs/checkpoints.md", "saver=ray_graceful.dcp_saver("),
]


@pytest.mark.parametrize("relative,marker", ADOPTION)
def test_every_adoption_snippet_is_python(relative, marker):
    compile(snippet(relative, marker), relative, "exec")


def readme_worker_class(checkpoint_dir: str) -> tuple[type, str]:
    """The README's worker and driver line, placeholders filled; the class and the driver."""
    text = snippet("README.md", "class DistributedTorchRayActor(GracefulWorkerMixin)")
    worker, _, driver = text.partition("coordinator = ")
    worker = fill(
        worker,
        (
            "torch.distributed.init_process_group(...)",
            'torch.distributed.init_process_group("gloo", init_method=self.init_method, '
            "rank=self.rank, world_size=self.world)",
        ),
        ("for step in ...:", "for step in range(self.step + 1, self.step + 1 + self.steps):"),
        ("            ...\n", "            self.one_step(step)\n"),
    )
    namespace: dict = {"torch": torch}
    exec(compile(worker, "README.md", "exec"), namespace)
    base = namespace["DistributedTorchRayActor"]

    class Worker(base):  # what the README leaves to the user: the model and one step
        def __init__(self, rank: int, world: int, init_method: str) -> None:
            torch.manual_seed(0)
            self.rank, self.world, self.steps, self.step = rank, world, 0, 0
            self.init_method = init_method
            self.dp_shard = 0  # pure data parallel: every rank a replica of shard 0
            self.model = torch.nn.Linear(8, 8)

        def one_step(self, step: int) -> None:
            for p in self.model.parameters():
                grad = torch.ones_like(p)
                torch.distributed.all_reduce(grad)
                p.data.sub_(1e-3 * grad)
            self.step = step

        def run(self, steps: int) -> int:
            self.steps = steps
            self.train()
            return self.step

        def pid(self) -> int:
            return os.getpid()

        def weights(self) -> list:
            return [p.detach().clone() for p in self.model.parameters()]

        def restore(self, relative: str, marker: str, checkpoint_dir: str) -> dict:
            """Run a docs restore snippet inside this rank, as a user pastes it."""
            code = snippet(relative, marker)
            if '"/shared/ckpt"' in code:
                code = fill(code, ('"/shared/ckpt"', repr(checkpoint_dir)))
            scope = {"ray_graceful": ray_graceful, "model": self.model, "my_shard": self.dp_shard}
            exec(compile(code, relative, "exec"), scope)
            self.step = scope["step"]
            return {"step": scope["step"], "tier": getattr(scope.get("loaded"), "tier", None)}

    driver = "coordinator = " + fill(driver, ('"/shared/ckpt"', repr(checkpoint_dir)))
    return Worker, driver


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "restore",
    [
        ("docs/memory-tier.md", "loaded = ray_graceful.load_latest("),
        ("docs/checkpoints.md", "ray_graceful.load_state_dict(ckpt.shard_path("),
    ],
    ids=["memory-tier.md", "checkpoints.md"],
)
def test_the_readme_worker_survives_an_eviction_and_the_docs_restore_resumes_it(
    ray_cluster, tmp_path, restore
):
    """README's worker and driver line; SIGTERM to one rank while the other sits in its
    all-reduce; a new group restores with the docs' snippet: the committed step, bit for bit."""
    checkpoint_dir = str(tmp_path / "ckpt")
    Worker, driver = readme_worker_class(checkpoint_dir)
    scope = {"Coordinator": ray_graceful.Coordinator, "GracefulConfig": ray_graceful.GracefulConfig}
    exec(compile(driver, "README.md", "exec"), scope)
    coordinator = scope["coordinator"]
    actor = ray.remote(Worker).options(num_cpus=0)
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = [actor.remote(r, 2, address) for r in range(2)]
    restarted: list = []
    try:
        ray.get([r.init_worker_process_group.remote() for r in ranks], timeout=120)
        assert ray.get([r.run.remote(3) for r in ranks], timeout=60) == [3, 3]
        saved = ray.get(ranks[0].weights.remote(), timeout=30)
        victim = ray.get(ranks[1].pid.remote(), timeout=30)
        blocked = ranks[0].run.remote(1000)  # rank 1 never joins: rank 0 sits in all_reduce
        time.sleep(0.5)
        os.kill(victim, signal.SIGTERM)
        outcome = coordinator.wait_outcome(timeout=60, cycle=0)
        assert outcome is not None and outcome.result == "committed", outcome
        assert outcome.committed["step"] == 3
        ray.wait([blocked], timeout=30)

        address = f"tcp://127.0.0.1:{free_port()}"
        restarted = [actor.remote(r, 2, address) for r in range(2)]
        ray.get([r.init_worker_process_group.remote() for r in restarted], timeout=120)
        relative, marker = restore
        loaded = ray.get(
            [r.restore.remote(relative, marker, checkpoint_dir) for r in restarted], timeout=60
        )
        assert [x["step"] for x in loaded] == [3, 3], loaded
        for weights in ray.get([r.weights.remote() for r in restarted], timeout=30):
            assert all(torch.equal(a, b) for a, b in zip(weights, saved, strict=True))
        assert ray.get([r.run.remote(2) for r in restarted], timeout=60) == [5, 5]
    finally:
        kill_actors(*ranks, *restarted)
        coordinator.shutdown()


def test_the_snippets_register_and_restore_the_same_state():
    """The consistency itself, readable without a cluster: what the README registers is what
    the restore snippets load into the model."""
    readme = snippet("README.md", "class DistributedTorchRayActor(GracefulWorkerMixin)")
    assert "state_dict=self.model.state_dict" in readme
    memory = snippet("docs/memory-tier.md", "loaded = ray_graceful.load_latest(")
    assert "model.load_state_dict(loaded.state)" in memory
    disk = snippet("docs/checkpoints.md", "ray_graceful.load_state_dict(ckpt.shard_path(")
    assert 'model.load_state_dict(state["state"])' in disk
