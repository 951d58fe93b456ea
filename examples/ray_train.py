"""Ray Train (V2) with ray_graceful: one callback, two calls in the training function.

Mid-run the driver sends a notice (what `ray-graceful notify` or a drained node would send):
the ranks agree to stop, rank 0 writes the emergency checkpoint (DDP: replicated state, one
saver), Ray Train restarts the run, and it resumes at the emergency step - no step lost.

    python examples/ray_train.py                 # a local Ray instance, two CPU workers
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

from ray_graceful import Coordinator, GracefulConfig
from ray_graceful.train import (
    GracefulTrainCallback,
    emergency_checkpoint,
    resume_step,
    shard_dir,
    should_stop,
)


def train_func(config: dict) -> None:
    model = prepare_model(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = resume_step(d) or int(Path(d, "step").read_text())
            model.module.load_state_dict(torch.load(os.path.join(shard_dir(d) or d, "model.pt")))
    if ray.train.get_context().get_world_rank() == 0:
        print(f"attempt starts at step {start}")

    def save(directory: str) -> None:
        torch.save(model.module.state_dict(), os.path.join(directory, "model.pt"))

    for step in range(start, config["steps"]):
        optimizer.zero_grad()
        model(torch.ones(8, 16)).sum().backward()
        optimizer.step()
        time.sleep(0.2)
        if should_stop(step + 1):  # agreed by all ranks
            emergency_checkpoint(save, step + 1)  # reports to Ray Train, then raises
        if (step + 1) % 10 == 0:
            d = tempfile.mkdtemp()
            save(d)
            with open(os.path.join(d, "step"), "w") as f:
                f.write(str(step + 1))
            ray.train.report({"step": step + 1}, checkpoint=Checkpoint.from_directory(d))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="local")
    parser.add_argument(
        "--notify-after",
        type=float,
        default=3.0,
        help="seconds after the ranks registered when the driver sends the notice",
    )
    args = parser.parse_args()
    ray.init(address=args.address)

    config = GracefulConfig(train_shards="replicated", coordinator_name=f"train-{os.getpid()}")
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": 40},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            storage_path=tempfile.mkdtemp(prefix="ray-train-example-"),
            callbacks=[GracefulTrainCallback(config)],
            failure_config=FailureConfig(max_failures=2),
        ),
    )

    def evict_later() -> None:
        coordinator = None
        for _ in range(240):  # the callback starts the coordinator; the ranks register with it
            try:
                coordinator = coordinator or Coordinator.connect(config)
                if any(r["rank"] == 1 for r in coordinator.status()["ranks"]):
                    break
            except ValueError:  # no coordinator yet
                pass
            time.sleep(0.5)
        time.sleep(args.notify_after)
        answer = coordinator.notify(
            rank=("train", 1), reason="example: rank 1 is being evicted", deadline=time.time() + 20
        )
        print(f"notice accepted: {answer.accepted} ({answer.reason or 'ok'})")

    threading.Thread(target=evict_later, daemon=True).start()
    result = trainer.fit()
    print(f"finished at step {result.metrics['step']}; error: {result.error}")


if __name__ == "__main__":
    main()
