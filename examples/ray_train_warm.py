"""Ray Train's warm path (Ray >= 2.56): the evicted worker is replaced alone, the other keeps
its process.

Mid-run the driver sends a notice for rank 1 (what `ray-graceful notify` sends). The ranks
agree on the stop step; rank 1 saves nothing it need not and leaves; Ray Train starts a new
worker in its slot alone; rank 0 keeps its process, model, optimizer and DDP wrapper's module,
and both form the group again at the committed step - the new worker loads it, no step is
lost or run twice.

    python examples/ray_train_warm.py            # a local Ray instance, two CPU workers
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import ray
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.nn.parallel import DistributedDataParallel

from ray_graceful import Coordinator, GracefulConfig
from ray_graceful.train import (
    GracefulTorchConfig,
    GracefulTrainCallback,
    carry_on,
    setup,
    should_stop,
    step_guard,
)


def train_func(config: dict) -> None:
    net = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def state() -> dict:
        return {"model": net.state_dict(), "optimizer": optimizer.state_dict()}

    def load(saved: dict) -> None:
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])

    step = setup(state_dict=state, load_state_dict=load) or 0  # a new worker: where it joins
    model = DistributedDataParallel(net)  # over the group setup() registered or joined
    rank = ray.train.get_context().get_world_rank()
    print(f"rank {rank} starts at step {step} (pid {os.getpid()})")
    while step < config["steps"]:
        with step_guard():  # a peer that crashed mid-step ends the step here, not the run
            optimizer.zero_grad()
            model(torch.ones(8, 16)).sum().backward()
            optimizer.step()
            step += 1
        time.sleep(0.2)
        if should_stop(step):  # agreed by all ranks
            step = carry_on(step)  # back in the new group, at the step every member holds
            model = DistributedDataParallel(net)  # DDP holds the group it was built with
    print(f"rank {rank} finished at step {step} (pid {os.getpid()})")


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

    work = tempfile.mkdtemp(prefix="ray-train-warm-example-")
    config = GracefulConfig(
        train_shards="replicated",
        checkpoint_dir=os.path.join(work, "ckpt"),
        coordinator_name=f"train-warm-{os.getpid()}",
    )
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": 40},
        scaling_config=ScalingConfig(num_workers=2),
        torch_config=GracefulTorchConfig(),
        run_config=RunConfig(
            storage_path=os.path.join(work, "storage"),
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
