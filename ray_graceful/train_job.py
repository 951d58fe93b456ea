"""A small TorchTrainer job (DDP on gloo, CPU): the Ray Train test and `bench recovery` run it.

It appends one line per executed step to ``progress`` (rank, step, time) and one per attempt
to ``attempt_file`` (rank, "start", step, time), so a test can tell where each attempt started,
when training was going again, and whether a step ran twice. Periodic checkpoints every
``every`` steps; an emergency checkpoint when ray_graceful says stop.
"""

from __future__ import annotations

import os
import time


def train_func(config: dict) -> None:
    import ray.train
    import torch
    from ray.train.torch import prepare_model

    from ray_graceful.train import emergency_checkpoint, resume_step, shard_dir, should_stop

    rank = ray.train.get_context().get_world_rank()
    model = prepare_model(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            emergency = resume_step(d)
            path = os.path.join(shard_dir(d) or d, "model.pt")
            if emergency is None:
                with open(os.path.join(d, "step")) as f:
                    start = int(f.read())
            else:
                start = emergency
            model.module.load_state_dict(torch.load(path))
    attempt = config["attempt_file"]
    with open(attempt, "a") as f:
        f.write(f"{rank} start {start} {time.time()}\n")

    def save(directory: str) -> None:
        torch.save(model.module.state_dict(), os.path.join(directory, "model.pt"))

    x = torch.ones(4, 8)
    for step in range(start, config["total"]):
        opt.zero_grad()
        model(x).sum().backward()  # DDP all-reduces the gradients over gloo
        opt.step()
        time.sleep(config["step_s"])
        with open(config["progress"], "a") as f:
            f.write(f"{rank} {step + 1} {time.time()}\n")
        done = step + 1
        if config.get("graceful", True) and should_stop(done):
            emergency_checkpoint(save, done)
        if done % config["every"] == 0:
            checkpoint_out = None
            if rank == 0:
                import tempfile

                d = tempfile.mkdtemp()
                save(d)
                with open(os.path.join(d, "step"), "w") as f:
                    f.write(str(done))
                checkpoint_out = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"step": done}, checkpoint=checkpoint_out)
