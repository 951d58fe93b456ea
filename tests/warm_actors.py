"""A data-parallel worker that adopts the warm restart as docs/worker.md shows it.

Model and optimizer (SGD with momentum, so the optimizer has state to get wrong) are updated
by a deterministic step: every rank's gradient is all-reduced and averaged, so every replica
holds bitwise the same state at each step - which is what lets a test compare them with the
committed checkpoint.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

from ray_graceful import GracefulConfig, GracefulWorkerMixin, Rejoined
from tests.actors import init_gloo


class WarmWorker(GracefulWorkerMixin):
    def __init__(
        self,
        world: int = 0,
        rank: int = 0,
        addr: str = "",
        port: int = 0,
        config: GracefulConfig | None = None,
    ) -> None:
        self._group = (world, rank, addr, port)
        self.config = config
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 16)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.step = 0

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])

    def init(self, config: GracefulConfig, shard: str = "model") -> str:
        """``shard``: this rank's shard label (default: every rank a replica of "model")."""
        world, rank, addr, port = self._group
        init_gloo(rank, world, addr, port)
        return str(
            self.graceful_setup(
                "policy",
                shard=shard,
                state_dict=self.state,
                load_state_dict=self.load,
                config=config,
            )
        )

    def rejoin(self) -> Rejoined:  # the warm restart: the user's side
        joined = self.graceful_rejoin(
            state_dict=self.state, load_state_dict=self.load, config=self.config
        )
        self.step = joined.step if joined.joined else self.step
        return joined

    def rejoin_without_loader(self) -> Rejoined:  # a spare that forgot load_state_dict=
        joined = self.graceful_rejoin(state_dict=self.state, config=self.config)
        self.step = joined.step if joined.joined else self.step
        return joined

    def train(self, steps: int, step_s: float = 0.0, late_s: float = 0.0) -> int:
        """``step_s``: a pause after each boundary; ``late_s``: one before it, inside the step
        (a rank slower than its peers, which wait for it in the next step's all-reduce)."""
        for _ in range(steps):
            x = torch.full((4, 16), math.sin(self.step))  # bounded: no step overflows
            self.opt.zero_grad()
            self.model(x).pow(2).mean().backward()
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            self.opt.step()
            self.step += 1
            time.sleep(late_s)
            if self.should_stop(self.step):
                break
            time.sleep(step_s)
        return self.step

    def snapshot(self) -> dict:
        """Rank, world, step and the full state, as plain tensors."""
        return {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "step": self.step,
            "pid": os.getpid(),
            "state": {k: v.clone() for k, v in self.model.state_dict().items()},
            "momentum": [
                self.opt.state[p]["momentum_buffer"].clone() for p in self.model.parameters()
            ],
        }

    def all_reduce_rank(self) -> float:
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        return x.item()

    def pid(self) -> int:
        return os.getpid()

    def die_as_it_sends(self) -> None:
        """Fault injection: this process is SIGKILLed at the moment its warm restart would send
        its held shard to a spare over the new group - after the group formed, the spare
        already waiting in its receive. Only this process's own module is changed."""
        import signal

        from ray_graceful.worker import peer_transfer

        def crash(*_args: object) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        peer_transfer.send = crash

    def actor_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_actor_id()


class AsyncWarmWorker(WarmWorker):
    """SkyRL/verl-shaped: async methods with blocking torch calls inside (the actor is async)."""

    async def train(  # type: ignore[override]
        self, steps: int, step_s: float = 0.0, late_s: float = 0.0
    ) -> int:
        return WarmWorker.train(self, steps, step_s, late_s)

    async def rejoin(self) -> Rejoined:  # type: ignore[override]
        return WarmWorker.rejoin(self)
